// Tensor parallelism: TP in {2, 4, 8}, with and without sequence parallelism, alone and with DP, trains the same
// model as one rank (losses and every gathered parameter, in double, dropout included); the collectives per layer
// are Megatron's, with its volume; per-rank parameter bytes are the replicated ones plus a 1/TP share of the rest.
// Every case runs for the three attention shapes (multi-head, grouped-query, multi-query), which share the
// model's code (models::GptModel): one translation unit for all three.
#include "catch.hpp"

#include <loom/models/gpt.hpp>
#include <loom/comm/local.hpp>

#include <algorithm>
#include <array>
#include <string>

#include "tensor_parallel_cases.hpp"

using namespace loom;
using namespace loom::test::tp;

namespace {

template <models::GptShape S, class Cfg>
std::vector<Run> run_layout(int micro_batches) {
  std::vector<Run> runs(Cfg::world_size);
  run_local<Cfg>([&](auto& ctx) { runs[ctx.rank()] = parallel_rank<S, Cfg>(ctx, micro_batches); });
  return runs;
}

template <models::GptShape S, class Cfg>
void check_layout(const Run& ref, int micro_batches = 1) {
  INFO("layout " << Cfg::name() << ", " << micro_batches << " micro-batches");
  const auto runs = run_layout<S, Cfg>(micro_batches);
  for (std::size_t r = 0; r < runs.size(); ++r) {
    INFO("rank " << r);
    const auto [loss, params] = difference(ref, runs[r]);
    INFO("loss difference " << loss << ", parameter difference " << params);
    CHECK(loss <= 1e-9);
    CHECK(params <= 1e-9);
    const double state = state_difference(ref, runs[r]);
    INFO("optimizer state difference " << state);
    CHECK(state <= 1e-9);
    CHECK(runs[r].params == runs[0].params);  // every rank gathers the same model
  }
}

}  // namespace

#define LOOM_TP_SHAPES Mha, Gqa, Mqa

TEMPLATE_TEST_CASE("every tensor-parallel layout trains the single-rank model", "[tp]", LOOM_TP_SHAPES) {
  constexpr models::GptShape S = TestType::shape;
  const auto ref = single_rank<S>();
  REQUIRE(ref.losses.size() == steps);
  CHECK(ref.losses.back() < ref.losses.front());
  check_layout<S, Parallel<TP<2>>>(ref);
  check_layout<S, Parallel<TP<2, SequenceParallel>>>(ref);
  check_layout<S, Parallel<TP<4>>>(ref);
  check_layout<S, Parallel<TP<4, SequenceParallel>>>(ref);
  check_layout<S, Parallel<TP<8>>>(ref);
  check_layout<S, Parallel<TP<8, SequenceParallel>>>(ref);
  check_layout<S, Parallel<TP<2>, DP<2>>>(ref);
  check_layout<S, Parallel<TP<2, SequenceParallel>, DP<2>>>(ref);
  check_layout<S, Parallel<TP<4>, DP<2>>>(ref);
  check_layout<S, Parallel<TP<4, SequenceParallel>, DP<2>>>(ref);
  // Gradients accumulated over micro-batches: what ranks share is summed once.
  check_layout<S, Parallel<TP<4>>>(ref, 2);
  check_layout<S, Parallel<TP<2, SequenceParallel>, DP<2>>>(ref, 2);
  // ZeRO-1 over the data-parallel group: each TP rank's part of the optimizer state, sharded.
  check_layout<S, Parallel<TP<2>, DP<2, ZeRO<1>>>>(ref);
  check_layout<S, Parallel<TP<2, SequenceParallel>, DP<4, ZeRO<1>>>>(ref, 2);
  // ZeRO-2: the gradients sharded as well.
  check_layout<S, Parallel<TP<2>, DP<2, ZeRO<2>>>>(ref);
  check_layout<S, Parallel<TP<2, SequenceParallel>, DP<2, ZeRO<2>>>>(ref, 2);
  // ZeRO-3: each TP rank's part of every unit, sharded over the data-parallel group and gathered when read.
  check_layout<S, Parallel<TP<2>, DP<2, ZeRO<3>>>>(ref);
  check_layout<S, Parallel<TP<2, SequenceParallel>, DP<2, ZeRO<3>, KeepGathered>>>(ref, 2);
}

// Ranks are threads and Catch2's assertions are not thread-safe: each rank records what it found, and the test's
// thread checks it.

TEMPLATE_TEST_CASE("the same seed gives the same whole model whatever the tensor-parallel degree", "[tp]",
                   LOOM_TP_SHAPES) {
  constexpr models::GptShape S = TestType::shape;
  models::Gpt<S, double> one(17);
  std::vector<double> whole(one.params().data(), one.params().data() + one.params().numel());
  std::vector<char> gathered(4), scattered(4);
  run_local<Parallel<TP<4>>>([&](auto& ctx) {
    models::Gpt<S, double, Parallel<TP<4>>> m(17, ctx.template comm<Axis::tp>());
    gathered[ctx.rank()] = m.gather(m.params().data()) == whole;
    // scatter is gather's inverse.
    std::vector<double> mine(static_cast<std::size_t>(m.params().numel()));
    m.scatter(whole.data(), mine.data());
    scattered[ctx.rank()] = std::equal(mine.begin(), mine.end(), m.params().data());
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(gathered[r]);
    CHECK(scattered[r]);
  }
}

template <models::GptShape S, bool SP>
void check_counts() {
  using Cfg = std::conditional_t<SP, Parallel<TP<4, SequenceParallel>>, Parallel<TP<4>>>;
  constexpr int t = 4;
  using Counts = std::array<layers::CollectiveCounts, 4>;
  std::vector<Counts> counts(t);
  run_local<Cfg>([&](auto& ctx) {
    models::Gpt<S, double, Cfg> m(3, ctx.template comm<Axis::tp>());
    const auto d = data<S>();
    std::vector<std::int32_t> in(batch * seq), tg(in.size());
    d.fill(0, 0, batch, in.data(), tg.data());
    m.forward(in.data(), tg.data(), batch, seq);
    m.backward();
    for (int p = 0; p < 4; ++p) counts[ctx.rank()][p] = m.tp().counts(static_cast<layers::Phase>(p));
  });
  const int L = S.layers;
  for (int r = 0; r < t; ++r) {
    INFO("rank " << r);
    const auto& f = counts[r][int(layers::Phase::forward)];
    const auto& b = counts[r][int(layers::Phase::backward)];
    if (SP) {  // an all-gather entering each region and a reduce-scatter leaving it, and their conjugates
      CHECK(f.all_reduce == 0);
      CHECK(f.all_gather == 2 * L);
      CHECK(f.reduce_scatter == 2 * L);
      CHECK(b.all_reduce == 0);
      CHECK(b.all_gather == 2 * L);
      CHECK(b.reduce_scatter == 2 * L);
    } else {  // Megatron: two all-reduces per layer forward, two backward
      CHECK(f.all_reduce == 2 * L);
      CHECK(f.all_gather + f.reduce_scatter == 0);
      CHECK(b.all_reduce == 2 * L);
      CHECK(b.all_gather + b.reduce_scatter == 0);
    }
    // 8 b s h (t - 1) / t elements per layer per micro-batch, sequence parallelism or not.
    const double formula = 8.0 * batch * seq * S.d_model * (t - 1) / t;
    CHECK(f.volume + b.volume == Approx(L * formula).epsilon(1e-12));
    // Outside the blocks: the embedding's reduction, the loss's two all-reduces and the head's backward (without
    // sequence parallelism; with it a reduce-scatter, the final norm's gather and the embedding's pair); in the
    // gradient synchronisation one all-reduce per chunk that has gradients ranks share.
    const auto& o = counts[r][int(layers::Phase::other)];
    CHECK(o.all_reduce == (SP ? 2 : 4));
    CHECK(o.all_gather == (SP ? 2 : 0));
    CHECK(o.reduce_scatter == (SP ? 2 : 0));
    const auto& g = counts[r][int(layers::Phase::grads)];
    const bool shared_kv = S.kv_heads < t;
    CHECK(g.all_reduce == (SP || shared_kv ? L + (SP ? 2 : 0) : 0));
  }
}

TEMPLATE_TEST_CASE("the collectives per layer are Megatron's", "[tp]", LOOM_TP_SHAPES) {
  SECTION("tensor parallelism") { check_counts<TestType::shape, false>(); }
  SECTION("with sequence parallelism") { check_counts<TestType::shape, true>(); }
}

TEMPLATE_TEST_CASE("per-rank parameter bytes are the replicated bytes plus a TP-th of the rest", "[tp]",
                   LOOM_TP_SHAPES) {
  constexpr models::GptShape S = TestType::shape;
  constexpr int t = 4;
  const auto global = models::Gpt<S, double, Parallel<TP<t>>>::param_specs(0, true);
  std::size_t replicated = 0, sharded = 0;
  for (const auto& s : global) (s.replicated ? replicated : sharded) += numel_of(s.shape) * sizeof(double);
  CHECK(replicated + sharded == S.params() * sizeof(double));
  std::vector<typename models::Gpt<S, double, Parallel<TP<t>>>::ParamBytes> bytes(t);
  std::vector<std::size_t> held(t);
  run_local<Parallel<TP<t>>>([&](auto& ctx) {
    models::Gpt<S, double, Parallel<TP<t>>> m(3, ctx.template comm<Axis::tp>());
    bytes[ctx.rank()] = m.param_bytes();
    held[ctx.rank()] = static_cast<std::size_t>(m.params().numel()) * sizeof(double);
  });
  std::size_t total = 0;
  for (int r = 0; r < t; ++r) {
    INFO("rank " << r);
    CHECK(bytes[r].replicated == replicated);
    CHECK(bytes[r].replicated + bytes[r].sharded == held[r]);
    if (S.vocab % t == 0 && S.kv_heads % t == 0) CHECK(bytes[r].sharded * t == sharded);
    total += bytes[r].sharded;
  }
  // kv heads held by several ranks are counted once per holder.
  const std::size_t kv = 2 * static_cast<std::size_t>(S.kv_heads) * S.head_dim() * (S.d_model + 1) * S.layers *
                         sizeof(double);
  CHECK(total == sharded + (S.kv_heads < t ? kv * (t / S.kv_heads - 1) : 0));
}

TEMPLATE_TEST_CASE("with tensor parallelism, ZeRO-1 and ZeRO-3 shard each rank's part", "[tp][zero][memory]",
                   LOOM_TP_SHAPES) {
  constexpr models::GptShape S = TestType::shape;
  // Per rank, f64 and AdamW, after a step. ZeRO-1: its part of the parameters and of the gradients (Psi_t elements
  // each), and the state of its chunk of each bucket of its part: 8 Psi_t + 8 Psi_t + 16 Psi_r bytes. ZeRO-3: its
  // chunk of each unit of its part, for all three: 8 Psi_r + 8 Psi_r + 16 Psi_r.
  const auto d = data<S>();
  auto measure = [&]<class Cfg>(Cfg) {
    using Model = models::Gpt<S, double, models::ModelLayout<Cfg>>;
    std::vector<std::array<std::size_t, 3>> held(Cfg::world_size);
    std::vector<std::int64_t> psi_t(Cfg::world_size), psi_r(Cfg::world_size);
    run_local<Cfg>([&](auto& ctx) {
      train::TrainerOptions<models::GptOptions> o;
      o.seed = 3, o.model = options();
      o.step.batch = batch, o.step.seq = seq;
      train::Trainer<Cfg, Model, optim::AdamW<double>> trainer(ctx, d, o, [](const auto& specs, std::int64_t n) {
        return optim::AdamW<double>(specs, n);
      });
      trainer.step(0);
      const auto& m = rank_memory();
      held[ctx.rank()] = {m.in_use(MemoryUse::parameters), m.in_use(MemoryUse::gradients),
                          m.in_use(MemoryUse::optimizer_state)};
      const auto& part = trainer.model();
      psi_t[ctx.rank()] = part.params().numel();
      const auto buckets = Cfg::zero_stage == 3
                               ? train::unit_buckets_of(part)
                               : train::make_buckets(part.specs(), sizeof(double), o.step.bucket_bytes);
      psi_r[ctx.rank()] = test::shard_elements(buckets, 2, ctx.template coord<Axis::dp>());
    });
    return std::tuple(held, psi_t, psi_r);
  };
  const auto [held, psi_t, psi_r] = measure(Parallel<TP<2>, DP<2, ZeRO<1>>>{});
  const auto [held3, psi_t3, psi_r3] = measure(Parallel<TP<2>, DP<2, ZeRO<3>>>{});
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(held[r][0] == 8 * static_cast<std::size_t>(psi_t[r]));
    CHECK(held[r][1] == 8 * static_cast<std::size_t>(psi_t[r]));
    CHECK(held[r][2] == 16 * static_cast<std::size_t>(psi_r[r]));
    CHECK(2 * psi_r[r] - psi_t[r] <= 1);  // half of the part, up to the rounding of its one bucket
    CHECK(held3[r][0] == 8 * static_cast<std::size_t>(psi_r3[r]));
    CHECK(held3[r][1] == 8 * static_cast<std::size_t>(psi_r3[r]));
    CHECK(held3[r][2] == 16 * static_cast<std::size_t>(psi_r3[r]));
    CHECK(psi_t3[r] == psi_t[r]);
    CHECK(2 * psi_r3[r] - psi_t3[r] <= static_cast<std::int64_t>(S.layers + 2));  // a rounding per unit
  }
}

TEST_CASE("sequence parallelism rejects a sequence it cannot split", "[tp]") {
  constexpr models::GptShape S = mha;
  std::vector<std::string> msg(4);
  run_local<Parallel<TP<4, SequenceParallel>>>([&](auto& ctx) {
    models::Gpt<S, double, Parallel<TP<4, SequenceParallel>>> m(3, ctx.template comm<Axis::tp>());
    std::vector<std::int32_t> ids(6, 1);
    try {
      m.forward(ids.data(), ids.data(), 1, 6);
    } catch (const Error& e) {
      msg[ctx.rank()] = e.what();
    }
  });
  for (const auto& m : msg) CHECK(m.find("but its length 6 is not a multiple of it") != std::string::npos);
}

TEST_CASE("a communicator of the wrong size is refused", "[tp]") {
  constexpr models::GptShape S = mha;
  std::vector<std::string> msg(2);
  run_local<Parallel<DP<2>>>([&](auto& ctx) {
    try {
      models::Gpt<S, double, Parallel<TP<4>>> m(3, ctx.template comm<Axis::dp>());
    } catch (const Error& e) {
      msg[ctx.rank()] = e.what();
    }
  });
  for (const auto& m : msg) CHECK(m.find("has 2 ranks but the layout tp4 has tp = 4") != std::string::npos);
}

TEST_CASE("a model whose shape is a value checks the rules when it is built", "[tp]") {
  // The rules Gpt<S, ...> checks at compile time: heads = 6 does not split over 4 ranks.
  constexpr models::GptShape six_heads{2, 6, 6, 36, 40, 8};
  static_assert(!models::tensor_parallel_violation(six_heads, 4, false).empty());
  std::vector<std::string> msg(4);
  std::vector<char> same(4);
  run_local<Parallel<TP<4>>>([&](auto& ctx) {
    auto& tp = ctx.template comm<Axis::tp>();
    try {
      models::GptModel<double, Parallel<TP<4>>> m(six_heads, 3, tp);
    } catch (const Error& e) {
      msg[ctx.rank()] = e.what();
    }
    // A shape that splits builds the model Gpt<S, ...> builds, parameter for parameter.
    models::GptModel<double, Parallel<TP<4>>> a(mha, 3, tp);
    models::Gpt<mha, double, Parallel<TP<4>>> b(3, tp);
    same[ctx.rank()] = a.param_specs().size() == b.param_specs().size() &&
                       std::equal(a.params().data(), a.params().data() + a.params().numel(), b.params().data());
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r << ": " << msg[r]);
    CHECK(msg[r].find("a GPT of 2 layers, heads 6/6, d_model 36") != std::string::npos);
    CHECK(msg[r].find("cannot be built on tp4: heads must be divisible by TP") != std::string::npos);
    CHECK(same[r]);
  }
}

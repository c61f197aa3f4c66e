// Tensor parallelism: TP in {2, 4, 8}, with and without sequence parallelism, alone and with DP, trains the same
// model as one rank (losses and every gathered parameter, in double, dropout included); the collectives per layer
// are Megatron's, with its volume; per-rank parameter bytes are the replicated ones plus a 1/TP share of the rest.
// Compiled once per attention shape (LOOM_TP_SHAPE = mha, gqa or mqa).
#include "catch.hpp"

#include <loom/comm/local.hpp>

#include <mutex>
#include <string>

#include "tensor_parallel_cases.hpp"

using namespace loom;
using namespace loom::test::tp;

namespace {

constexpr models::GptShape S = LOOM_TP_SHAPE;

template <class Cfg>
std::vector<Run> run_layout() {
  std::vector<Run> runs(Cfg::world_size);
  run_local<Cfg>([&](auto& ctx) { runs[ctx.rank()] = parallel_rank<S, Cfg>(ctx); });
  return runs;
}

template <class Cfg>
void check_layout(const Run& ref) {
  INFO("layout " << Cfg::name());
  const auto runs = run_layout<Cfg>();
  for (std::size_t r = 0; r < runs.size(); ++r) {
    INFO("rank " << r);
    const auto [loss, params] = difference(ref, runs[r]);
    INFO("loss difference " << loss << ", parameter difference " << params);
    CHECK(loss <= 1e-9);
    CHECK(params <= 1e-9);
    CHECK(runs[r].params == runs[0].params);  // every rank gathers the same model
  }
}

}  // namespace

TEST_CASE("every tensor-parallel layout trains the single-rank model", "[tp]") {
  const auto ref = single_rank<S>();
  REQUIRE(ref.losses.size() == steps);
  CHECK(ref.losses.back() < ref.losses.front());
  check_layout<Parallel<TP<2>>>(ref);
  check_layout<Parallel<TP<2, SequenceParallel>>>(ref);
  check_layout<Parallel<TP<4>>>(ref);
  check_layout<Parallel<TP<4, SequenceParallel>>>(ref);
  check_layout<Parallel<TP<8>>>(ref);
  check_layout<Parallel<TP<8, SequenceParallel>>>(ref);
  check_layout<Parallel<TP<2>, DP<2>>>(ref);
  check_layout<Parallel<TP<2, SequenceParallel>, DP<2>>>(ref);
  check_layout<Parallel<TP<4>, DP<2>>>(ref);
  check_layout<Parallel<TP<4, SequenceParallel>, DP<2>>>(ref);
}

TEST_CASE("the same seed gives the same whole model whatever the tensor-parallel degree", "[tp]") {
  models::Gpt<S, double> one(17);
  std::vector<double> whole(one.params().data(), one.params().data() + one.params().numel());
  run_local<Parallel<TP<4>>>([&](auto& ctx) {
    models::Gpt<S, double, Parallel<TP<4>>> m(17, ctx.template comm<Axis::tp>());
    CHECK(m.gather(m.params().data()) == whole);
    // scatter is gather's inverse.
    std::vector<double> mine(static_cast<std::size_t>(m.params().numel()));
    m.scatter(whole.data(), mine.data());
    CHECK(std::equal(mine.begin(), mine.end(), m.params().data()));
  });
}

template <bool SP>
void check_counts() {
  using Cfg = std::conditional_t<SP, Parallel<TP<4, SequenceParallel>>, Parallel<TP<4>>>;
  constexpr int t = 4;
  run_local<Cfg>([&](auto& ctx) {
    models::Gpt<S, double, Cfg> m(3, ctx.template comm<Axis::tp>());
    const auto d = data<S>();
    std::vector<std::int32_t> in(batch * seq), tg(in.size());
    d.fill(0, 0, batch, in.data(), tg.data());
    m.forward(in.data(), tg.data(), batch, seq);
    m.backward();
    const auto& f = m.tp().counts(layers::Phase::forward);
    const auto& b = m.tp().counts(layers::Phase::backward);
    const int L = S.layers;
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
    // Outside the blocks: the embedding's reduction, the loss's two all-reduces and, with sequence parallelism,
    // the final norm's gather; in the gradient synchronisation only what ranks share.
    const auto& o = m.tp().counts(layers::Phase::other);
    CHECK(o.all_reduce == (SP ? 2 : 4));  // embedding (no SP), loss max, loss sums, dlnf (no SP)
    const auto& g = m.tp().counts(layers::Phase::grads);
    const bool shared_kv = S.kv_heads < t;
    CHECK(g.all_reduce == (SP || shared_kv ? L + (SP ? 2 : 0) : 0));
  });
}

TEST_CASE("the collectives per layer are Megatron's", "[tp]") {
  SECTION("tensor parallelism") { check_counts<false>(); }
  SECTION("with sequence parallelism") { check_counts<true>(); }
}

TEST_CASE("per-rank parameter bytes are the replicated bytes plus a TP-th of the rest", "[tp]") {
  constexpr int t = 4;
  const auto global = models::Gpt<S, double, Parallel<TP<t>>>::param_specs(0, true);
  std::size_t replicated = 0, sharded = 0;
  for (const auto& s : global) (s.replicated ? replicated : sharded) += numel_of(s.shape) * sizeof(double);
  CHECK(replicated + sharded == S.params() * sizeof(double));
  std::size_t total = 0;
  run_local<Parallel<TP<t>>>([&](auto& ctx) {
    models::Gpt<S, double, Parallel<TP<t>>> m(3, ctx.template comm<Axis::tp>());
    const auto b = m.param_bytes();
    CHECK(b.replicated == replicated);
    CHECK(b.replicated + b.sharded == static_cast<std::size_t>(m.params().numel()) * sizeof(double));
    static std::mutex mu;
    std::lock_guard lock(mu);
    total += b.sharded;
    if (S.vocab % t == 0 && S.kv_heads % t == 0) CHECK(b.sharded * t == sharded);
  });
  // kv heads held by several ranks are counted once per holder.
  const std::size_t kv = 2 * static_cast<std::size_t>(S.kv_heads) * S.head_dim() * (S.d_model + 1) * S.layers *
                         sizeof(double);
  CHECK(total == sharded + (S.kv_heads < t ? kv * (t / S.kv_heads - 1) : 0));
}

TEST_CASE("sequence parallelism rejects a sequence it cannot split", "[tp]") {
  run_local<Parallel<TP<4, SequenceParallel>>>([&](auto& ctx) {
    models::Gpt<S, double, Parallel<TP<4, SequenceParallel>>> m(3, ctx.template comm<Axis::tp>());
    std::vector<std::int32_t> ids(6, 1);
    try {
      m.forward(ids.data(), ids.data(), 1, 6);
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find("sequence length 6 is not a multiple of it") != std::string::npos);
    }
  });
}

TEST_CASE("a communicator of the wrong size is refused", "[tp]") {
  run_local<Parallel<DP<2>>>([&](auto& ctx) {
    std::string msg;
    try {
      models::Gpt<S, double, Parallel<TP<4>>> m(3, ctx.template comm<Axis::dp>());
    } catch (const Error& e) {
      msg = e.what();
    }
    CHECK(msg.find("has 2 ranks but the layout tp4 has tp = 4") != std::string::npos);
  });
}

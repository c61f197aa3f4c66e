// Mixture of experts in the model and the trainer: the layer's gradient against central differences; expert
// parallelism (EP 2, 4 and 8, alone and with data parallelism and ZeRO 1, 2 and 3, tensor (and sequence), context and
// pipeline parallelism, micro-batches and recompute)
// trains the single-rank model that holds every expert, with capacity dropping active and dropless, top-1 and top-2,
// shared experts and dense blocks between MoE blocks (5 AdamW steps in double with dropout: losses, every parameter
// and the optimizer state within 1e-9); the all-to-all volume per MoE layer is the routed rows x d_model x the
// element size, from the communicator's counts; a layout or shape that cannot work is refused with its numbers.
#include "catch.hpp"

#include <loom/models/gpt.hpp>
#include <loom/comm/local.hpp>

#include "equivalence_checks.hpp"

#include <cmath>
#include <map>
#include <mutex>
#include <string>

using namespace loom;
using namespace loom::test::pp;

namespace {

// 8 experts, top-2, an MoE layer in each of 2 blocks, experts 24 wide, no shared expert.
constexpr models::GptShape top2{2, 4, 2, 16, 37, 8, 0, 8, 2, 1, 24, 0};
// Top-1 with one shared expert.
constexpr models::GptShape top1{2, 4, 2, 16, 37, 8, 0, 8, 1, 1, 24, 1};
// 4 blocks, MoE in blocks 0 and 2 (dense 1 and 3), 4 experts.
constexpr models::GptShape mixed{4, 4, 2, 16, 37, 8, 0, 4, 2, 2, 24, 0};

//! The pipeline tests' data and dropout, routed with capacity factor `capacity` (0: dropless), both router losses.
Setup moe_setup(double capacity, models::Recompute recompute = models::Recompute::none) {
  Setup su = setup();
  su.options.moe.capacity_factor = capacity;
  su.options.moe.aux_loss_coeff = 0.01;
  su.options.moe.z_loss_coeff = 0.001;
  su.options.recompute = recompute;
  return su;
}

template <models::GptShape S>
const Run& reference(double capacity) {
  static std::map<double, Run> runs;
  static std::mutex m;
  std::lock_guard lock(m);
  auto it = runs.find(capacity);
  if (it == runs.end()) {
    const Setup su = moe_setup(capacity);
    it = runs.emplace(capacity, test::single_rank<S>(su.data, su.options, steps, su.batch, su.seq)).first;
  }
  return it->second;
}

//! Layout Cfg with m micro-batches against the single-rank run, at capacity factor `capacity`.
template <class Cfg, models::GptShape S = top2>
void check(double capacity, int micro_batches = 1, models::Recompute recompute = models::Recompute::none) {
  INFO("layout " << Cfg::name() << ", experts " << S.experts << " top-" << S.top_k << ", capacity factor "
                 << capacity << ", m = " << micro_batches << ", recompute " << models::describe_recompute(recompute));
  std::vector<Run> runs(Cfg::world_size);
  const Setup su = moe_setup(capacity, recompute);
  run_local<Cfg>([&](auto& ctx) { runs[ctx.rank()] = pipeline_rank<Cfg, S>(ctx, micro_batches, {}, su); });
  check_equivalent(reference<S>(capacity), runs);
}

}  // namespace

TEST_CASE("the MoE model's gradient against central differences, with dropping and both router losses", "[moe]") {
  for (const bool sigmoid : {false, true}) {
    models::GptOptions o;
    o.moe.capacity_factor = 1.0, o.moe.aux_loss_coeff = 0.1, o.moe.z_loss_coeff = 0.01, o.moe.sigmoid = sigmoid;
    models::Gpt<top1, double> m(7, o);
    std::vector<std::int32_t> ids(16), tg(16);
    for (std::size_t i = 0; i < ids.size(); ++i)
      ids[i] = static_cast<std::int32_t>(i * 7 % 37), tg[i] = static_cast<std::int32_t>(i * 5 % 37);
    auto total = [&] {
      const double l = m.forward(ids.data(), tg.data(), 2, 8);
      const auto s = m.take_moe_stats();
      return l + s.aux_loss + s.z_loss;
    };
    m.zero_grad();
    total();
    const auto st = [&] {
      m.backward();
      return m.take_moe_stats();
    }();
    CHECK(st.forwards == 0);  // backward routes nothing
    // Dropping is active: capacity ceil(8 x 1 / 8 x 1) = 1 per expert and sequence.
    m.forward(ids.data(), tg.data(), 2, 8);
    const auto routed = m.take_moe_stats();
    CHECK(routed.forwards == 2);
    CHECK(routed.assignments == 2 * 16);
    CHECK(routed.dropped > 0);
    const std::vector<double> g(m.grads().data(), m.grads().data() + m.grads().numel());
    int checked = 0;
    for (const auto& sp : m.specs()) {
      for (int t = 0; t < 2; ++t) {
        const std::int64_t i = sp.offset + (t * 7919 + 13) % numel_of(sp.shape);
        double* p = m.params().data() + i;
        const double x = *p, h = 1e-5;
        *p = x + h;
        const double up = total();
        *p = x - h;
        const double down = total();
        *p = x;
        const double fd = (up - down) / (2 * h);
        INFO((sigmoid ? "sigmoid" : "softmax") << " routing, " << sp.name << " element " << i - sp.offset);
        CHECK(g[std::size_t(i)] == Approx(fd).epsilon(1e-4).margin(1e-7));
        ++checked;
      }
    }
    CHECK(checked == 2 * static_cast<int>(m.specs().size()));
  }
}

TEST_CASE("EP 2, 4 and 8 train the single-rank model, dropping and dropless", "[moe][ep]") {
  check<Parallel<DP<2>, EP<2>>>(1.0);
  check<Parallel<DP<2>, EP<2>>>(0.0);
  check<Parallel<DP<4>, EP<4>>>(1.0);
  check<Parallel<DP<8>, EP<8>>>(0.0);
  check<Parallel<DP<8>, EP<8>>>(1.0);
}

TEST_CASE("top-1 with a shared expert, and MoE blocks between dense ones, under expert parallelism", "[moe][ep]") {
  check<Parallel<DP<2>, EP<2>>, top1>(1.25);
  check<Parallel<DP<4>, EP<4>>, top1>(0.0);
  check<Parallel<DP<2>, EP<2>>, mixed>(1.0);
  check<Parallel<DP<4>, EP<4>>, mixed>(0.0);
}

TEST_CASE("expert parallelism with data parallelism and ZeRO, tensor and pipeline parallelism, micro-batches and "
          "recompute",
          "[moe][ep]") {
  check<Parallel<DP<2>>>(1.0);              // every expert on each data-parallel rank
  check<Parallel<DP<4>, EP<2>>>(1.0);       // expert-data-parallel groups of 2
  check<Parallel<DP<4>, EP<2>>, top1>(0.0);
  check<Parallel<TP<2>, DP<2>, EP<2>>>(1.0);
  check<Parallel<TP<2>, DP<2>, EP<2>>, top1>(1.0);  // the shared expert split over tp
  check<Parallel<DP<2>, EP<2>, PP<2>>>(1.0, 2);
  check<Parallel<DP<2>, EP<2>, PP<2, ZeroBubbleH1>>>(1.0, 4);
  check<Parallel<DP<2>, EP<2>>>(1.0, 2);
  check<Parallel<DP<2>, EP<2>>>(1.0, 1, models::Recompute::full);
  check<Parallel<DP<2, ZeRO<1>>, EP<2>>>(1.0);
  check<Parallel<DP<4, ZeRO<1>>, EP<2>>, top1>(0.0);
  check<Parallel<DP<4, ZeRO<2>>, EP<2>>>(1.0, 2);
  check<Parallel<DP<4, ZeRO<3>>, EP<2>>>(1.0, 2);  // the experts' parameters gathered over edp, unit by unit
  check<Parallel<DP<4, ZeRO<3>>, EP<4>>, top1>(0.0);
  check<Parallel<DP<2, ZeRO<3>, KeepGathered>, EP<2>, PP<2>>, mixed>(1.0, 2);
  check<Parallel<TP<2>, DP<2, ZeRO<1>>, EP<2>, PP<2>>, mixed>(1.0, 2);
  check<Parallel<TP<2>, DP<4>, EP<4>, PP<2>>, mixed>(0.0, 2);
}

TEST_CASE("a sequence split over ranks is routed whole: sequence and context parallelism with experts",
          "[moe][ep][cp]") {
  check<Parallel<TP<2, SequenceParallel>>>(1.0);                  // each tp rank routes its rows of the sequences
  check<Parallel<TP<2, SequenceParallel>, DP<2>, EP<2>>, top1>(1.0);
  check<Parallel<CP<2>>>(1.0);                                    // each cp rank holds two chunks of each sequence
  check<Parallel<CP<2>, EP<2>>>(1.0);                             // experts split over the cp ranks
  check<Parallel<CP<2, Ulysses>, DP<2>, EP<4>>, top1>(0.0);
  check<Parallel<TP<2, SequenceParallel>, CP<2>, EP<2>>, mixed>(1.0, 1, models::Recompute::selective);
}

TEST_CASE("the all-to-all volume per MoE layer is the routed rows x d_model x the element size", "[moe][ep]") {
  // Two experts, each token to both (top-2, dropless), one expert per rank: every rank sends each of its N tokens'
  // rows to the other rank and returns as many, forward and backward.
  constexpr models::GptShape both{2, 4, 2, 16, 37, 8, 0, 2, 2, 1, 24, 0};
  using Cfg = Parallel<DP<2>, EP<2>>;
  constexpr int B = 3, T = 8;
  run_local<Cfg>([&](auto& ctx) {
    models::GptOptions o;
    o.moe.capacity_factor = 0;
    models::Gpt<both, double, models::ModelLayout<Cfg>> m(3, ctx.template comm<Axis::tp>(), nullptr,
                                                          &ctx.template comm<Axis::ep>(), models::GptPart{}, o);
    std::vector<std::int32_t> ids(B * T), tg(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i)
      ids[i] = static_cast<std::int32_t>((i * 3 + ctx.rank()) % 37), tg[i] = static_cast<std::int32_t>(i % 37);
    m.forward(ids.data(), tg.data(), B, T);
    const comm::Traffic forward = m.ep()->traffic();
    m.backward();
    const comm::Traffic all = m.ep()->traffic();
    const double rows = B * T, d = both.d_model, layers = both.layers;
    // Per layer: the counts (one int per peer), then the rows out and back.
    CHECK(forward.count(comm::Collective::all_to_all) == layers);
    CHECK(forward.count(comm::Collective::all_to_all_v) == 2 * layers);
    CHECK(forward.elements == layers * (1 + 2 * rows * d));
    CHECK(forward.bytes == layers * (4 + 2 * rows * d * sizeof(double)));
    // Backward: the output gradients out and the input gradients back, no counts.
    CHECK(all.count(comm::Collective::all_to_all_v) == 4 * layers);
    CHECK(all.bytes - forward.bytes == layers * 2 * rows * d * sizeof(double));
  });
}

TEST_CASE("a shape or layout that cannot split its experts is refused with its numbers", "[moe][ep]") {
  constexpr models::GptShape six{2, 4, 2, 16, 37, 8, 0, 6, 2, 1, 24, 0};
  using Cfg = Parallel<DP<4>, EP<4>>;
  using Model = models::Gpt<top2, double, models::ModelLayout<Cfg>>;
  std::vector<std::string> messages(Cfg::world_size), missing(Cfg::world_size);
  const Setup su = moe_setup(1.0);
  run_local<Cfg>([&](auto& ctx) {
    try {
      models::GptModel<double, models::ModelLayout<Cfg>> m(six, 3, ctx.template comm<Axis::tp>(), nullptr,
                                                           &ctx.template comm<Axis::ep>(), models::GptPart{});
    } catch (const Error& e) {
      messages[ctx.rank()] = e.what();
    }
    try {  // the layout has an expert-parallel axis; the trainer is given no communicator for it
      auto at = train::rank_in_layout(ctx);
      at.ep = nullptr;
      train::TrainerOptions<models::GptOptions> o;
      o.step.batch = su.batch, o.step.seq = su.seq;
      train::TrainerOf<Model, optim::AdamW<double>> t(at, su.data, o, [](const auto& specs, std::int64_t n) {
        return optim::AdamW<double>(specs, n, {});
      });
    } catch (const Error& e) {
      missing[ctx.rank()] = e.what();
    }
  });
  for (const auto& msg : messages)
    CHECK(msg == "loom: a GPT of 2 layers, heads 4/2, d_model 16, d_ff 64, vocabulary 37, max_seq 8 and 6 experts "
                 "cannot be built on " + std::string(models::ModelLayout<Cfg>::name()) +
                 " with 4 expert-parallel ranks: the experts must be divisible by EP");
  for (const auto& msg : missing)
    CHECK(msg == "loom: the layout splits the experts over 4 expert-parallel ranks but the rank was given no "
                 "expert-parallel groups (RankInLayout::ep, edp)");
}

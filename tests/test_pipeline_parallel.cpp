// Pipeline parallelism: every schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V) over p in {2, 4} stages and
// m in {p, 2p} micro-batches, alone and with tensor (and sequence) and data parallelism, trains the same model as
// one rank: losses and every parameter, in double, dropout included.
#include "catch.hpp"

#include <loom/models/gpt.hpp>
#include <loom/comm/local.hpp>

#include "equivalence_checks.hpp"

#include <string>

using namespace loom;
using namespace loom::test::pp;

namespace {

//! Layout Cfg (its PP policy names the schedule and chunks) with m micro-batches against the single-rank run.
template <class Cfg, models::GptShape S = shape>
void check(const Run& ref, int micro_batches, const std::vector<int>& split = {}) {
  constexpr Schedule schedule = Cfg::schedule;
  INFO("layout " << Cfg::name() << ", " << describe_schedule(schedule) << ", m = " << micro_batches << ", "
                 << S.layers << " blocks, split " << split.size() << " ways");
  std::vector<Run> runs(Cfg::world_size);
  run_local<Cfg>([&](auto& ctx) { runs[ctx.rank()] = pipeline_rank<Cfg, S>(ctx, micro_batches, split); });
  // Each stage holds the blocks the split gives its virtual stages (chunk c of stage s is virtual stage k).
  const int P = Cfg::template size<Axis::pp>, V = pipeline::chunks_per_stage(schedule, Cfg::virtual_stages);
  const auto at = train::layer_bounds(S.layers, P * V, split);
  for (int r = 0; r < Cfg::world_size; ++r)
    for (int c = 0; c < V; ++c) {
      const int k = pipeline::virtual_stage(schedule, P, Cfg::template coord<Axis::pp>(r), c);
      CHECK(runs[r].blocks.at(2 * c) == at[k]);
      CHECK(runs[r].blocks.at(2 * c + 1) == at[k + 1]);
    }
  check_equivalent(ref, runs);
}

}  // namespace

TEST_CASE("every schedule trains the single-rank model", "[pipeline]") {
  // p in {2, 4} x m in {p, 2p, 3p}; two chunks per stage for interleaved and zb-v (eight blocks for p = 4).
  const auto ref = single_rank(), ref_deep = single_rank<deep>();
  for (int m : {2, 4, 6}) {
    check<Parallel<PP<2, GPipe>>>(ref, m);
    check<Parallel<PP<2>>>(ref, m);
    check<Parallel<PP<2, Interleaved<2>>>>(ref, m);
    check<Parallel<PP<2, ZeroBubbleH1>>>(ref, m);
    check<Parallel<PP<2, ZeroBubbleV>>>(ref, m);
  }
  for (int m : {4, 8, 12}) {
    check<Parallel<PP<4, GPipe>>>(ref, m);
    check<Parallel<PP<4>>>(ref, m);
    check<Parallel<PP<4, ZeroBubbleH1>>>(ref, m);
    check<Parallel<PP<4, Interleaved<2>>>, deep>(ref_deep, m);
    check<Parallel<PP<4, ZeroBubbleV>>, deep>(ref_deep, m);
  }
}

TEST_CASE("pipeline parallelism combines with tensor, sequence and data parallelism", "[pipeline]") {
  const auto ref = single_rank();
  check<Parallel<TP<2>, PP<2>, DP<2>>>(ref, 2);
  check<Parallel<TP<2, SequenceParallel>, PP<2, Interleaved<2>>, DP<2>>>(ref, 2);
  check<Parallel<PP<4>, DP<2>>>(ref, 4);
  check<Parallel<TP<2>, PP<4, ZeroBubbleH1>>>(ref, 4);
  check<Parallel<TP<2, SequenceParallel>, PP<2, ZeroBubbleV>>>(ref, 4);
}

TEST_CASE("pipeline parallelism combines with ZeRO-1, 2 and 3", "[pipeline][zero]") {
  const auto ref = single_rank();
  check<Parallel<PP<2>, DP<2, ZeRO<1>>>>(ref, 2);
  check<Parallel<PP<2, ZeroBubbleV>, DP<4, ZeRO<1>>>>(ref, 2);
  check<Parallel<TP<2, SequenceParallel>, PP<2, Interleaved<2>>, DP<2, ZeRO<1>>>>(ref, 2);
  check<Parallel<PP<2>, DP<2, ZeRO<2>>>>(ref, 2);
  check<Parallel<PP<2, ZeroBubbleH1>, DP<4, ZeRO<2>>>>(ref, 2);
  // ZeRO-3 keeps every unit of its parts gathered over the schedule.
  check<Parallel<PP<2>, DP<2, ZeRO<3>, KeepGathered>>>(ref, 4);
  check<Parallel<PP<2, ZeroBubbleV>, DP<2, ZeRO<3>, KeepGathered>>>(ref, 2);
  check<Parallel<TP<2>, PP<2, GPipe>, DP<2, ZeRO<3>, KeepGathered>>>(ref, 2);
}

TEST_CASE("an explicit layer split trains the single-rank model", "[pipeline]") {
  // Uneven stages: the first or last stage lighter (it also holds the embedding or the loss), and uneven chunks.
  const auto ref = single_rank(), ref_deep = single_rank<deep>();
  check<Parallel<PP<2>>>(ref, 4, {1, 3});
  check<Parallel<PP<2, ZeroBubbleH1>>>(ref, 2, {3, 1});
  check<Parallel<PP<2, Interleaved<2>>>, deep>(ref_deep, 4, {1, 3, 3, 1});
  check<Parallel<PP<2, ZeroBubbleV>>, deep>(ref_deep, 4, {2, 1, 1, 4});
  check<Parallel<TP<2>, PP<2>, DP<2>>>(ref, 2, {3, 1});
  check<Parallel<PP<4, GPipe>>, deep>(ref_deep, 4, {1, 2, 2, 3});
}

TEST_CASE("a layer split that does not fit the pipeline is refused with its numbers", "[pipeline]") {
  using train::layer_bounds;
  CHECK(layer_bounds(8, 4, {}) == std::vector<int>{0, 2, 4, 6, 8});
  CHECK(layer_bounds(8, 3, {2, 5, 1}) == std::vector<int>{0, 2, 7, 8});
  CHECK_THROWS_WITH(layer_bounds(6, 4, {}), "loom: the model's 6 layers do not split evenly over 4 pipeline parts (pp x chunks); give an explicit split "
                    "of the layers");
  CHECK_THROWS_WITH(layer_bounds(8, 2, {1, 2, 5}), "loom: the layer split has 3 entries but the pipeline has 2 parts (pp x chunks)");
  CHECK_THROWS_WITH(layer_bounds(8, 2, {0, 8}), "loom: part 0 of the layer split has 0 layers; each part needs at least one");
  CHECK_THROWS_WITH(layer_bounds(8, 2, {4, 3}), "loom: the layer split adds up to 7 layers but the model has 8");
}

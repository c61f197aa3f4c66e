// Pipeline parallelism: every schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V) over p in {2, 4} stages and
// m in {p, 2p} micro-batches, alone and with tensor (and sequence) and data parallelism, trains the same model as
// one rank: losses and every parameter, in double, dropout included.
#include "catch.hpp"

#include <loom/comm/local.hpp>

#include "pipeline_parallel_cases.hpp"

#include <string>

using namespace loom;
using namespace loom::test::pp;

namespace {

template <class Cfg, models::GptShape S = shape>
void check(const Run& ref, Schedule schedule, int micro_batches, int v = 1, const std::vector<int>& split = {}) {
  INFO("layout " << Cfg::name() << ", " << describe_schedule(schedule) << ", m = " << micro_batches << ", v = " << v
                 << ", " << S.layers << " blocks, split " << split.size() << " ways");
  std::vector<Run> runs(Cfg::world_size);
  run_local<Cfg>(
      [&](auto& ctx) { runs[ctx.rank()] = pipeline_rank<Cfg, S>(ctx, schedule, micro_batches, v, split); });
  // Each stage holds the blocks the split gives its virtual stages (chunk c of stage s is virtual stage k).
  const int P = Cfg::template size<Axis::pp>, V = pipeline::chunks_per_stage(schedule, v);
  const auto at = train::layer_bounds(S.layers, P * V, split);
  for (int r = 0; r < Cfg::world_size; ++r)
    for (int c = 0; c < V; ++c) {
      const int k = pipeline::virtual_stage(schedule, P, Cfg::template coord<Axis::pp>(r), c);
      CHECK(runs[r].blocks.at(2 * c) == at[k]);
      CHECK(runs[r].blocks.at(2 * c + 1) == at[k + 1]);
    }
  std::string disagreement;
  const Run whole = combine(runs, disagreement);
  CHECK(disagreement.empty());
  INFO(disagreement);
  for (std::size_t r = 0; r < runs.size(); ++r) CHECK(runs[r].losses == runs[0].losses);
  const auto [loss, params] = difference(ref, whole);
  INFO("loss difference " << loss << ", parameter difference " << params);
  CHECK(loss <= 1e-9);
  CHECK(params <= 1e-9);
}

}  // namespace

TEST_CASE("every schedule trains the single-rank model", "[pipeline]") {
  // p in {2, 4} x m in {p, 2p, 3p}; two chunks per stage for interleaved and zb-v (eight blocks for p = 4).
  const auto ref = single_rank(), ref_deep = single_rank<deep>();
  for (int m : {2, 4, 6}) {
    check<Parallel<PP<2>>>(ref, Schedule::gpipe, m);
    check<Parallel<PP<2>>>(ref, Schedule::one_f_one_b, m);
    check<Parallel<PP<2>>>(ref, Schedule::interleaved, m, 2);
    check<Parallel<PP<2>>>(ref, Schedule::zero_bubble_h1, m);
    check<Parallel<PP<2>>>(ref, Schedule::zero_bubble_v, m);
  }
  for (int m : {4, 8, 12}) {
    check<Parallel<PP<4>>>(ref, Schedule::gpipe, m);
    check<Parallel<PP<4>>>(ref, Schedule::one_f_one_b, m);
    check<Parallel<PP<4>>>(ref, Schedule::zero_bubble_h1, m);
    check<Parallel<PP<4>>, deep>(ref_deep, Schedule::interleaved, m, 2);
    check<Parallel<PP<4>>, deep>(ref_deep, Schedule::zero_bubble_v, m);
  }
}

TEST_CASE("pipeline parallelism combines with tensor, sequence and data parallelism", "[pipeline]") {
  const auto ref = single_rank();
  check<Parallel<TP<2>, PP<2>, DP<2>>>(ref, Schedule::one_f_one_b, 2);
  check<Parallel<TP<2, SequenceParallel>, PP<2>, DP<2>>>(ref, Schedule::interleaved, 2, 2);
  check<Parallel<PP<4>, DP<2>>>(ref, Schedule::one_f_one_b, 4);
  check<Parallel<TP<2>, PP<4>>>(ref, Schedule::zero_bubble_h1, 4);
  check<Parallel<TP<2, SequenceParallel>, PP<2>>>(ref, Schedule::zero_bubble_v, 4);
}

TEST_CASE("an explicit layer split trains the single-rank model", "[pipeline]") {
  // Uneven stages: the first or last stage lighter (it also holds the embedding or the loss), and uneven chunks.
  const auto ref = single_rank(), ref_deep = single_rank<deep>();
  check<Parallel<PP<2>>>(ref, Schedule::one_f_one_b, 4, 1, {1, 3});
  check<Parallel<PP<2>>>(ref, Schedule::zero_bubble_h1, 2, 1, {3, 1});
  check<Parallel<PP<2>>, deep>(ref_deep, Schedule::interleaved, 4, 2, {1, 3, 3, 1});
  check<Parallel<PP<2>>, deep>(ref_deep, Schedule::zero_bubble_v, 4, 2, {2, 1, 1, 4});
  check<Parallel<TP<2>, PP<2>, DP<2>>>(ref, Schedule::one_f_one_b, 2, 1, {3, 1});
  check<Parallel<PP<4>>, deep>(ref_deep, Schedule::gpipe, 4, 1, {1, 2, 2, 3});
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

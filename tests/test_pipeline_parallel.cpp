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
void check(const Run& ref, Schedule schedule, int micro_batches, int v = 1) {
  INFO("layout " << Cfg::name() << ", " << describe_schedule(schedule) << ", m = " << micro_batches << ", v = " << v
                 << ", " << S.layers << " blocks");
  std::vector<Run> runs(Cfg::world_size);
  run_local<Cfg>([&](auto& ctx) { runs[ctx.rank()] = pipeline_rank<Cfg, S>(ctx, schedule, micro_batches, v); });
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

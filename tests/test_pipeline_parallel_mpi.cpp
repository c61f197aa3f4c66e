// Pipeline parallelism under mpirun: every process is one rank; layouts of the process count with pipeline
// parallelism (and tensor, sequence and data parallelism, ZeRO-1 and ZeRO-2 included) under several schedules train the
// single-rank model, which each process computes itself: losses, parameters and the optimizer's state. The Llama and
// Mixtral families (test_families' shapes) on a subset of the layouts the same way.
#include "pipeline_parallel_cases.hpp"

#include <loom/models/gpt.hpp>
#include <loom/comm/mpi.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace loom;
using namespace loom::test::pp;

namespace {

// test_families' Llama and Mixtral.
constexpr models::GptShape llama = models::llama3_spec({4, 4, 2, 16, 37, 8, 24}, 10000, {4, 1, 4, 8});
constexpr models::GptShape mixtral = models::mixtral_spec({4, 4, 2, 16, 37, 8, 0, 0, 2, 1, 12}, 4, 2, 10000);

//! Layout Cfg on this process's rank; every rank's run is gathered on each, to put the model together.
template <class Cfg, models::GptShape S = shape>
void check(const Run& ref, int rank, int micro_batches, const std::vector<int>& split = {}) {
  constexpr Schedule schedule = Cfg::schedule;
  Context<Cfg, comm::Mpi> ctx(comm::Mpi::Rank{rank});
  const Run mine = pipeline_rank<Cfg, S>(ctx, micro_batches, split);
  // Put the model together: every rank's parameters, optimizer state and what it holds, gathered.
  const std::size_t n = mine.params.size(), ranks = Cfg::world_size;
  std::vector<double> params(n * ranks), state(2 * n * ranks), held(n * ranks), h(mine.held.begin(), mine.held.end());
  ctx.world().all_gather(mine.params, params);
  ctx.world().all_gather(mine.state, state);
  ctx.world().all_gather(h, held);
  std::vector<Run> runs(Cfg::world_size);
  for (std::size_t r = 0; r < ranks; ++r) {
    runs[r].losses = mine.losses;
    runs[r].params.assign(params.begin() + r * n, params.begin() + (r + 1) * n);
    runs[r].state.assign(state.begin() + 2 * r * n, state.begin() + 2 * (r + 1) * n);
    for (std::size_t i = 0; i < n; ++i) runs[r].held.push_back(held[r * n + i] != 0);
  }
  std::string disagreement;
  const Run whole = combine(runs, disagreement);
  const auto [loss, diff] = difference(ref, whole);
  const double state_diff = state_difference(ref, whole);
  if (!disagreement.empty() || !(loss <= 1e-9 && diff <= 1e-9 && state_diff <= 1e-9))
    throw Error(loom::detail::cat("rank ", rank, " of ", Cfg::name(), ", ", describe_schedule(schedule), ", m = ",
                                  micro_batches, ": loss differs by ", loss, ", parameters by ", diff,
                                  ", optimizer state by ", state_diff, " ", disagreement));
  if (rank == 0)
    std::printf("test_pipeline_parallel_mpi: %s%s %s m=%d%s equals the single-rank run\n",
                S == llama ? "Llama on " : S == mixtral ? "Mixtral on " : "", Cfg::name().data(),
                describe_schedule(schedule).data(), micro_batches, split.empty() ? "" : " (uneven layer split)");
}

//! A family's shape S on layout Cfg, against its own single-rank run.
template <class Cfg, models::GptShape S>
void check_family(int rank, int micro_batches) {
  static const Run ref = single_rank<S>();
  check<Cfg, S>(ref, rank, micro_batches);
}

template <int N, class F>
int run(int argc, char** argv, F&& cases) {
  return run_mpi<Parallel<DP<N>>>(argc, argv, [&](auto& world) { cases(single_rank(), world.rank()); });
}

}  // namespace

int main(int argc, char** argv) {
  const char* np = std::getenv("OMPI_COMM_WORLD_SIZE");
  switch (np ? std::atoi(np) : 1) {
    case 2:
      return run<2>(argc, argv, [](const Run& ref, int r) {
        check<Parallel<PP<2>>>(ref, r, 4);
        check<Parallel<PP<2, Interleaved<2>>>>(ref, r, 2);
        check<Parallel<PP<2, ZeroBubbleV>>>(ref, r, 4);
        check<Parallel<PP<2>>>(ref, r, 2, {1, 3});
        check_family<Parallel<PP<2, ZeroBubbleV>>, llama>(r, 4);
        check_family<Parallel<TP<2, SequenceParallel>>, mixtral>(r, 1);
      });
    case 4:
      return run<4>(argc, argv, [](const Run& ref, int r) {
        check<Parallel<PP<4, GPipe>>>(ref, r, 4);
        check<Parallel<PP<4, ZeroBubbleH1>>>(ref, r, 8);
        check<Parallel<TP<2, SequenceParallel>, PP<2>>>(ref, r, 2);
        check<Parallel<PP<2, ZeroBubbleH1>, DP<2, ZeRO<1>>>>(ref, r, 2);
        check<Parallel<PP<2, GPipe>, DP<2, ZeRO<2>>>>(ref, r, 4);
        check<Parallel<PP<2>, DP<2, ZeRO<3>, KeepGathered>>>(ref, r, 2);
        check_family<Parallel<CP<2>, DP<2, ZeRO<1>>>, llama>(r, 2);
        check_family<Parallel<DP<4>, EP<4>>, mixtral>(r, 2);
      });
    case 8:
      return run<8>(argc, argv, [](const Run& ref, int r) {
        check<Parallel<TP<2>, PP<2>, DP<2>>>(ref, r, 2);
        check<Parallel<TP<2>, PP<4>>>(ref, r, 4);
        check<Parallel<PP<4, ZeroBubbleH1>, DP<2>>>(ref, r, 4);
        check_family<Parallel<TP<2>, PP<2>, DP<2>>, llama>(r, 2);
      });
    default: std::fprintf(stderr, "run under mpirun with 2, 4 or 8 processes\n"); return 1;
  }
}

// Data parallelism under mpirun: every process is one rank of DP = the process count, plain and with ZeRO<1>, <2>
// and <3>, and hybrid sharding over two groups; each compares its run with the single-rank reference it computes itself (tests/data_parallel_cases.hpp),
// for 1 and 4 micro-batches: losses, parameters and the optimizer's state, gathered.
#include "data_parallel_cases.hpp"

#include <loom/comm/mpi.hpp>
#include <loom/config.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

using namespace loom;

//! This process's run of layout Cfg, checked against the reference.
template <class Cfg>
void check(int rank, const test::Run& ref) {
  Context<Cfg, comm::Mpi> ctx(comm::Mpi::Rank{rank});
  for (int m : {1, 4}) {
    for (std::size_t bucket : {std::size_t{2048}, std::size_t{25} << 20}) {
      const auto r = test::data_parallel_rank(ctx, m, bucket, true);
      const auto [loss, params] = test::difference(ref, r);
      const double state = test::state_difference(ref, r);
      if (!(loss <= 1e-9 && params <= 1e-9 && state <= 1e-9))
        throw Error(loom::detail::cat("rank ", rank, ", ", Cfg::name(), ", ", m, " micro-batches, buckets of ",
                                      bucket, " bytes: loss differs by ", loss, ", parameters by ", params,
                                      ", optimizer state by ", state));
    }
  }
  if (rank == 0)
    std::printf("test_data_parallel_mpi: %s equals the single-rank run for 1 and 4 micro-batches\n",
                std::string(Cfg::name()).c_str());
}

template <int N>
int run(int argc, char** argv) {
  return run_mpi<Parallel<DP<N>>>(argc, argv, [](auto& ctx) {
    const auto ref = test::single_rank();
    check<Parallel<DP<N>>>(ctx.rank(), ref);
    check<Parallel<DP<N, ZeRO<1>>>>(ctx.rank(), ref);
    check<Parallel<DP<N, ZeRO<2>>>>(ctx.rank(), ref);
    check<Parallel<DP<N, ZeRO<3>>>>(ctx.rank(), ref);
    if constexpr (N >= 4) check<Parallel<DP<N, ZeRO<3>, HybridShard<N / 2>>>>(ctx.rank(), ref);  // 2 groups
  });
}

int main(int argc, char** argv) {
  const char* np = std::getenv("OMPI_COMM_WORLD_SIZE");
  switch (np ? std::atoi(np) : 1) {
    case 2: return run<2>(argc, argv);
    case 4: return run<4>(argc, argv);
    case 8: return run<8>(argc, argv);
    default: return run<1>(argc, argv);
  }
}

// Tensor parallelism under mpirun: every process is one rank; each layout of the process count (tensor parallel,
// with and without sequence parallelism, with data parallelism) trains the single-rank model, which each process
// computes itself, for each attention shape (multi-head, grouped-query, multi-query).
#include "tensor_parallel_cases.hpp"

#include <loom/models/gpt.hpp>
#include <loom/comm/mpi.hpp>

#include <cstdio>
#include <cstdlib>

using namespace loom;
using namespace loom::test::tp;

namespace {

//! Layout Cfg on this process's rank for the shape of Shape (MPI is started once for all layouts and shapes).
template <class Shape, class Cfg>
void check(const Run& ref, int rank) {
  constexpr models::GptShape S = Shape::shape;
  Context<Cfg, comm::Mpi> ctx(comm::Mpi::Rank{rank});
  const auto r = parallel_rank<S, Cfg>(ctx);
  const auto [loss, params] = difference(ref, r);
  if (!(loss <= 1e-9 && params <= 1e-9))
    throw Error(loom::detail::cat("rank ", rank, " of ", Cfg::name(), ": loss differs by ", loss,
                                  ", parameters by ", params));
  if (rank == 0)
    std::printf("test_tensor_parallel_mpi (%s): %s equals the single-rank run\n", Shape::name, Cfg::name().data());
}

template <class Shape, class... Cfgs>
void check_shape(int rank) {
  const auto ref = single_rank<Shape::shape>();
  (check<Shape, Cfgs>(ref, rank), ...);
}

template <int N, class... Cfgs>
int run(int argc, char** argv) {
  return run_mpi<Parallel<DP<N>>>(argc, argv, [](auto& world) {
    check_shape<Mha, Cfgs...>(world.rank());
    check_shape<Gqa, Cfgs...>(world.rank());
    check_shape<Mqa, Cfgs...>(world.rank());
  });
}

}  // namespace

int main(int argc, char** argv) {
  const char* np = std::getenv("OMPI_COMM_WORLD_SIZE");
  switch (np ? std::atoi(np) : 1) {
    case 2: return run<2, Parallel<TP<2>>, Parallel<TP<2, SequenceParallel>>>(argc, argv);
    case 4:
      return run<4, Parallel<TP<4>>, Parallel<TP<4, SequenceParallel>>, Parallel<TP<2>, DP<2>>,
                 Parallel<TP<2, SequenceParallel>, DP<2>>>(argc, argv);
    case 8:
      return run<8, Parallel<TP<8>>, Parallel<TP<8, SequenceParallel>>, Parallel<TP<4>, DP<2>>,
                 Parallel<TP<4, SequenceParallel>, DP<2>>>(argc, argv);
    default: std::fprintf(stderr, "run under mpirun with 2, 4 or 8 processes\n"); return 1;
  }
}

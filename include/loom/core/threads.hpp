// The threads a rank's kernels use. Eigen's matrix products run on OpenMP teams; ranks that share a machine (threads
// of run_local, processes of run_mpi on one node) must share its cores too, or every product starts a team as large
// as the machine and the teams of different ranks spin against each other (on 2 cores, 8 ranks ran 100x slower).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace loom {

//! The threads each of `ranks` ranks running on this machine should use: OMP_NUM_THREADS where the user set it,
//! otherwise the hardware threads divided among the ranks, at least 1.
inline int threads_per_rank(int ranks) {
  if (const char* v = std::getenv("OMP_NUM_THREADS"); v && std::atoi(v) > 0) return std::atoi(v);
  const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, hardware / std::max(1, ranks));
}

//! The threads the calling thread's kernels use from now on (its OpenMP teams); nothing without OpenMP.
inline void use_threads([[maybe_unused]] int n) {
#ifdef _OPENMP
  omp_set_num_threads(std::max(1, n));
#endif
}

//! The threads the calling thread's kernels use now.
inline int threads_in_use() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace loom

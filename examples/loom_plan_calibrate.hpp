// loom-plan --calibrate (loom_plan_calibrate.cpp): this machine's rates and links as a cluster description.
#pragma once

#include <loom/plan/cluster.hpp>

#include <cstdio>
#include <string>

namespace loom_plan {

//! Measures this machine (its kernels at one thread and at all, a small operation's cost, all-reduces between two
//! ranks as threads and, with MPI, as processes: `self` relaunched under mpirun), logging each figure to `log`.
loom::plan::Cluster calibrate(const char* self, std::FILE* log);

//! Under mpirun (--calibrate-mpi FILE): two processes time all-reduces; rank 0 writes "bandwidth latency" to FILE.
int calibrate_mpi_child(int& argc, char**& argv, const std::string& out);

}  // namespace loom_plan

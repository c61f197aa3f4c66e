// What a launcher (mpirun, mpiexec, srun with PMI) told this process through the environment: whether it is one of
// several processes started together, and its rank among them. The communicators choose run_mpi or run_local by it
// (comm::launch), and the trace recorder names one file per process by it.
#pragma once

#include <cstdlib>
#include <string>

namespace loom {

//! What a launcher told this process through the environment.
struct Launch {
  long processes = 0;    //!< started together with this one, this one included; 0: no launcher; -1: several,
                         //!< known only because this process's rank is not 0
  long rank = 0;         //!< this process's rank among them
  std::string evidence;  //!< the variable that says so, as "NAME=value"; empty when there is none
  //! Whether this process is one of several: it should run its rank with run_mpi, not every rank as threads.
  bool several() const { return processes > 1 || processes < 0; }
};

//! The launch this process is part of, read from OMPI_COMM_WORLD_SIZE, PMI_SIZE or MV2_COMM_WORLD_SIZE and from
//! OMPI_COMM_WORLD_RANK, PMI_RANK or PMIX_RANK. A program can choose run_mpi or run_local by it, and so run
//! unchanged as threads or as MPI processes.
inline Launch launch() {
  Launch l;
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"})
    if (const char* v = std::getenv(var)) {
      l.rank = std::atol(v);
      if (l.rank > 0) l.processes = -1, l.evidence = std::string(var) + "=" + v;
      break;
    }
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"})
    if (const char* v = std::getenv(var)) {
      l.processes = std::atol(v), l.evidence = std::string(var) + "=" + v;
      break;
    }
  return l;
}

}  // namespace loom

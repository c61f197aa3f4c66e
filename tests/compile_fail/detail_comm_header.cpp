// expect: loom: comm/detail/ is private: include <loom/comm/local.hpp>, <loom/comm/mpi.hpp> or <loom/comm/nccl.hpp>
#ifdef LOOM_FAIL
#include <loom/comm/detail/worker.hpp>
#else
#include <loom/comm/local.hpp>
#endif
int main() {}

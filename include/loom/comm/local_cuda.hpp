// Device memory for the Local backend (<loom/comm/local_cuda.cuh>), for a program that links loom::cuda_kernels:
// any C++ compiler builds it, and including it installs the operations compiled in the library, so that ranks that
// are threads sharing one GPU pass device pointers to collectives.
#pragma once

#define LOOM_COMM_BACKEND_INCLUDED
#include <loom/comm/detail/device_memory.hpp>
#include <loom/comm/local.hpp>

namespace loom::comm::detail::local_cuda {

//! The device operations, defined in loom::cuda_kernels (src/local_cuda.cu).
const DeviceMemoryOps& compiled_ops();

//! Installs them when the program starts (once, whichever files include this header).
inline const bool compiled_installed = [] {
  device_memory_ops().store(&compiled_ops());
  return true;
}();

}  // namespace loom::comm::detail::local_cuda

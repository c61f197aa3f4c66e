// How the Local backend moves and reduces buffers in device memory, when its ranks are threads sharing one GPU.
// The backend itself is host code that any compiler builds; the CUDA implementation of these operations lives in
// <loom/comm/local_cuda.cuh>, and including that header (from a file nvcc compiles), or <loom/comm/local_cuda.hpp>
// (from any compiler, with loom::cuda_kernels), installs it. Without it,
// every buffer is host memory, as before. Private: include <loom/comm/local.hpp>.
#pragma once

#ifndef LOOM_COMM_BACKEND_INCLUDED
#error "loom: comm/detail/ is private: include <loom/comm/local.hpp>, <loom/comm/mpi.hpp> or <loom/comm/nccl.hpp>"
#endif

#include <loom/comm/types.hpp>

#include <atomic>
#include <cstddef>

namespace loom::comm::detail {

//! The device side of a Local collective. Each call completes before it returns (the next step of an algorithm
//! may be another rank's read of what it wrote).
struct DeviceMemoryOps {
  bool (*holds)(const void* p);                                          //!< whether p is device memory
  void (*copy)(void* dst, const void* src, std::size_t bytes);           //!< any direction
  void (*reduce_into)(DType, void* dst, const void* src, std::size_t n, Reduce);  //!< dst = dst op src
  void (*divide)(DType, void* dst, std::size_t n, int by);               //!< dst /= by (the end of an average)
};

//! The installed device operations, or null: then all memory is host memory.
inline std::atomic<const DeviceMemoryOps*>& device_memory_ops() {
  static std::atomic<const DeviceMemoryOps*> ops{nullptr};
  return ops;
}

}  // namespace loom::comm::detail

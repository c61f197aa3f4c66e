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
  void (*synchronize)(void* stream);  //!< waits until the work queued on a CUDA stream is done
};

//! The installed device operations, or null: then all memory is host memory.
inline std::atomic<const DeviceMemoryOps*>& device_memory_ops() {
  static std::atomic<const DeviceMemoryOps*> ops{nullptr};
  return ops;
}

//! For a backend that orders on the host: an operation ordered on a CUDA stream (Op::stream) waits here, on the
//! caller's thread, for the work queued there, and goes on as one whose buffers are ready. What it writes is in place
//! when it completes, before the stream's later work can run.
inline void order_on_host(Op& op) {
  if (!op.stream) return;
  const DeviceMemoryOps* ops = device_memory_ops().load(std::memory_order_acquire);
  if (!ops)
    throw Error(loom::detail::cat("loom: ", name_of(op.kind), " is ordered on a CUDA stream, but this program has no "
                                  "CUDA support for its communicators (include <loom/comm/local_cuda.hpp> and link "
                                  "loom::cuda_kernels)"));
  ops->synchronize(*op.stream);
  op.stream.reset();
}

}  // namespace loom::comm::detail

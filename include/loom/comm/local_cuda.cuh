// Device memory for the Local backend: ranks that are threads sharing one GPU pass device pointers to collectives,
// which then copy with cudaMemcpyAsync and reduce with a kernel, on a stream of the calling thread, and finish
// before they return. Include this header in a file nvcc compiles (link loom::cuda), or <loom/comm/local_cuda.hpp>
// from any compiler in a program that links loom::cuda_kernels; it installs itself, and the Local backend
// recognises device buffers from then on. NCCL refuses two ranks on one device, so this is how
// multi-rank layouts run on one GPU.
//
// A buffer handed to a collective must be ready: synchronise the stream that wrote it first, or issue the collective
// inside the communicator's on_stream(stream), which synchronises it. Every rank of a
// collective passes the same kind of memory (all host, or all device), which the backend checks.
#pragma once

#if defined(LOOM_EXTERN_CUDA_KERNELS)
#include <loom/comm/local_cuda.hpp>  // compiled once, in loom::cuda_kernels
#else

#define LOOM_COMM_BACKEND_INCLUDED
#include <loom/comm/detail/device_memory.hpp>
#include <loom/comm/local.hpp>
#include <loom/kernels/cuda/device.cuh>

#include <cstdint>

namespace loom::comm::detail::local_cuda {

using kernels::cuda::device_t;

//! The stream a thread's collectives run on: one per thread (rank threads and their communicators' workers), so
//! that ranks do not serialise on the legacy default stream.
inline cudaStream_t stream() {
  struct Owned {
    cudaStream_t s = nullptr;
    Owned() { LOOM_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
    ~Owned() {
      if (s) cudaStreamDestroy(s);
    }
  };
  thread_local Owned owned;
  return owned.s;
}

//! Arithmetic in float for the 16-bit types, natively otherwise (integers stay exact).
template <class T>
using arith_t = std::conditional_t<std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, float, T>;

//! dst[i] = dst[i] op src[i].
template <class T>
struct ReduceInto {
  static constexpr int width = 1;
  T* dst;
  const T* src;
  Reduce op;
  template <int N>
  __device__ void apply(std::size_t i) const {
    using A = arith_t<T>;
    const A x = static_cast<A>(dst[i]), y = static_cast<A>(src[i]);
    switch (op) {
      case Reduce::sum:
      case Reduce::avg: dst[i] = static_cast<T>(x + y); break;
      case Reduce::prod: dst[i] = static_cast<T>(x * y); break;
      case Reduce::max: dst[i] = x < y ? src[i] : dst[i]; break;
      case Reduce::min: dst[i] = y < x ? src[i] : dst[i]; break;
    }
  }
};

//! dst[i] /= by.
template <class T>
struct Divide {
  static constexpr int width = 1;
  T* dst;
  int by;
  template <int N>
  __device__ void apply(std::size_t i) const {
    using A = arith_t<T>;
    dst[i] = static_cast<T>(static_cast<A>(dst[i]) / static_cast<A>(by));
  }
};

inline bool holds(const void* p) { return kernels::cuda::detail::device_memory(p); }

inline void copy(void* dst, const void* src, std::size_t bytes) {
  if (!bytes || dst == src) return;
  const cudaStream_t s = stream();
  LOOM_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  LOOM_CUDA(cudaStreamSynchronize(s));
}

inline void reduce_into(DType t, void* dst, const void* src, std::size_t n, Reduce op) {
  if (!n) return;
  const cudaStream_t s = stream();
  visit_dtype(t, [&](auto tag) {
    using D = device_t<typename decltype(tag)::type>;
    kernels::cuda::detail::launch_map(ReduceInto<D>{static_cast<D*>(dst), static_cast<const D*>(src), op}, n, false,
                                      s, "Local device reduce");
  });
  LOOM_CUDA(cudaStreamSynchronize(s));
}

inline void divide(DType t, void* dst, std::size_t n, int by) {
  if (!n) return;
  const cudaStream_t s = stream();
  visit_dtype(t, [&](auto tag) {
    using D = device_t<typename decltype(tag)::type>;
    kernels::cuda::detail::launch_map(Divide<D>{static_cast<D*>(dst), by}, n, false, s, "Local device average");
  });
  LOOM_CUDA(cudaStreamSynchronize(s));
}

//! Null is the legacy default stream (Op::stream), whatever default stream this file is compiled for.
inline void synchronize(void* s) {
  LOOM_CUDA(cudaStreamSynchronize(s ? static_cast<cudaStream_t>(s) : cudaStreamLegacy));
}

inline constexpr DeviceMemoryOps ops{&holds, &copy, &reduce_into, &divide, &synchronize};

//! Installs the operations when the program starts (once, whichever files include this header).
inline const bool installed = [] {
  device_memory_ops().store(&ops);
  return true;
}();

}  // namespace loom::comm::detail::local_cuda

#endif

// Device memory for the Local backend: ranks that are threads sharing one GPU pass device pointers to collectives,
// which then copy with cudaMemcpyAsync and reduce with a kernel, on a stream of the calling thread, and finish
// before they return. Include this header in a file nvcc compiles (link loom::cuda); it installs itself, and the
// Local backend recognises device buffers from then on. NCCL refuses two ranks on one device, so this is how
// multi-rank layouts run on one GPU.
//
// A buffer handed to a collective must be ready: synchronise the stream that wrote it first. Every rank of a
// collective passes the same kind of memory (all host, or all device), which the backend checks.
#pragma once

#include <loom/comm/detail/device_memory.hpp>
#include <loom/comm/local.hpp>
#include <loom/kernels/cuda/check.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace loom::comm::detail::local_cuda {

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

// Element arithmetic in float for the 16-bit types, natively otherwise.
template <class T>
struct Arith {
  using type = T;
};
template <>
struct Arith<__nv_bfloat16> {
  using type = float;
};
template <>
struct Arith<__half> {
  using type = float;
};

template <class T>
__device__ inline T combine(T a, T b, Reduce op) {
  using A = typename Arith<T>::type;
  const A x = static_cast<A>(a), y = static_cast<A>(b);
  switch (op) {
    case Reduce::sum:
    case Reduce::avg: return static_cast<T>(x + y);
    case Reduce::prod: return static_cast<T>(x * y);
    case Reduce::max: return x < y ? b : a;
    case Reduce::min: return y < x ? b : a;
  }
  return a;
}

template <class T>
__global__ void reduce_kernel(T* __restrict__ dst, const T* __restrict__ src, std::size_t n, Reduce op) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    dst[i] = combine(dst[i], src[i], op);
}

template <class T>
__global__ void divide_kernel(T* dst, std::size_t n, int by) {
  using A = typename Arith<T>::type;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    dst[i] = static_cast<T>(static_cast<A>(dst[i]) / static_cast<A>(by));
}

inline unsigned grid_for(std::size_t n) {
  const std::size_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks ? blocks : 1) : 4096);
}

//! The device type with the bytes of loom's element type T (bf16 and fp16 are the same bits as CUDA's).
template <class T>
using device_t = std::conditional_t<std::is_same_v<T, bf16>, __nv_bfloat16,
                                    std::conditional_t<std::is_same_v<T, fp16>, __half, T>>;

inline bool holds(const void* p) {
  if (!p) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // a host pointer unknown to CUDA: not an error, not device memory
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

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
    reduce_kernel<D><<<grid_for(n), 256, 0, s>>>(static_cast<D*>(dst), static_cast<const D*>(src), n, op);
  });
  kernels::cuda::detail::check_launch("Local device reduce");
  LOOM_CUDA(cudaStreamSynchronize(s));
}

inline void divide(DType t, void* dst, std::size_t n, int by) {
  if (!n) return;
  const cudaStream_t s = stream();
  visit_dtype(t, [&](auto tag) {
    using D = device_t<typename decltype(tag)::type>;
    divide_kernel<D><<<grid_for(n), 256, 0, s>>>(static_cast<D*>(dst), n, by);
  });
  kernels::cuda::detail::check_launch("Local device average");
  LOOM_CUDA(cudaStreamSynchronize(s));
}

inline constexpr DeviceMemoryOps ops{&holds, &copy, &reduce_into, &divide};

//! Installs the operations when the program starts (once, whichever files include this header).
inline const bool installed = [] {
  device_memory_ops().store(&ops);
  return true;
}();

}  // namespace loom::comm::detail::local_cuda

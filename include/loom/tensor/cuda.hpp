// Tensor<T, Cuda>: tensors in the current GPU's memory, from the caching allocator (no cudaMalloc in a training
// step's steady state), and copies between host and device tensors. Needs the CUDA runtime: link loom::cuda.
#pragma once

#include <loom/tensor/cuda_allocator.hpp>
#include <loom/tensor/tensor.hpp>

#include <cuda_runtime_api.h>

namespace loom {

namespace detail {

template <>
struct DeviceMemory<Cuda> {
  static void* allocate(std::size_t bytes) { return bytes ? CudaAllocator::instance().allocate(bytes) : nullptr; }
  static void release(void* p, std::size_t) {
    if (p) CudaAllocator::instance().deallocate(p);
  }
};

inline void cuda_copy_check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw BackendError(loom::detail::cat("loom: ", what, " failed: ", cudaGetErrorString(rc), " (",
                                         cudaGetErrorName(rc), ")"));
}

//! Copies between two same-shaped tensors on any devices, run by run (cudaMemcpy2D would batch strided runs; the
//! tensors a training step copies are contiguous, one run).
template <class T, class D1, class D2>
void copy_runs(const Tensor<T, D1>& src, const Tensor<T, D2>& dst, cudaMemcpyKind kind) {
  LOOM_CHECK(src.shape() == dst.shape(), "copy from shape ", to_string(src.shape()), " to shape ",
             to_string(dst.shape()));
  for_each_run(src.shape(), src.strides(), dst.strides(), [&](auto a, auto b, auto n) {
    cuda_copy_check(cudaMemcpy(dst.data() + b, src.data() + a, static_cast<std::size_t>(n) * sizeof(T), kind),
                    "cudaMemcpy");
  });
}

}  // namespace detail

template <class T>
void copy(const Tensor<T, Host>& src, const Tensor<T, Cuda>& dst) {
  detail::copy_runs(src, dst, cudaMemcpyHostToDevice);
}
template <class T>
void copy(const Tensor<T, Cuda>& src, const Tensor<T, Host>& dst) {
  detail::copy_runs(src, dst, cudaMemcpyDeviceToHost);
}
template <class T>
void copy(const Tensor<T, Cuda>& src, const Tensor<T, Cuda>& dst) {
  detail::copy_runs(src, dst, cudaMemcpyDeviceToDevice);
}

//! Sets every element of a device tensor: zero by cudaMemset, other values through a host copy.
template <class T>
void fill_elements(const Tensor<T, Cuda>& t, T value) {
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(&value);
  if (t.is_contiguous() && std::all_of(bytes, bytes + sizeof(T), [](unsigned char b) { return b == 0; })) {
    detail::cuda_copy_check(cudaMemset(t.data(), 0, t.bytes()), "cudaMemset");
    return;
  }
  Tensor<T, Host> h(t.shape());
  fill_elements(h, value);
  copy(h, t);
}

//! A host copy of a device tensor, and a device copy of a host tensor.
template <class T>
Tensor<T, Host> to_host(const Tensor<T, Cuda>& t) {
  Tensor<T, Host> h(t.shape());
  copy(t, h);
  return h;
}
template <class T>
Tensor<T, Cuda> to_device(const Tensor<T, Host>& t) {
  Tensor<T, Cuda> d(t.shape());
  copy(t, d);
  return d;
}

}  // namespace loom

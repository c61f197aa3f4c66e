// What every CUDA kernel header shares: the element types (float, double, __nv_bfloat16, __half; loom::bf16 and
// loom::fp16 name the same bytes), their accumulation type, conversions, 16-byte packs, the device's figures, and
// the grid-stride element-wise launcher.
#pragma once

#include <loom/kernels/cuda/check.cuh>
#include <loom/tensor/cuda_allocator.hpp>

// The kernels use bf16 tensor cores (WMMA and mma.sync), ldmatrix and cp.async: compute capability 8.0 and newer.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "loom: the CUDA kernels need compute capability 8.0 or newer (Ampere, sm_80): drop the older architectures"
#endif

// Eigen 3.4's headers (through loom/core/half.hpp) trip nvcc's warnings about defaulted __host__ __device__
// members and constexpr calls; they are Eigen's, not ours.
#pragma nv_diagnostic push
#pragma nv_diag_suppress 20012, 20013, 20015
#include <loom/core/half.hpp>
#pragma nv_diagnostic pop
#include <loom/kernels/shape.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace loom::kernels::cuda {

using kernels::AttentionShape;

//! The CUDA type with T's bytes: loom::bf16 -> __nv_bfloat16, loom::fp16 -> __half, others unchanged.
template <class T>
struct device_type {
  using type = T;
};
template <>
struct device_type<bf16> {
  using type = __nv_bfloat16;
};
template <>
struct device_type<fp16> {
  using type = __half;
};
template <class T>
using device_t = typename device_type<std::remove_cv_t<T>>::type;

template <class T>
inline constexpr bool is_device_float_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, __nv_bfloat16> ||
    std::is_same_v<T, __half>;

//! A floating-point element type the CUDA kernels take: float, double, bf16 or fp16 (CUDA's or loom's name).
template <class T>
concept Floating = is_device_float_v<device_t<T>>;

//! The type arithmetic is done in for storage type T: double for double, float otherwise (as on the CPU).
template <class T>
using acc_t = std::conditional_t<std::is_same_v<device_t<T>, double>, double, float>;

namespace detail {

//! p as a pointer to the CUDA type of the same bytes.
template <class T>
auto* dev(T* p) {
  if constexpr (std::is_const_v<T>) return reinterpret_cast<const device_t<T>*>(p);
  else return reinterpret_cast<device_t<T>*>(p);
}

template <class T>
__host__ __device__ __forceinline__ acc_t<T> widen(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(x);
  else if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else return x;
}
template <class T, class A>
__host__ __device__ __forceinline__ T narrow(A x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16(static_cast<float>(x));
  else if constexpr (std::is_same_v<T, __half>) return __float2half(static_cast<float>(x));
  else return static_cast<T>(x);
}
//! a + b rounded, never contracted with a product before it into a fused multiply-add (whose one rounding would
//! differ from a separate kernel's add).
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
//! v, or with a residual's gradient r (not null) r[i] + v rounded to T: what accumulating v into r gives.
template <class T>
__device__ __forceinline__ T with_residual(T v, const T* r, std::size_t i) {
  return r == nullptr ? v : narrow<T>(add_rn(widen(r[i]), widen(v)));
}

// Accurate (not the fast-math intrinsics): results are compared with the CPU's to 1e-5.
__device__ __forceinline__ float exp_(float x) { return expf(x); }
__device__ __forceinline__ double exp_(double x) { return exp(x); }
__device__ __forceinline__ float log_(float x) { return logf(x); }
__device__ __forceinline__ double log_(double x) { return log(x); }
__device__ __forceinline__ float sqrt_(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_(double x) { return sqrt(x); }
__device__ __forceinline__ float tanh_(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_(double x) { return tanh(x); }
template <class A>
__device__ __forceinline__ A neg_inf() {
  if constexpr (std::is_same_v<A, double>) return -CUDART_INF;
  else return -CUDART_INF_F;
}

//! The maximum and the sum of x over each group of G consecutive lanes of a warp (G a power of two up to 32), in
//! every lane of the group.
template <int G, class A>
__device__ __forceinline__ A group_max(A x) {
#pragma unroll
  for (int o = G / 2; o > 0; o /= 2) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
template <int G, class A>
__device__ __forceinline__ A group_sum(A x) {
#pragma unroll
  for (int o = G / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

//! N elements loaded or stored as one access (16 bytes when N = vec_width<T>).
template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};
template <class T>
inline constexpr int vec_width = 16 / static_cast<int>(sizeof(T));

template <int N, class T>
__device__ __forceinline__ Pack<std::remove_const_t<T>, N> load_pack(T* p) {
  return *reinterpret_cast<const Pack<std::remove_const_t<T>, N>*>(p);
}
template <int N, class T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

//! Whether p may be read in packs of `bytes` (null counts as aligned: an empty range).
__host__ __device__ inline bool aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}
//! Whether every pointer allows 16-byte packs.
inline bool vec_ok(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (!aligned(p, 16)) return false;
  return true;
}

inline int current_device() {
  int d = 0;
  LOOM_CUDA(cudaGetDevice(&d));
  return d;
}

//! A device attribute of the current device, read once per thread and device.
template <cudaDeviceAttr Attr>
int device_attribute() {
  thread_local std::array<int, 64> cache{};
  const int d = current_device();
  if (d >= static_cast<int>(cache.size())) {
    int v = 0;
    LOOM_CUDA(cudaDeviceGetAttribute(&v, Attr, d));
    return v;
  }
  if (cache[d] == 0) LOOM_CUDA(cudaDeviceGetAttribute(&cache[d], Attr, d));
  return cache[d];
}
inline int multiprocessors() { return device_attribute<cudaDevAttrMultiProcessorCount>(); }
inline int max_shared_per_block() { return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(); }

//! Blocks for a grid-stride loop over `work` items at `threads` per block: enough to fill the device, no more.
inline unsigned grid_for(std::size_t work, int threads) {
  const std::size_t want = (work + threads - 1) / threads;
  const std::size_t cap = static_cast<std::size_t>(multiprocessors()) * (2048 / threads) * 2;
  return static_cast<unsigned>(std::max<std::size_t>(1, std::min(want, cap)));
}

//! Calls op.apply<N>(i) for i = 0, N, 2N, ... below n rounded down to N, then op.apply<1>(i) on the rest.
template <int N, class Op>
__global__ void map_kernel(Op op, std::size_t n) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  const std::size_t first = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::size_t packs = n / N;
  for (std::size_t c = first; c < packs; c += stride) op.template apply<N>(c * N);
  if constexpr (N > 1)
    for (std::size_t i = packs * N + first; i < n; i += stride) op.template apply<1>(i);
}

//! Runs op over n elements, Op::width at a time when `vectorize` (the caller checked alignment), else one by one.
template <class Op>
void launch_map(const Op& op, std::size_t n, bool vectorize, cudaStream_t stream, const char* name) {
  if (n == 0) return;
  constexpr int threads = 256;
  if (vectorize && Op::width > 1) {
    map_kernel<Op::width><<<grid_for(n / Op::width + 1, threads), threads, 0, stream>>>(op, n);
  } else {
    map_kernel<1><<<grid_for(n, threads), threads, 0, stream>>>(op, n);
  }
  check_launch(name);
}

}  // namespace detail

}  // namespace loom::kernels::cuda

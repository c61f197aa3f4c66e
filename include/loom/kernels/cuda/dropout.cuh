// Dropout on the device with the CPU's counter-based mask: element i keeps x / (1 - p) when
// dropout_uniform(seed, index0 + i) >= p, so the mask is the same on forward and backward, on CPU and GPU, and
// however a tensor is split across ranks.
#pragma once

#include <loom/kernels/cuda/elementwise.cuh>

namespace loom::kernels::cuda {

namespace detail {

//! splitmix64's finaliser, as loom::kernels::cpu::detail::mix64 (which is host-only constexpr).
__host__ __device__ __forceinline__ std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace detail

//! The CPU's loom::kernels::cpu::dropout_uniform, callable on host and device: 24 bits of a hash of (seed, index).
__host__ __device__ __forceinline__ float dropout_uniform(std::uint64_t seed, std::uint64_t index) {
  const std::uint64_t z = detail::mix64(detail::mix64(seed ^ 0x9e3779b97f4a7c15ULL) + index * 0xd1b54a32d192ed03ULL);
  return float(z >> 40) * 0x1p-24f;
}

namespace detail {

template <class T>
struct Dropout {
  static constexpr int width = vec_width<T>;
  const T* x;
  T* out;
  float p;
  acc_t<T> scale;
  std::uint64_t seed, index0;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const auto a = load_pack<N>(x + i);
    Pack<T, N> r;
#pragma unroll
    for (int j = 0; j < N; ++j)
      r.v[j] = narrow<T>(dropout_uniform(seed, index0 + i + j) >= p ? widen(a.v[j]) * scale : acc_t<T>(0));
    store_pack(out + i, r);
  }
};

template <class T>
void dropout_apply(const T* x, T* out, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0,
                   cudaStream_t stream, const char* name) {
  using A = acc_t<T>;
  if (n == 0) return;
  if (p <= 0.0f) {
    if (out != x) LOOM_CUDA(cudaMemcpyAsync(out, x, n * sizeof(T), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const A scale = p < 1.0f ? A(1) / (A(1) - A(p)) : A(0);
  launch_map(Dropout<T>{x, out, p, scale, seed, index0}, n, vec_ok({x, out}), stream, name);
}

}  // namespace detail

//! out[i] = x[i] / (1 - p) when dropout_uniform(seed, index0 + i) >= p, else 0; p = 0 copies; out may be x.
template <Floating T>
void dropout_forward(const T* x, T* out, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0,
                     cudaStream_t stream) {
  detail::dropout_apply(detail::dev(x), detail::dev(out), n, p, seed, index0, stream, "dropout_forward");
}

//! dx[i] from dout[i] with the same mask.
template <Floating T>
void dropout_backward(const T* dout, T* dx, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0,
                      cudaStream_t stream) {
  detail::dropout_apply(detail::dev(dout), detail::dev(dx), n, p, seed, index0, stream, "dropout_backward");
}

}  // namespace loom::kernels::cuda

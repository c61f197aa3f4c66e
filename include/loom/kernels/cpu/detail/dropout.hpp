// Dropout keyed by (seed, global element index) through a counter-based hash: the mask is the same on forward and
// backward, and however a tensor is split across ranks. Include <loom/kernels/cpu/ops.hpp> instead.
#pragma once

#include <loom/kernels/cpu/detail/common.hpp>

namespace loom::kernels::cpu::detail {

//! splitmix64's finaliser: a bijection of 64-bit words with full avalanche.
constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

//! Applies the mask to x (scaled by 1 / (1 - p)) over n elements from global index index0.
template <class T>
void dropout_apply(const T* x, T* out, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0) {
  check_type<T>();
  using A = acc_t<T>;
  if (p <= 0.0f) {
    if (out != x) std::copy(x, x + n, out);
    return;
  }
  const A scale = p < 1.0f ? A(1) / (A(1) - A(p)) : A(0);
  map_elements<T, 1>({x}, out, n, [&](const auto& in, auto* res, std::size_t m, std::size_t off) {
    for (std::size_t i = 0; i < m; ++i)
      res[i] = dropout_uniform(seed, index0 + off + i) >= p ? in[0][i] * scale : A(0);
  });
}

}  // namespace loom::kernels::cpu::detail

namespace loom::kernels::cpu {

// 24 bits of a hash of both words: the key is mixed first, so that seeds do not give shifted copies of one stream.
inline float dropout_uniform(std::uint64_t seed, std::uint64_t index) {
  const std::uint64_t z = detail::mix64(detail::mix64(seed ^ 0x9e3779b97f4a7c15ULL) + index * 0xd1b54a32d192ed03ULL);
  return float(z >> 40) * 0x1p-24f;
}

template <class T>
void dropout_forward(const T* x, T* out, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0) {
  detail::dropout_apply(x, out, n, p, seed, index0);
}

template <class T>
void dropout_backward(const T* dout, T* dx, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0) {
  detail::dropout_apply(dout, dx, n, p, seed, index0);
}

}  // namespace loom::kernels::cpu

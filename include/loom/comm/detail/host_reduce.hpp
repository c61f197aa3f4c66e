// Element-wise reductions over host memory, used by the Local and Mpi backends. Private: include
// <loom/comm/local.hpp> or <loom/comm/mpi.hpp> instead.
#pragma once

#ifndef LOOM_COMM_BACKEND_INCLUDED
#error "loom: comm/detail/ is private: include <loom/comm/local.hpp>, <loom/comm/mpi.hpp> or <loom/comm/nccl.hpp>"
#endif

#include <loom/comm/types.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace loom::comm::detail {

//! A 16-bit float as the host reductions hold it: its bits, widened to float for each operation and rounded back
//! to nearest even, as bf16's and fp16's own arithmetic does. The backends reduce bf16 and fp16 buffers through
//! it, so that a program that moves them need not include their arithmetic (Eigen) to use the communicators.
template <class Format>
struct HalfBits {
  std::uint16_t bits = 0;

  HalfBits() = default;
  explicit HalfBits(float f) : bits(Format::encode(f)) {}
  float value() const { return Format::decode(bits); }
  friend HalfBits operator+(HalfBits a, HalfBits b) { return HalfBits(a.value() + b.value()); }
  friend HalfBits operator*(HalfBits a, HalfBits b) { return HalfBits(a.value() * b.value()); }
  friend HalfBits operator/(HalfBits a, HalfBits b) { return HalfBits(a.value() / b.value()); }
  friend bool operator<(HalfBits a, HalfBits b) { return a.value() < b.value(); }
};

//! bfloat16: the top half of a float.
struct Bf16Format {
  static constexpr DType dtype = DType::bf16;
  static float decode(std::uint16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }
  static std::uint16_t encode(float f) {
    const auto u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
    return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

//! IEEE binary16: 5 exponent bits (bias 15), 10 mantissa bits, subnormals.
struct Fp16Format {
  static constexpr DType dtype = DType::f16;
  static float decode(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));  // inf, NaN
    if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
    const float sub = static_cast<float>(mant) * 0x1p-24f;  // exact: mant < 2^10
    return sign ? -sub : sub;
  }
  static std::uint16_t encode(float f) {
    const auto u = std::bit_cast<std::uint32_t>(f);
    const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | static_cast<std::uint16_t>((a >> 13) & 0x3ffu);  // NaN
    if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to 65520 or more, or inf: inf
    if (a < 0x38800000u) {  // below 2^-14: a subnormal (or zero), rounded to nearest even by the float addition
      const float r = std::bit_cast<float>(a) + 0.5f;  // 0.5 = 2^-1: its ulp is 2^-24, fp16's subnormal step
      return sign | static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(r) - 0x3f000000u);
    }
    const std::uint32_t odd = (a >> 13) & 1u;  // round to nearest, ties to even, then rebias
    return sign | static_cast<std::uint16_t>((a + 0xfffu + odd - (112u << 23)) >> 13);
  }
};

//! The type the host reductions use for elements of type T: T, or HalfBits for bf16 and fp16.
template <class T>
using host_t = std::conditional_t<std::is_same_v<T, bf16>, HalfBits<Bf16Format>,
                                  std::conditional_t<std::is_same_v<T, fp16>, HalfBits<Fp16Format>, T>>;
//! The DType of a host_t.
template <class T>
inline constexpr DType host_dtype = dtype_of<T>;
template <class Format>
inline constexpr DType host_dtype<HalfBits<Format>> = Format::dtype;

template <class T>
inline void reduce_into(T* __restrict dst, const T* __restrict src, std::size_t n, Reduce op) {
  switch (op) {
    case Reduce::sum:
    case Reduce::avg:
      for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] + src[i];
      break;
    case Reduce::prod:
      for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] * src[i];
      break;
    case Reduce::max:
      for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] < src[i] ? src[i] : dst[i];
      break;
    case Reduce::min:
      for (std::size_t i = 0; i < n; ++i) dst[i] = src[i] < dst[i] ? src[i] : dst[i];
      break;
  }
}

//! dst = reduction of srcs[0..nsrc) over n elements, in cache-sized blocks; dst may alias any one source.
template <class T>
inline void reduce_sources(T* dst, const T* const* srcs, int nsrc, std::size_t n, Reduce op) {
  constexpr std::size_t block = 16384 / sizeof(T);
  // A source equal to dst must be read before dst is written: start from it.
  int first = 0;
  for (int q = 0; q < nsrc; ++q)
    if (srcs[q] == dst) first = q;
  for (std::size_t at = 0; at < n; at += block) {
    const std::size_t len = std::min(block, n - at);
    if (srcs[first] != dst) std::memcpy(dst + at, srcs[first] + at, len * sizeof(T));
    for (int q = 0; q < nsrc; ++q)
      if (q != first) reduce_into(dst + at, srcs[q] + at, len, op);
  }
}

//! Divides by the group size after a sum, for Reduce::avg.
template <class T>
inline void finish_avg(T* dst, std::size_t n, int group_size, Reduce op) {
  if (op != Reduce::avg) return;
  const T d = static_cast<T>(group_size);
  for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] / d;
}

}  // namespace loom::comm::detail

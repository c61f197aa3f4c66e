// Private helpers of the CPU kernels: the element types they take, Eigen views of raw row-major memory, and the
// conversions between bf16/fp16 storage and float arithmetic. Include <loom/kernels/cpu/ops.hpp> instead.
#pragma once

#ifndef LOOM_KERNELS_CPU_OPS_INCLUDED
#error "loom: kernels/cpu/detail/ is private: include <loom/kernels/cpu/ops.hpp>"
#endif

#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <cstddef>
#include <type_traits>
#include <vector>

namespace loom::kernels::cpu::detail {

template <class T>
inline constexpr bool is_low_precision_v = std::is_same_v<T, bf16> || std::is_same_v<T, fp16>;
template <class T>
inline constexpr bool is_kernel_type_v = std::is_same_v<T, float> || std::is_same_v<T, double> || is_low_precision_v<T>;

template <class T>
constexpr void check_type() {
  static_assert(is_kernel_type_v<T>, "loom: the CPU kernels take float, double, loom::bf16 or loom::fp16");
}

template <class A>
using RowMat = Eigen::Matrix<A, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class A>
using Arr = Eigen::Array<A, Eigen::Dynamic, 1>;

//! A contiguous vector of n elements as an Eigen array.
template <class A>
auto arr(A* p, std::size_t n) {
  return Eigen::Map<Arr<A>>(p, static_cast<Eigen::Index>(n));
}
template <class A>
auto arr(const A* p, std::size_t n) {
  return Eigen::Map<const Arr<A>>(p, static_cast<Eigen::Index>(n));
}

//! A rows x cols row-major matrix whose rows are ld elements apart.
template <class A>
auto mat(A* p, Eigen::Index rows, Eigen::Index cols, Eigen::Index ld) {
  return Eigen::Map<RowMat<A>, Eigen::Unaligned, Eigen::OuterStride<>>(p, rows, cols, Eigen::OuterStride<>(ld));
}
template <class A>
auto mat(const A* p, Eigen::Index rows, Eigen::Index cols, Eigen::Index ld) {
  return Eigen::Map<const RowMat<A>, Eigen::Unaligned, Eigen::OuterStride<>>(p, rows, cols,
                                                                              Eigen::OuterStride<>(ld));
}

//! n elements of T as acc_t<T>: p itself when the types agree, else converted into buf.
template <class T>
const acc_t<T>* load(const T* p, std::size_t n, std::vector<acc_t<T>>& buf) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    return p;
  } else {
    if (buf.size() < n) buf.resize(n);
    for (std::size_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
    return buf.data();
  }
}

//! Where to compute n results destined for p: p itself when the types agree, else buf (then call store).
template <class T>
acc_t<T>* result(T* p, std::size_t n, std::vector<acc_t<T>>& buf) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    return p;
  } else {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }
}

//! Rounds the n results of result(p, n, buf) into p (nothing to do when the types agree).
template <class T>
void store(T* p, std::size_t n, const std::vector<acc_t<T>>& buf) {
  if constexpr (!std::is_same_v<T, acc_t<T>>) {
    for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<T>(buf[i]);
  }
}

//! Applies f(ins, out, count, offset) (pointers to acc_t<T>) to n elements: on the memory itself for float and
//! double, through float chunks on the stack for bf16/fp16. offset is the chunk's first element index.
template <class T, std::size_t N, class F>
void map_elements(const std::array<const T*, N>& in, T* out, std::size_t n, F&& f) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    f(in, out, n, std::size_t{0});
  } else {
    constexpr std::size_t chunk = 512;
    float ibuf[N > 0 ? N : 1][chunk];
    float obuf[chunk];
    std::array<const float*, N> ip{};
    for (std::size_t k = 0; k < N; ++k) ip[k] = ibuf[k];
    for (std::size_t i0 = 0; i0 < n; i0 += chunk) {
      const std::size_t m = std::min(chunk, n - i0);
      for (std::size_t k = 0; k < N; ++k)
        for (std::size_t i = 0; i < m; ++i) ibuf[k][i] = static_cast<float>(in[k][i0 + i]);
      f(ip, obuf, m, i0);
      for (std::size_t i = 0; i < m; ++i) out[i0 + i] = static_cast<T>(obuf[i]);
    }
  }
}

}  // namespace loom::kernels::cpu::detail

// Helpers shared by the CPU kernel tests: seeded random data, element-type conversions, error measures and
// central finite differences in double.
#pragma once

#include <loom/kernels/cpu/ops.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace kt {

namespace k = loom::kernels::cpu;
using loom::bf16;
using loom::fp16;

inline std::vector<double> random_vector(std::size_t n, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

template <class T, class U>
std::vector<T> convert(const std::vector<U>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<T>(static_cast<double>(v[i]));
  return out;
}

template <class T>
std::vector<double> to_double(const std::vector<T>& v) {
  return convert<double>(v);
}

//! Rounds through T and back: the values a T-typed kernel actually sees.
template <class T>
std::vector<double> rounded(const std::vector<double>& v) {
  return to_double(convert<T>(v));
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

//! max |a - b| relative to max |b|: the error on the scale of the reference.
template <class U>
double rel_err(const std::vector<U>& a, const std::vector<double>& b) {
  double e = 0;
  for (std::size_t i = 0; i < b.size(); ++i) e = std::max(e, std::abs(static_cast<double>(a[i]) - b[i]));
  const double s = max_abs(b);
  return s > 0 ? e / s : e;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

//! Central differences of loss at x (every element, or every stride-th), against the analytic gradient: the
//! largest difference relative to the largest gradient element.
inline double fd_error(const std::function<double(const std::vector<double>&)>& loss, std::vector<double> x,
                       const std::vector<double>& grad, std::size_t stride = 1, double h = 1e-5) {
  std::vector<double> fd, an;
  for (std::size_t i = 0; i < x.size(); i += stride) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double up = loss(x);
    x[i] = x0 - h;
    const double down = loss(x);
    x[i] = x0;
    fd.push_back((up - down) / (2 * h));
    an.push_back(grad[i]);
  }
  return rel_err(an, fd);
}

//! The unit roundoff of T's storage, for tolerances.
template <class T>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<T, double>) return 0x1p-53;
  else if constexpr (std::is_same_v<T, float>) return 0x1p-24;
  else if constexpr (std::is_same_v<T, bf16>) return 0x1p-8;
  else return 0x1p-11;
}

}  // namespace kt

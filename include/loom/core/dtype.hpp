// Element types loom moves and computes with, and the run-time tag (DType) that names them across backends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

// Named here, complete (with their arithmetic) where <loom/core/half.hpp> or <Eigen/Core> is included.
namespace Eigen {
struct bfloat16;
struct half;
}  // namespace Eigen

namespace loom {

using bf16 = Eigen::bfloat16;  //!< bfloat16 on the host; the bytes match __nv_bfloat16
using fp16 = Eigen::half;      //!< IEEE half on the host; the bytes match __half

enum class DType : std::uint8_t { f32, f64, bf16, f16, i32, i64 };

template <class T>
inline constexpr bool is_element_v = false;
template <> inline constexpr bool is_element_v<float> = true;
template <> inline constexpr bool is_element_v<double> = true;
template <> inline constexpr bool is_element_v<bf16> = true;
template <> inline constexpr bool is_element_v<fp16> = true;
template <> inline constexpr bool is_element_v<std::int32_t> = true;
template <> inline constexpr bool is_element_v<std::int64_t> = true;

//! An element type loom's collectives and kernels accept.
template <class T>
concept Element = is_element_v<std::remove_cv_t<T>>;

//! The type arithmetic is done in for storage type T: double for double, float otherwise (bf16 and fp16 storage
//! compute in float), on every device.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <Element T>
inline constexpr DType dtype_of = [] {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) return DType::f32;
  else if constexpr (std::is_same_v<U, double>) return DType::f64;
  else if constexpr (std::is_same_v<U, bf16>) return DType::bf16;
  else if constexpr (std::is_same_v<U, fp16>) return DType::f16;
  else if constexpr (std::is_same_v<U, std::int32_t>) return DType::i32;
  else return DType::i64;
}();

constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::bf16: case DType::f16: return 2;
  }
  return 0;
}

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "?";
}

template <class T>
struct type_tag {
  using type = T;
};

//! Calls f(type_tag<T>{}) with the C++ type that t names.
template <class F>
decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(type_tag<float>{});
    case DType::f64: return f(type_tag<double>{});
    case DType::bf16: return f(type_tag<bf16>{});
    case DType::f16: return f(type_tag<fp16>{});
    case DType::i32: return f(type_tag<std::int32_t>{});
    case DType::i64: break;
  }
  return f(type_tag<std::int64_t>{});
}

}  // namespace loom

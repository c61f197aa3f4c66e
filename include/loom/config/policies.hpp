// loom/config/policies.hpp: the axis policies TP, CP, DP, PP and EP, trivial types that carry an axis, its size and
// its options, and the AxisPolicy concept that recognises them.
#pragma once

#include <type_traits>

#include <loom/config/axis.hpp>
#include <loom/config/options.hpp>

namespace loom {

//! Tensor parallelism over N ranks. Options: SequenceParallel.
template <int N, class... Opts>
struct TP {
  static constexpr Axis axis = Axis::tp;
  static constexpr int size = N;
  using options = Options<Opts...>;
};

//! Context (sequence) parallelism over N ranks. Options: Ring or Ulysses.
template <int N, class... Opts>
struct CP {
  static constexpr Axis axis = Axis::cp;
  static constexpr int size = N;
  using options = Options<Opts...>;
};

//! Data parallelism over N ranks. Options: ZeRO<k>, KeepGathered (with ZeRO<3>).
template <int N, class... Opts>
struct DP {
  static constexpr Axis axis = Axis::dp;
  static constexpr int size = N;
  using options = Options<Opts...>;
};

//! Pipeline parallelism over N stages. Options: Interleaved<v>, and one of GPipe, OneFOneB, ZeroBubbleH1, ZeroBubbleV.
template <int N, class... Opts>
struct PP {
  static constexpr Axis axis = Axis::pp;
  static constexpr int size = N;
  using options = Options<Opts...>;
};

//! Expert parallelism over N ranks, carved out of DP x CP (N must divide DP*CP). No options.
template <int N>
struct EP {
  static constexpr Axis axis = Axis::ep;
  static constexpr int size = N;
  using options = Options<>;
};

namespace detail {
template <class T>
struct IsAxisPolicy : std::false_type {};
template <int N, class... O>
struct IsAxisPolicy<TP<N, O...>> : std::true_type {};
template <int N, class... O>
struct IsAxisPolicy<CP<N, O...>> : std::true_type {};
template <int N, class... O>
struct IsAxisPolicy<DP<N, O...>> : std::true_type {};
template <int N, class... O>
struct IsAxisPolicy<PP<N, O...>> : std::true_type {};
template <int N>
struct IsAxisPolicy<EP<N>> : std::true_type {};
}  // namespace detail

//! One of loom's axis policies: TP, CP, DP, PP or EP.
template <class T>
concept AxisPolicy = detail::IsAxisPolicy<std::remove_cv_t<T>>::value;

}  // namespace loom

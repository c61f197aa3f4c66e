// loom/config/detail/lookup.hpp (private; include <loom/config.hpp>): finding a policy by axis and an option by
// family in the lists given to Parallel<...>.
#pragma once

#ifndef LOOM_CONFIG_PARALLEL_INCLUDED
#error "loom: config/detail/ is private: include <loom/config.hpp>"
#endif

#include <type_traits>

#include <loom/config/axis.hpp>
#include <loom/config/options.hpp>
#include <loom/config/policies.hpp>

namespace loom::detail {

// A type that is not an axis policy has no axis; rules about axes skip it (its own rule reports it).
template <class P>
constexpr bool policy_is(Axis a) noexcept {
  if constexpr (AxisPolicy<P>) {
    return P::axis == a;
  } else {
    return false;
  }
}

template <Axis A, class... Ps>
inline constexpr int count_axis = (0 + ... + (policy_is<Ps>(A) ? 1 : 0));

// The first policy of axis A among Ps, or void.
template <Axis A, class... Ps>
struct FindPolicy {
  using type = void;
};
template <Axis A, class P, class... Ps>
struct FindPolicy<A, P, Ps...> {
  using type = std::conditional_t<policy_is<P>(A), P, typename FindPolicy<A, Ps...>::type>;
};

template <Axis A, class... Ps>
constexpr int axis_size() noexcept {
  using P = typename FindPolicy<A, Ps...>::type;
  if constexpr (std::is_void_v<P>) {
    return 1;
  } else {
    return P::size;
  }
}

template <class O>
constexpr bool option_is(OptionFamily f) noexcept {
  if constexpr (Option<O>) {
    return O::family == f;
  } else {
    return false;
  }
}

template <OptionFamily F, class Opts>
struct FindOption;
template <OptionFamily F>
struct FindOption<F, Options<>> {
  using type = void;
};
template <OptionFamily F, class O, class... Os>
struct FindOption<F, Options<O, Os...>> {
  using type = std::conditional_t<option_is<O>(F), O, typename FindOption<F, Options<Os...>>::type>;
};

// The option of family F on the policy of axis A, or void when either is absent.
template <Axis A, OptionFamily F, class... Ps>
struct FindAxisOption {
  using type = void;
};
template <Axis A, OptionFamily F, class... Ps>
  requires(!std::is_void_v<typename FindPolicy<A, Ps...>::type>)
struct FindAxisOption<A, F, Ps...> {
  using type = typename FindOption<F, typename FindPolicy<A, Ps...>::type::options>::type;
};

template <OptionFamily F, class... Os>
inline constexpr int count_family = (0 + ... + (option_is<Os>(F) ? 1 : 0));

}  // namespace loom::detail

namespace loom::detail {

// The policy of axis A as given, or the size-1 policy when A is absent.
template <Axis A, class... Ps>
struct PolicyOr {
  static_assert(A != Axis::edp, "loom: edp has no policy of its own; its size is DP*CP/EP");
  using found = typename FindPolicy<A, Ps...>::type;
  using fallback = std::conditional_t<
      A == Axis::tp, TP<1>,
      std::conditional_t<A == Axis::cp, CP<1>,
                         std::conditional_t<A == Axis::dp, DP<1>, std::conditional_t<A == Axis::pp, PP<1>, EP<1>>>>>;
  using type = std::conditional_t<std::is_void_v<found>, fallback, found>;
};

}  // namespace loom::detail

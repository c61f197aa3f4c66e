// loom/config/detail/checks.hpp (private; include <loom/config.hpp>): the static rules of Parallel<...>. Each rule
// is a helper template named after it, so a failure also prints the offending policy, option or value.
#pragma once

#ifndef LOOM_CONFIG_PARALLEL_INCLUDED
#error "loom: config/detail/ is private: include <loom/config.hpp>"
#endif

#include <loom/config/axis.hpp>
#include <loom/config/detail/lookup.hpp>
#include <loom/config/options.hpp>
#include <loom/config/policies.hpp>

namespace loom::detail {

template <class T>
struct RequireAxisPolicy {
  static_assert(AxisPolicy<T>, "loom: a type given to Parallel<...> is not an axis policy (TP, CP, DP, PP, EP)");
  static constexpr bool value = true;
};

template <class P>
struct RequireSizeAtLeastOne {
  static_assert(P::size >= 1, "loom: an axis size must be at least 1");
  static constexpr bool value = true;
};

template <class P, class O>
struct RequireOptionOnItsAxis {
  static_assert(Option<O>, "loom: a type given as an option of an axis is not a loom option");
  static_assert(!option_is<O>(OptionFamily::zero) || P::axis == Axis::dp, "loom: ZeRO<k> is an option of DP");
  static_assert(!option_is<O>(OptionFamily::keep_gathered) || P::axis == Axis::dp,
                "loom: KeepGathered is an option of DP");
  static_assert(!option_is<O>(OptionFamily::shard) || P::axis == Axis::dp, "loom: HybridShard<s> is an option of DP");
  static_assert(!option_is<O>(OptionFamily::reduce_in) || P::axis == Axis::dp, "loom: ReduceIn<T> is an option of DP");
  static_assert(!option_is<O>(OptionFamily::sequence_parallel) || P::axis == Axis::tp,
                "loom: SequenceParallel is an option of TP");
  static_assert(!option_is<O>(OptionFamily::interleaved) || P::axis == Axis::pp,
                "loom: Interleaved<v> is an option of PP");
  static_assert(!option_is<O>(OptionFamily::schedule) || P::axis == Axis::pp,
                "loom: a pipeline schedule (GPipe, OneFOneB, ZeroBubbleH1, ZeroBubbleV) is an option of PP");
  static_assert(!option_is<O>(OptionFamily::cp_algorithm) || P::axis == Axis::cp,
                "loom: Ring and Ulysses are options of CP");
  static constexpr bool value = true;
};

template <class P, class... Os>
struct RequireOneOptionPerFamily {
  static_assert(count_family<OptionFamily::zero, Os...> <= 1 &&
                    count_family<OptionFamily::keep_gathered, Os...> <= 1 &&
                    count_family<OptionFamily::shard, Os...> <= 1 &&
                    count_family<OptionFamily::reduce_in, Os...> <= 1 &&
                    count_family<OptionFamily::sequence_parallel, Os...> <= 1 &&
                    count_family<OptionFamily::interleaved, Os...> <= 1 &&
                    count_family<OptionFamily::schedule, Os...> <= 1 &&
                    count_family<OptionFamily::cp_algorithm, Os...> <= 1,
                "loom: an axis is given two options of the same family (two schedules, Ring and Ulysses, ...)");
  static constexpr bool value = true;
};

template <class P, class Opts = typename P::options>
struct CheckPolicyOptions;
template <class P, class... Os>
struct CheckPolicyOptions<P, Options<Os...>> {
  static constexpr bool value =
      (true && ... && RequireOptionOnItsAxis<P, Os>::value) && RequireOneOptionPerFamily<P, Os...>::value;
};

// Rules about a policy's contents; a type that is not a policy is reported by RequireAxisPolicy alone.
template <class P, bool = AxisPolicy<P>>
struct CheckPolicy {
  static constexpr bool value = RequireAxisPolicy<P>::value;
};
template <class P>
struct CheckPolicy<P, true> {
  static constexpr bool value = RequireSizeAtLeastOne<P>::value && CheckPolicyOptions<P>::value;
};

template <Axis A, int Count>
struct RequireAxisOnce {
  static_assert(Count <= 1, "loom: an axis is given more than once in Parallel<...>");
  static constexpr bool value = true;
};

template <int Ep, int DpTimesCp>
struct RequireEpDividesDpCp {
  static_assert(Ep < 1 || DpTimesCp % Ep == 0, "loom: EP must divide DP*CP");
  static constexpr bool value = true;
};

// Every rule of Parallel<Ps...>; value is always true, the rules themselves report.
template <class... Ps>
struct CheckParallel {
  static constexpr bool value =
      (true && ... && CheckPolicy<Ps>::value) && RequireAxisOnce<Axis::tp, count_axis<Axis::tp, Ps...>>::value &&
      RequireAxisOnce<Axis::cp, count_axis<Axis::cp, Ps...>>::value &&
      RequireAxisOnce<Axis::dp, count_axis<Axis::dp, Ps...>>::value &&
      RequireAxisOnce<Axis::pp, count_axis<Axis::pp, Ps...>>::value &&
      RequireAxisOnce<Axis::ep, count_axis<Axis::ep, Ps...>>::value &&
      RequireEpDividesDpCp<axis_size<Axis::ep, Ps...>(),
                           axis_size<Axis::dp, Ps...>() * axis_size<Axis::cp, Ps...>()>::value;
};

// Rules of group<As...>(rank) and its relatives.
template <Axis... As>
struct CheckGroupAxes {
  static constexpr bool listed_once = ((((0 + ... + (As == Axis::tp ? 1 : 0)) <= 1)) &&
                                       ((0 + ... + (As == Axis::cp ? 1 : 0)) <= 1) &&
                                       ((0 + ... + (As == Axis::dp ? 1 : 0)) <= 1) &&
                                       ((0 + ... + (As == Axis::pp ? 1 : 0)) <= 1) &&
                                       ((0 + ... + (As == Axis::ep ? 1 : 0)) <= 1) &&
                                       ((0 + ... + (As == Axis::edp ? 1 : 0)) <= 1));
  static constexpr bool has_expert = (false || ... || (As == Axis::ep || As == Axis::edp));
  static constexpr bool has_dense = (false || ... || (As == Axis::cp || As == Axis::dp));
  static_assert(listed_once, "loom: an axis is listed more than once in group<...>");
  static_assert(!(has_expert && has_dense), "loom: a group cannot mix ep/edp with cp/dp");
  static constexpr bool value = true;
};

}  // namespace loom::detail

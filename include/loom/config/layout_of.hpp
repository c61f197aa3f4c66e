// loom/config/layout_of.hpp: a layout type from its name. LayoutOf<"tp2.sp.pp2.zb-v.dp4.zero1"> is
// Parallel<TP<2, SequenceParallel>, PP<2, ZeroBubbleV>, DP<4, ZeRO<1>>>: the name as Parallel<...>::name() prints it
// (or as train_gpt's --parallel spells it, with commas), parsed at compile time, so that a layout chosen by name (a
// build option, a planner's output) compiles as it is written, of any size.
//
// The parts, in any order, separated by '.' or ',': tpN, sp; cpN, ring, ulysses; ppN, gpipe, 1f1b, zb-h1, zb-v, vN;
// dpN, zeroK, keep, shardS; epN; single (no axis). An axis of size 1, zero0, ring and 1f1b are the defaults and add
// nothing. The axes come out in the order tp, cp, pp, dp, ep, so that LayoutOf<C::name()> is C for every layout C
// whose axes are given in that order. A name that is not a layout fails with a loom: static_assert naming the rule,
// the offending part given as the template argument of the failing check (detail::BadLayoutPart<part, ...>).
#pragma once

#include <loom/config/options.hpp>
#include <loom/config/parallel.hpp>
#include <loom/config/policies.hpp>

#include <cstddef>
#include <string_view>
#include <type_traits>

namespace loom {

//! A string as a template argument: LayoutOf<"tp2.dp4">.
template <std::size_t N>
struct LayoutString {
  char text[N]{};
  constexpr LayoutString(const char (&s)[N]) {
    for (std::size_t i = 0; i < N; ++i) text[i] = s[i];
  }
  constexpr LayoutString() = default;
  constexpr std::string_view view() const { return {text, N - 1}; }
};

namespace detail {

//! What a layout's name says, or the first thing wrong with it: `error` and the part [bad, bad + bad_size).
struct LayoutSpelling {
  enum class Error { none, unknown_part, bad_number, repeated, sp_without_tp, cp_option_without_cp,
                     pp_option_without_pp, dp_option_without_dp, keep_without_zero3, shard_does_not_divide };
  int tp = 1, cp = 1, pp = 1, dp = 1, ep = 1;
  bool sp = false, ulysses = false, keep = false;
  int zero = 0, shard = 0, v = 1;
  int schedule = -1;  // -1: the default (1F1B); else a Schedule
  Error error = Error::none;
  std::size_t bad = 0, bad_size = 0;
};

//! The digits of `s` from position `at` as a number, or -1 (none, or not all digits).
constexpr int layout_number(std::string_view s, std::size_t at) {
  if (at >= s.size()) return -1;
  long n = 0;
  for (std::size_t i = at; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9' || n > 100000000) return -1;
    n = n * 10 + (s[i] - '0');
  }
  return static_cast<int>(n);
}

constexpr LayoutSpelling parse_layout_name(std::string_view name) {
  using E = LayoutSpelling::Error;
  LayoutSpelling s;
  // The parts seen, by family, to refuse one given twice: tp sp cp cp-algorithm pp schedule v dp zero keep shard ep.
  bool seen[12]{};
  std::size_t first_dp_option = 0, dp_option_size = 0, first_pp_option = 0, pp_option_size = 0;
  std::size_t first_cp_option = 0, cp_option_size = 0, sp_at = 0;
  bool any_dp_option = false, any_pp_option = false, any_cp_option = false;
  std::size_t begin = 0;
  while (begin <= name.size()) {
    std::size_t end = begin;
    while (end < name.size() && name[end] != '.' && name[end] != ',') ++end;
    const std::string_view part = name.substr(begin, end - begin);
    auto fail = [&](E e) {
      s.error = e, s.bad = begin, s.bad_size = part.size();
      return s;
    };
    auto once = [&](int family) {
      if (seen[family]) return false;
      return seen[family] = true;
    };
    auto prefixed = [&](std::string_view p) { return part.size() > p.size() && part.substr(0, p.size()) == p; };
    int family = -1;
    if (part.empty() || part == "single") {
      // nothing: "single" is the layout without axes
    } else if (part == "sp") {
      family = 1, s.sp = true, sp_at = begin;
    } else if (part == "ring" || part == "ulysses") {
      family = 3, s.ulysses = part == "ulysses";
      if (!any_cp_option) first_cp_option = begin, cp_option_size = part.size(), any_cp_option = true;
    } else if (part == "gpipe" || part == "1f1b" || part == "zb-h1" || part == "zb-v") {
      family = 5;
      s.schedule = part == "gpipe"   ? static_cast<int>(Schedule::gpipe)
                   : part == "zb-h1" ? static_cast<int>(Schedule::zero_bubble_h1)
                   : part == "zb-v"  ? static_cast<int>(Schedule::zero_bubble_v)
                                     : -1;
      if (!any_pp_option) first_pp_option = begin, pp_option_size = part.size(), any_pp_option = true;
    } else if (part == "keep") {
      family = 9, s.keep = true;
      if (!any_dp_option) first_dp_option = begin, dp_option_size = part.size(), any_dp_option = true;
    } else if (prefixed("zero") || prefixed("shard")) {
      const bool zero = prefixed("zero");
      const int n = layout_number(part, zero ? 4 : 5);
      if (n < 0 || (zero && n > 3) || (!zero && n < 2)) return fail(E::bad_number);
      family = zero ? 8 : 10;
      (zero ? s.zero : s.shard) = n;
      if (!any_dp_option && n > 0) first_dp_option = begin, dp_option_size = part.size(), any_dp_option = true;
    } else if (part.size() > 1 && part[0] == 'v' && layout_number(part, 1) >= 0) {
      const int n = layout_number(part, 1);
      if (n < 1) return fail(E::bad_number);
      family = 6, s.v = n;
      if (!any_pp_option && n > 1) first_pp_option = begin, pp_option_size = part.size(), any_pp_option = true;
    } else if (prefixed("tp") || prefixed("cp") || prefixed("pp") || prefixed("dp") || prefixed("ep")) {
      const int n = layout_number(part, 2);
      if (n < 1) return fail(E::bad_number);
      const char a = part[0];
      family = a == 't' ? 0 : a == 'c' ? 2 : a == 'p' ? 4 : a == 'd' ? 7 : 11;
      (a == 't' ? s.tp : a == 'c' ? s.cp : a == 'p' ? s.pp : a == 'd' ? s.dp : s.ep) = n;
    } else {
      return fail(E::unknown_part);
    }
    if (family >= 0 && !once(family)) return fail(E::repeated);
    if (end >= name.size()) break;
    begin = end + 1;
  }
  auto fail_at = [&](E e, std::size_t at, std::size_t size) {
    s.error = e, s.bad = at, s.bad_size = size;
    return s;
  };
  if (s.sp && s.tp == 1) return fail_at(E::sp_without_tp, sp_at, 2);
  if (any_cp_option && s.cp == 1 && s.ulysses) return fail_at(E::cp_option_without_cp, first_cp_option, cp_option_size);
  if (any_pp_option && s.pp == 1) return fail_at(E::pp_option_without_pp, first_pp_option, pp_option_size);
  if (any_dp_option && s.dp == 1) return fail_at(E::dp_option_without_dp, first_dp_option, dp_option_size);
  if (s.keep && s.zero != 3) return fail_at(E::keep_without_zero3, first_dp_option, dp_option_size);
  if (s.shard && (s.zero == 0 || s.dp % s.shard != 0))
    return fail_at(E::shard_does_not_divide, first_dp_option, dp_option_size);
  return s;
}

//! The part [At, At + Size) of Name, as a template argument of the failing check.
template <LayoutString Name, std::size_t At, std::size_t Size>
constexpr LayoutString<Size + 1> layout_part() {
  LayoutString<Size + 1> p;
  if constexpr (Size > 0)  // (nvcc: no loop whose test is 0 < 0)
    for (std::size_t i = 0; i < Size; ++i) p.text[i] = Name.text[At + i];
  return p;
}

template <LayoutString Part, LayoutSpelling::Error E>
struct BadLayoutPart {
  using Er = LayoutSpelling::Error;
  static_assert(E != Er::unknown_part, "loom: LayoutOf: a part of the name is not one of tpN, sp, cpN, ring, ulysses, "
                                       "ppN, gpipe, 1f1b, zb-h1, zb-v, vN, dpN, zeroK, keep, shardS, epN, single "
                                       "(the part is BadLayoutPart's first template argument)");
  static_assert(E != Er::bad_number, "loom: LayoutOf: a size must be a number of at least 1 (zeroK: 0 to 3; shardS: "
                                     "at least 2; vN: at least 1)");
  static_assert(E != Er::repeated, "loom: LayoutOf: a part is given twice, or two of one family (two schedules, ring "
                                   "and ulysses)");
  static_assert(E != Er::sp_without_tp,
                "loom: LayoutOf: sp splits over the tensor-parallel ranks and needs tpN, N >= 2");
  static_assert(E != Er::cp_option_without_cp, "loom: LayoutOf: ulysses is an option of context parallelism and needs "
                                               "cpN, N >= 2");
  static_assert(E != Er::pp_option_without_pp, "loom: LayoutOf: a schedule or vN is an option of pipeline parallelism "
                                               "and needs ppN, N >= 2");
  static_assert(E != Er::dp_option_without_dp, "loom: LayoutOf: zeroK, keep and shardS are options of data "
                                               "parallelism and need dpN, N >= 2");
  static_assert(E != Er::keep_without_zero3, "loom: LayoutOf: keep keeps ZeRO-3's gathered parameters and needs zero3");
  static_assert(E != Er::shard_does_not_divide, "loom: LayoutOf: shardS shards the ZeRO state over groups of S "
                                                "data-parallel ranks: it needs zeroK and an S that divides dpN");
  static constexpr bool ok = E == Er::none;
};

template <class... Ts>
struct TypeList {};
template <class... Ls>
struct JoinLists;
template <>
struct JoinLists<> {
  using type = TypeList<>;
};
template <class... A>
struct JoinLists<TypeList<A...>> {
  using type = TypeList<A...>;
};
template <class... A, class... B, class... Rest>
struct JoinLists<TypeList<A...>, TypeList<B...>, Rest...> {
  using type = typename JoinLists<TypeList<A..., B...>, Rest...>::type;
};
//! TypeList<T> where c holds, else TypeList<>.
template <bool C, class T>
using ListIf = std::conditional_t<C, TypeList<T>, TypeList<>>;

template <template <int, class...> class Axis, int N, class Opts>
struct AxisWith;
template <template <int, class...> class Axis, int N, class... Opts>
struct AxisWith<Axis, N, TypeList<Opts...>> {
  using type = Axis<N, Opts...>;
};
template <class Axes>
struct ParallelOf;
template <class... Axes>
struct ParallelOf<TypeList<Axes...>> {
  using type = Parallel<Axes...>;
};

//! The PP policy's schedule option for a parsed schedule (-1: none).
template <int S>
using ScheduleOption = std::conditional_t<
    S == static_cast<int>(Schedule::gpipe), GPipe,
    std::conditional_t<S == static_cast<int>(Schedule::zero_bubble_h1), ZeroBubbleH1, ZeroBubbleV>>;

template <LayoutSpelling S>
struct LayoutFromSpelling {
  using Tp = typename AxisWith<TP, S.tp, ListIf<S.sp, SequenceParallel>>::type;
  using Cp = typename AxisWith<CP, S.cp, ListIf<S.ulysses, Ulysses>>::type;
  using Pp = typename AxisWith<PP, S.pp,
                               typename JoinLists<ListIf<(S.schedule >= 0), ScheduleOption<S.schedule>>,
                                                  ListIf<(S.v > 1), Interleaved<S.v>>>::type>::type;
  using Dp = typename AxisWith<DP, S.dp,
                               typename JoinLists<ListIf<(S.zero > 0), ZeRO<S.zero>>, ListIf<S.keep, KeepGathered>,
                                                  ListIf<(S.shard > 0), HybridShard<(S.shard > 0 ? S.shard : 2)>>>::
                                   type>::type;
  using type = typename ParallelOf<typename JoinLists<ListIf<(S.tp > 1), Tp>, ListIf<(S.cp > 1), Cp>,
                                                      ListIf<(S.pp > 1), Pp>, ListIf<(S.dp > 1), Dp>,
                                                      ListIf<(S.ep > 1), EP<S.ep>>>::type>::type;
};

template <LayoutString Name>
struct LayoutFromName {
  static constexpr LayoutSpelling spelling = parse_layout_name(Name.view());
  static_assert(BadLayoutPart<layout_part<Name, spelling.bad, spelling.bad_size>(), spelling.error>::ok);
  // (a name with an error makes the layout without axes, so that the assertion above is the only message)
  using type = typename LayoutFromSpelling<spelling.error == LayoutSpelling::Error::none ? spelling
                                                                                       : LayoutSpelling{}>::type;
};

}  // namespace detail

//! The layout type of a name: LayoutOf<"tp2.pp2.dp4.zero1"> (see the top of this header).
template <LayoutString Name>
using LayoutOf = typename detail::LayoutFromName<Name>::type;

//! Layout C's name as a template argument: LayoutOf<name_of_layout<C>> is C when C's axes come in the order tp, cp,
//! pp, dp, ep.
template <class C>
inline constexpr auto name_of_layout = [] {
  constexpr std::string_view n = C::name();
  LayoutString<n.size() + 1> out;
  for (std::size_t i = 0; i < n.size(); ++i) out.text[i] = n[i];
  return out;
}();

}  // namespace loom

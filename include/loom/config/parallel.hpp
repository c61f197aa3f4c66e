// loom/config/parallel.hpp: Parallel<Axes...>, a parallel layout as a type: its static rules, its mesh (world size,
// coordinates, process groups, expert groups), its option queries and its name; and the ParallelLayout concept.
#pragma once

#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include <loom/config/axis.hpp>
#define LOOM_CONFIG_PARALLEL_INCLUDED
#include <loom/config/detail/checks.hpp>
#include <loom/config/detail/lookup.hpp>
#include <loom/config/detail/mesh.hpp>
#include <loom/config/detail/name.hpp>
#include <loom/config/options.hpp>
#include <loom/config/policies.hpp>

namespace loom {

//! A rank's place on the mesh, one coordinate per axis.
struct Coords {
  int tp = 0;
  int cp = 0;
  int dp = 0;
  int pp = 0;
  friend constexpr bool operator==(const Coords&, const Coords&) = default;
};

namespace detail {
[[noreturn]] inline void throw_outside_mesh(std::string_view what, int value, int size) {
  throw std::out_of_range("loom: " + std::string(what) + " " + std::to_string(value) + " is outside 0.." +
                          std::to_string(size - 1));
}
// In a constant expression a bad value stops compilation at the call above; at run time it throws.
constexpr void check_index(std::string_view what, int value, int size) {
  if (value < 0 || value >= size) throw_outside_mesh(what, value, size);
}
}  // namespace detail

//! A parallel layout. Axis policies come in any order; an absent axis has size 1. Ranks are numbered
//! rank = tp + TP*(cp + CP*(dp + DP*pp)); expert parallelism splits j = cp + CP*dp into ep = j % EP, edp = j / EP.
template <class... Axes>
struct Parallel {
  static_assert(detail::CheckParallel<Axes...>::value);

 private:
  static constexpr int tp_ = detail::axis_size<Axis::tp, Axes...>();
  static constexpr int cp_ = detail::axis_size<Axis::cp, Axes...>();
  static constexpr int dp_ = detail::axis_size<Axis::dp, Axes...>();
  static constexpr int pp_ = detail::axis_size<Axis::pp, Axes...>();
  static constexpr int ep_ = detail::axis_size<Axis::ep, Axes...>();
  static constexpr int edp_ = ep_ >= 1 ? dp_ * cp_ / ep_ : 0;
  static constexpr std::array<int, 6> sizes_{tp_, cp_, dp_, pp_, ep_, edp_};
  static constexpr detail::MeshShape dense_ = detail::make_mesh(tp_, cp_, dp_, pp_);
  static constexpr detail::MeshShape expert_ = detail::make_mesh(tp_, ep_, edp_, pp_);

  template <Axis... As>
  static constexpr const detail::MeshShape& mesh_of() noexcept {
    return (false || ... || detail::is_expert_axis(As)) ? expert_ : dense_;
  }

  template <OptionFamily F, Axis A>
  using option_ = typename detail::FindAxisOption<A, F, Axes...>::type;

  static constexpr Schedule schedule_() noexcept {
    using S = option_<OptionFamily::schedule, Axis::pp>;
    using V = option_<OptionFamily::interleaved, Axis::pp>;
    if constexpr (!std::is_void_v<S>) {
      // 1F1B with several chunks per stage is Megatron-LM's interleaved 1F1B.
      if constexpr (!std::is_void_v<V>)
        if (S::schedule == Schedule::one_f_one_b && V::virtual_stages > 1) return Schedule::interleaved;
      return S::schedule;
    } else if constexpr (!std::is_void_v<V>) {
      return V::virtual_stages > 1 ? Schedule::interleaved : Schedule::one_f_one_b;
    } else {
      return Schedule::one_f_one_b;
    }
  }

 public:
  //! The number of ranks: TP*CP*DP*PP.
  static constexpr int world_size = tp_ * cp_ * dp_ * pp_;

  //! The size of an axis; size<Axis::edp> is DP*CP/EP.
  template <Axis A>
  static constexpr int size = sizes_[static_cast<int>(A)];

  //! The policy of an axis as given (with its options), or TP<1>, CP<1>, DP<1>, PP<1>, EP<1> when absent.
  template <Axis A>
  using policy = typename detail::PolicyOr<A, Axes...>::type;

  //! A rank's coordinate on one axis (any of the six).
  template <Axis A>
  [[nodiscard]] static constexpr int coord(int rank) {
    detail::check_index("rank", rank, world_size);
    return (detail::is_expert_axis(A) ? expert_ : dense_).coord(detail::slot_of(A), rank);
  }

  //! A rank's coordinates on the mesh axes.
  [[nodiscard]] static constexpr Coords coords(int rank) {
    detail::check_index("rank", rank, world_size);
    return Coords{dense_.coord(0, rank), dense_.coord(1, rank), dense_.coord(2, rank), dense_.coord(3, rank)};
  }

  //! The rank at the given coordinates (inverse of coords).
  [[nodiscard]] static constexpr int rank_of(Coords c) {
    detail::check_index("tp coordinate", c.tp, tp_);
    detail::check_index("cp coordinate", c.cp, cp_);
    detail::check_index("dp coordinate", c.dp, dp_);
    detail::check_index("pp coordinate", c.pp, pp_);
    return c.tp + tp_ * (c.cp + cp_ * (c.dp + dp_ * c.pp));
  }

  //! The number of ranks in a group over the listed axes: the product of their sizes.
  template <Axis... As>
  static constexpr int group_size = (1 * ... * size<As>);

  //! The number of groups over the listed axes: world_size / group_size.
  template <Axis... As>
  static constexpr int group_count = world_size / group_size<As...>;

  //! The ranks that share every coordinate with rank except those on the listed axes, ascending. group<Axis::dp>
  //! is a data-parallel group, group<Axis::tp, Axis::pp> the model-parallel group, group<Axis::dp, Axis::cp> the
  //! ranks over which dense gradients are reduced, group<Axis::ep> the ranks that share tp, pp and edp.
  template <Axis... As>
  [[nodiscard]] static constexpr std::array<int, group_size<As...>> group(int rank) {
    static_assert(detail::CheckGroupAxes<As...>::value);
    detail::check_index("rank", rank, world_size);
    constexpr unsigned mask = detail::slot_mask<As...>;
    const detail::MeshShape& m = mesh_of<As...>();
    const int base = m.base(mask, rank);
    std::array<int, group_size<As...>> out{};
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = base + m.offset(mask, static_cast<int>(i));
    return out;
  }

  //! Which group over the listed axes rank belongs to: 0 .. group_count-1, in the order of their first ranks.
  template <Axis... As>
  [[nodiscard]] static constexpr int group_index(int rank) {
    static_assert(detail::CheckGroupAxes<As...>::value);
    detail::check_index("rank", rank, world_size);
    return mesh_of<As...>().index(detail::all_slots & ~detail::slot_mask<As...>, rank);
  }

  //! rank's position inside its group over the listed axes: group<As...>(rank)[group_rank<As...>(rank)] == rank.
  template <Axis... As>
  [[nodiscard]] static constexpr int group_rank(int rank) {
    static_assert(detail::CheckGroupAxes<As...>::value);
    detail::check_index("rank", rank, world_size);
    return mesh_of<As...>().index(detail::slot_mask<As...>, rank);
  }

  //! Every group over the listed axes, indexed by group_index; together they partition the ranks.
  template <Axis... As>
  [[nodiscard]] static constexpr std::array<std::array<int, group_size<As...>>, group_count<As...>> groups() {
    std::array<std::array<int, group_size<As...>>, group_count<As...>> out{};
    std::size_t g = 0;
    for (int r = 0; r < world_size; ++r) {
      if (group_rank<As...>(r) == 0) out[g++] = group<As...>(r);
    }
    return out;
  }

  //! ZeRO stage of the DP axis (ZeRO<k>); 0 when not given.
  static constexpr int zero_stage = [] {
    using Z = option_<OptionFamily::zero, Axis::dp>;
    if constexpr (std::is_void_v<Z>) {
      return 0;
    } else {
      return Z::stage;
    }
  }();

  //! Whether DP has KeepGathered (with ZeRO<3>: gathered parameters kept from forward to backward).
  static constexpr bool keep_gathered = !std::is_void_v<option_<OptionFamily::keep_gathered, Axis::dp>>;
  static_assert(!keep_gathered || zero_stage == 3,
                "loom: KeepGathered keeps ZeRO-3's gathered parameters, so it goes with DP<n, ZeRO<3>>");
  static_assert(zero_stage < 3 || keep_gathered || size<Axis::pp> == 1,
                "loom: ZeRO<3> under pipeline parallelism needs DP<n, ZeRO<3>, KeepGathered>: a stage runs several "
                "micro-batches' forwards before their backwards, and gathering every unit again for each would "
                "multiply the all-gathers by the micro-batch count");

  //! The ranks ZeRO shards over (HybridShard<s>: groups of s data-parallel ranks, replicated across the groups); the
  //! data-parallel size when not given.
  static constexpr int shard_group = [] {
    using S = option_<OptionFamily::shard, Axis::dp>;
    if constexpr (std::is_void_v<S>) {
      return size<Axis::dp>;
    } else {
      return S::group;
    }
  }();
  static_assert(shard_group == size<Axis::dp> || zero_stage > 0,
                "loom: HybridShard<s> shards ZeRO's state over groups of s data-parallel ranks: it needs "
                "DP<n, ZeRO<k>>");
  static_assert(size<Axis::dp> % shard_group == 0,
                "loom: HybridShard<s> needs s to divide the data-parallel size n (groups of s ranks, replicated n / s "
                "times)");

  //! Whether data parallelism averages gradients in their own type (ReduceIn<bf16>) rather than in acc_t of it.
  static constexpr bool reduce_in_storage_type = [] {
    using R = option_<OptionFamily::reduce_in, Axis::dp>;
    if constexpr (std::is_void_v<R>) {
      return false;
    } else {
      return std::is_same_v<typename R::type, bf16>;
    }
  }();

  //! Whether TP has SequenceParallel.
  static constexpr bool sequence_parallel = !std::is_void_v<option_<OptionFamily::sequence_parallel, Axis::tp>>;

  //! Model chunks per pipeline rank (Interleaved<v>); 1 when not given.
  static constexpr int virtual_stages = [] {
    using V = option_<OptionFamily::interleaved, Axis::pp>;
    if constexpr (std::is_void_v<V>) {
      return 1;
    } else {
      return V::virtual_stages;
    }
  }();

  //! The pipeline schedule: the one given (1F1B with Interleaved<v>, v > 1, is interleaved 1F1B); else interleaved
  //! when Interleaved<v> with v > 1; else 1F1B.
  static constexpr Schedule schedule = schedule_();
  static_assert(virtual_stages == 1 || schedule == Schedule::interleaved ||
                    (schedule == Schedule::zero_bubble_v && virtual_stages == 2),
                "loom: Interleaved<v> with v > 1 goes with 1F1B (interleaved 1F1B) or, with v = 2, ZeroBubbleV; GPipe "
                "and ZeroBubbleH1 hold one chunk per stage");

  //! The context-parallel algorithm: the one given; else ring.
  static constexpr CpAlgorithm cp_algorithm = [] {
    using A = option_<OptionFamily::cp_algorithm, Axis::cp>;
    if constexpr (std::is_void_v<A>) {
      return CpAlgorithm::ring;
    } else {
      return A::algorithm;
    }
  }();

  //! Whether CP was given Ring or Ulysses (cp_algorithm is ring either way when it was not).
  static constexpr bool cp_algorithm_given = !std::is_void_v<option_<OptionFamily::cp_algorithm, Axis::cp>>;

  //! The layout's name, axes in the order given, each followed by its options: "tp2.pp4.dp2", "dp8.zero1",
  //! "tp4.sp", "pp4.v2", "cp2.ulysses"; "single" for Parallel<>.
  [[nodiscard]] static constexpr std::string_view name() noexcept { return detail::LayoutName<Axes...>::value; }
};

namespace detail {
template <class T>
struct IsParallel : std::false_type {};
template <class... Ps>
struct IsParallel<Parallel<Ps...>> : std::true_type {};
}  // namespace detail

//! A Parallel<...> layout.
template <class T>
concept ParallelLayout = detail::IsParallel<std::remove_cv_t<T>>::value;

}  // namespace loom

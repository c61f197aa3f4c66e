// loom/config/options.hpp: the options an axis policy accepts (ZeRO<k>, KeepGathered, HybridShard<s>,
// ReduceIn<T>, SequenceParallel, Interleaved<v>, pipeline schedules, Ring/Ulysses), the Option concept that
// recognises them, and the Schedule and CpAlgorithm enums.
#pragma once

#include <concepts>
#include <string_view>
#include <type_traits>

#include <loom/config/axis.hpp>
#include <loom/core/dtype.hpp>

namespace loom {

//! Options come in families; an axis takes at most one option of each family.
enum class OptionFamily {
  zero, keep_gathered, shard, reduce_in, sequence_parallel, interleaved, schedule, cp_algorithm
};

//! The pipeline schedule of a layout (Parallel<...>::schedule).
enum class Schedule { gpipe, one_f_one_b, interleaved, zero_bubble_h1, zero_bubble_v };

//! How context parallelism splits attention (Parallel<...>::cp_algorithm).
enum class CpAlgorithm { ring, ulysses };

//! DP option: shard optimizer state (1), gradients too (2), parameters too (3); 0 is plain data parallelism.
template <int K>
struct ZeRO {
  static_assert(K >= 0 && K <= 3, "loom: ZeRO<k> needs k in 0..3");
  static constexpr OptionFamily family = OptionFamily::zero;
  static constexpr Axis owner = Axis::dp;
  static constexpr int stage = K;
};

//! DP option, with ZeRO<3>: a unit's gathered parameters are kept from its forward to its backward (and over a
//! step's micro-batches) instead of being freed after the forward and gathered again before the backward: one
//! all-gather fewer per unit and step, for the memory of the whole part during the step. Pipeline parallelism
//! needs it (a stage runs several forwards before their backwards).
struct KeepGathered {
  static constexpr OptionFamily family = OptionFamily::keep_gathered;
  static constexpr Axis owner = Axis::dp;
};

//! DP option, with ZeRO<k>: hybrid sharding (HSDP). The training state is sharded over groups of S consecutive
//! data-parallel ranks and replicated across the n / S groups: gradients are reduce-scattered within a group, then
//! each rank's shard is averaged over its replicas (the ranks at its place in the other groups). S divides n.
template <int S>
struct HybridShard {
  static_assert(S >= 2, "loom: HybridShard<s> needs s >= 2 (with s = 1 every rank would hold everything)");
  static constexpr OptionFamily family = OptionFamily::shard;
  static constexpr Axis owner = Axis::dp;
  static constexpr int group = S;
};

//! DP option: the type gradients are averaged in over data parallelism. By default acc_t of the model's type (bf16
//! gradients in fp32, from a widened copy); ReduceIn<bf16> averages bf16 gradients as they are, for half the bytes.
template <class T>
struct ReduceIn {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>,
                "loom: ReduceIn<T> takes float (the default for bf16 gradients) or bf16");
  static constexpr OptionFamily family = OptionFamily::reduce_in;
  static constexpr Axis owner = Axis::dp;
  using type = T;
};

//! TP option: activations outside the tensor-parallel regions are split along the sequence over the TP ranks.
struct SequenceParallel {
  static constexpr OptionFamily family = OptionFamily::sequence_parallel;
  static constexpr Axis owner = Axis::tp;
};

//! PP option: each pipeline rank holds V model chunks (virtual stages).
template <int V>
struct Interleaved {
  static_assert(V >= 1, "loom: Interleaved<v> needs v >= 1");
  static constexpr OptionFamily family = OptionFamily::interleaved;
  static constexpr Axis owner = Axis::pp;
  static constexpr int virtual_stages = V;
};

namespace detail {
template <Schedule S>
struct ScheduleTag {
  static constexpr OptionFamily family = OptionFamily::schedule;
  static constexpr Axis owner = Axis::pp;
  static constexpr Schedule schedule = S;
};
template <CpAlgorithm A>
struct CpAlgorithmTag {
  static constexpr OptionFamily family = OptionFamily::cp_algorithm;
  static constexpr Axis owner = Axis::cp;
  static constexpr CpAlgorithm algorithm = A;
};
}  // namespace detail

//! PP options: the pipeline schedule. At most one per layout; 1F1B when none is given.
struct GPipe : detail::ScheduleTag<Schedule::gpipe> {};
struct OneFOneB : detail::ScheduleTag<Schedule::one_f_one_b> {};
struct ZeroBubbleH1 : detail::ScheduleTag<Schedule::zero_bubble_h1> {};
struct ZeroBubbleV : detail::ScheduleTag<Schedule::zero_bubble_v> {};

//! CP options: ring attention passes key/value blocks around the CP ranks; Ulysses swaps the sequence split for a
//! head split with all-to-all. At most one; Ring when none is given.
struct Ring : detail::CpAlgorithmTag<CpAlgorithm::ring> {};
struct Ulysses : detail::CpAlgorithmTag<CpAlgorithm::ulysses> {};

//! The options of an axis policy, as a type (TP<4, SequenceParallel>::options is Options<SequenceParallel>).
template <class... Opts>
struct Options {};

//! A loom option: a type that names its family and the axis it belongs to.
template <class T>
concept Option = requires {
  { T::family } -> std::convertible_to<OptionFamily>;
  { T::owner } -> std::convertible_to<Axis>;
} && std::is_same_v<std::remove_cv_t<decltype(T::family)>, OptionFamily>;

//! The name of a schedule, as the --schedule flag spells it: "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v".
[[nodiscard]] constexpr std::string_view describe_schedule(Schedule s) noexcept {
  switch (s) {
    case Schedule::gpipe: return "gpipe";
    case Schedule::one_f_one_b: return "1f1b";
    case Schedule::interleaved: return "interleaved";
    case Schedule::zero_bubble_h1: return "zb-h1";
    case Schedule::zero_bubble_v: return "zb-v";
  }
  return "?";
}

//! The name of a context-parallel algorithm: "ring" or "ulysses".
[[nodiscard]] constexpr std::string_view describe_cp_algorithm(CpAlgorithm a) noexcept {
  return a == CpAlgorithm::ring ? "ring" : "ulysses";
}

}  // namespace loom

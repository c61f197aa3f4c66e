// A layout as a value, of any size: what Parallel<...> says (the degrees of tp, cp, pp, dp and ep, sequence
// parallelism, the context-parallel algorithm, the pipeline's schedule and chunks, the ZeRO stage, hybrid sharding),
// read from a layout type or from its name as train_gpt and LayoutOf spell it; and the first rule a shape and a run
// break on it, in the words the compile-time rules use.
#pragma once

#include <loom/config/layout_of.hpp>
#include <loom/core/error.hpp>
#include <loom/models/gpt/shape.hpp>
#include <loom/pipeline/schedule.hpp>
#include <loom/plan/model.hpp>

#include <string>
#include <string_view>

namespace loom::plan {

struct Layout {
  int tp = 1, cp = 1, pp = 1, dp = 1, ep = 1;
  int v = 1;      //!< model chunks per stage (interleaved); ZB-V holds two whatever v says
  int zero = 0;   //!< ZeRO stage over the data-parallel group
  int shard = 0;  //!< hybrid sharding: the ZeRO state over groups of `shard` data-parallel ranks (0: all dp)
  bool sp = false, ulysses = false, keep = false;
  Schedule schedule = Schedule::one_f_one_b;

  constexpr int world() const { return tp * cp * pp * dp; }
  //! Model chunks per pipeline stage.
  constexpr int chunks() const { return pp > 1 ? pipeline::chunks_per_stage(schedule, v) : 1; }
  //! Ranks a ZeRO shard is spread over: the data-parallel group, dp x cp (the context-parallel ranks average their
  //! gradients as data-parallel ones do), or a hybrid-sharding group.
  constexpr int zero_ranks() const { return zero == 0 ? 1 : shard > 0 ? shard : dp * cp; }
  //! The expert-data-parallel degree: the ranks of dp x cp that hold the same experts.
  constexpr int edp() const { return dp * cp / ep; }

  //! The name as Parallel<...>::name() prints it: "tp2.sp.pp4.zb-v.dp8.zero1", "single" for one rank.
  std::string name() const {
    std::string n;
    auto add = [&](std::string_view part) { n += (n.empty() ? "" : ".") + std::string(part); };
    if (tp > 1) add("tp" + std::to_string(tp));
    if (sp) add("sp");
    if (cp > 1) add("cp" + std::to_string(cp));
    if (ulysses) add("ulysses");
    if (pp > 1) {
      add("pp" + std::to_string(pp));
      if (schedule != Schedule::one_f_one_b && schedule != Schedule::interleaved) add(describe_schedule(schedule));
      if (schedule == Schedule::interleaved) add("v" + std::to_string(v));
    }
    if (dp > 1) add("dp" + std::to_string(dp));
    if (zero > 0) add("zero" + std::to_string(zero));
    if (keep) add("keep");
    if (shard > 0) add("shard" + std::to_string(shard));
    if (ep > 1) add("ep" + std::to_string(ep));
    return n.empty() ? "single" : n;
  }
  constexpr bool operator==(const Layout&) const = default;
};

//! The layout of a Parallel<...> type.
template <class Cfg>
constexpr Layout layout_of() {
  Layout l;
  l.tp = Cfg::template size<Axis::tp>, l.cp = Cfg::template size<Axis::cp>, l.pp = Cfg::template size<Axis::pp>;
  l.dp = Cfg::template size<Axis::dp>, l.ep = Cfg::template size<Axis::ep>;
  l.sp = Cfg::sequence_parallel, l.ulysses = Cfg::cp_algorithm == CpAlgorithm::ulysses;
  l.schedule = Cfg::schedule, l.v = Cfg::schedule == Schedule::interleaved ? Cfg::virtual_stages : 1;
  l.zero = Cfg::zero_stage, l.keep = Cfg::keep_gathered;
  l.shard = Cfg::shard_group == l.dp ? 0 : Cfg::shard_group;
  return l;
}

//! The layout `spec` names (train_gpt's --parallel, with commas, or Parallel<...>::name(), with dots; sizes of any
//! size), with `schedule` (train_gpt's --schedule) where the name gives none. Throws a loom::Error naming the part
//! that is wrong.
inline Layout layout_named(std::string_view spec, std::string_view schedule = {}) {
  const auto s = loom::detail::parse_layout_name(spec);
  using E = loom::detail::LayoutSpelling::Error;
  if (s.error != E::none) {
    const std::string part(spec.substr(s.bad, s.bad_size));
    const char* why = s.error == E::unknown_part   ? "is not one of tpN, sp, cpN, ring, ulysses, ppN, gpipe, 1f1b, "
                                                     "zb-h1, zb-v, vN, dpN, zeroK, keep, shardS, epN"
                      : s.error == E::bad_number   ? "needs a size of at least 1 (zeroK: 0 to 3; shardS: at least 2)"
                      : s.error == E::repeated     ? "is given twice, or with another of its family"
                      : s.error == E::sp_without_tp ? "needs tpN, N >= 2"
                      : s.error == E::cp_option_without_cp ? "needs cpN, N >= 2"
                      : s.error == E::pp_option_without_pp ? "needs ppN, N >= 2"
                      : s.error == E::dp_option_without_dp ? "needs dpN, N >= 2"
                      : s.error == E::keep_without_zero3   ? "needs zero3"
                                                           : "needs zeroK and a size that divides dpN";
    throw Error(loom::detail::cat("loom: layout '", spec, "': '", part, "' ", why));
  }
  Layout l;
  l.tp = s.tp, l.cp = s.cp, l.pp = s.pp, l.dp = s.dp, l.ep = s.ep, l.v = s.v;
  l.zero = s.zero, l.shard = s.shard, l.sp = s.sp, l.ulysses = s.ulysses, l.keep = s.keep;
  if (s.schedule >= 0) {
    l.schedule = static_cast<Schedule>(s.schedule);
  } else if (!schedule.empty()) {
    bool known = false;
    for (Schedule c : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::interleaved, Schedule::zero_bubble_h1,
                       Schedule::zero_bubble_v})
      if (describe_schedule(c) == schedule) l.schedule = c, known = true;
    if (!known)
      throw Error(loom::detail::cat("loom: unknown schedule '", schedule, "' (gpipe, 1f1b, interleaved, zb-h1, zb-v)"));
  }
  if (l.v > 1 && s.schedule < 0) l.schedule = Schedule::interleaved;
  return l;
}

//! The first rule that shape `s` and run `r` break on layout `l`, or an empty string: the shape's own, the tensor-,
//! context- and expert-parallel splits, the pipeline's split of the layers, the batch's split into data-parallel
//! ranks and micro-batches, the sequence's over cp, the schedules' counts.
inline std::string violation(const GptShape& s, const Layout& l, const Run& r) {
  using loom::detail::cat;
  if (auto v = models::shape_violation(s); !v.empty()) return std::string(v);
  if (auto v = models::tensor_parallel_violation(s, l.tp, l.sp); !v.empty()) return std::string(v);
  if (auto v = models::context_parallel_violation(s, l.tp, l.cp, l.ulysses ? CpAlgorithm::ulysses : CpAlgorithm::ring);
      !v.empty())
    return std::string(v);
  if (auto v = models::expert_parallel_violation(s, l.ep); !v.empty()) return std::string(v);
  if ((l.dp * l.cp) % l.ep != 0) return cat("EP ", l.ep, " must divide dp x cp = ", l.dp * l.cp);
  if (l.zero == 3 && l.pp > 1 && !l.keep) return "zero3 under pipeline parallelism needs keep";
  if (l.schedule == Schedule::interleaved && l.pp > 1 && l.v < 2) return "the interleaved schedule needs v >= 2";
  const int parts = l.pp * l.chunks();
  if (r.ends_alone && (r.recipe != Recipe::megatron || parts < 3))
    return "a part for the embedding alone and one for the output layer alone: Megatron-LM's recipe, 3 parts or more";
  if (s.layers < parts - (r.ends_alone ? 2 : 0))
    return cat(s.layers, " layers cannot fill ", parts, " pipeline parts (pp x chunks)");
  if (r.batch < 1 || r.micro_batches < 1 || r.batch % (l.dp * r.micro_batches) != 0)
    return cat("the batch of ", r.batch, " sequences does not split into dp ", l.dp, " x ", r.micro_batches,
               " micro-batches");
  if (l.pp > 1 && pipeline::detail::count_rule(l.schedule, l.pp, r.micro_batches, l.chunks()) !=
                     pipeline::detail::CountRule::ok)
    return cat("the ", describe_schedule(l.schedule), " schedule cannot run ", r.micro_batches,
               " micro-batches on ", l.pp, " stages with ", l.chunks(), " chunks each (interleaved: a multiple of "
               "pp, at least pp)");
  if (r.seq < 1 || r.seq > s.max_seq) return cat("seq ", r.seq, " is outside 1..", s.max_seq, " (the model's max_seq)");
  if (l.cp > 1 && r.seq % (2 * l.cp) != 0) return cat("seq ", r.seq, " must be divisible by 2 x cp = ", 2 * l.cp);
  if (l.sp && (r.micro_batch_size(l.dp) * (r.seq / l.cp)) % l.tp != 0)
    return cat("with sp, a micro-batch's ", r.micro_batch_size(l.dp) * (r.seq / l.cp), " tokens per rank must be "
               "divisible by tp ", l.tp);
  return {};
}

}  // namespace loom::plan

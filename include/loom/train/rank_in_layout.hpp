// A rank's place in a layout, as a training step uses it: its communicators (the groups the mesh gives it), its
// coordinates, the schedule, and whether there is a pipeline and which ZeRO stage; taken from the layout type by
// rank_in_layout(ctx), and over type-erased communicators (AnyRankInLayout).
#pragma once

#include <loom/comm/any.hpp>
#include <loom/comm/context.hpp>
#include <loom/config.hpp>
#include <loom/pipeline/schedule.hpp>

#include <algorithm>
#include <memory>
#include <vector>

namespace loom::train {

//! The part of a layout a training step depends on: this rank's communicators and place, whether the layout has a
//! pipeline axis, and its ZeRO stage. With context parallelism the gradients, the loss and ZeRO's shards are over
//! dp x cp (`dp`; each cp rank's loss is its share of the sequences'), the batch over the DP ranks (dp_size). Taken
//! from the layout type by rank_in_layout(ctx), so that a trainer built from it is compiled once per model,
//! optimizer, backend, Pipelined and Zero, not once per layout (as ModelLayout<Cfg> is for the model).
template <class Comm, bool Pipelined, int Zero = 0>
struct RankInLayout {
  static constexpr bool pipelined = Pipelined;
  static constexpr int zero = Zero;
  bool keep_gathered;  //!< ZeRO-3's KeepGathered
  Comm* tp;
  Comm* dp;    //!< where gradients are averaged: the data-parallel group, with context parallelism dp x cp
  Comm* pp;
  Comm* world;
  Comm* tied;  //!< the first and last stages' pair, for the tied table; null when one stage holds both uses
  int dp_rank, stage, stages;  //!< dp_rank: this rank's dp coordinate, which picks its sequences of the batch
  Schedule schedule;
  int chunks;               //!< model chunks per pipeline stage
  Comm* shard = nullptr;     //!< with HybridShard<s>: this rank's group of s data-parallel ranks (ZeRO's group)
  Comm* replicas = nullptr;  //!< with HybridShard<s>: the ranks at this rank's place in the other groups
  bool reduce_in_storage = false;  //!< ReduceIn<bf16>: gradients averaged in their own type, not widened
  Comm* cp = nullptr;  //!< with context parallelism: the cp group
  int dp_size = 1;     //!< the DP degree, over which the batch's sequences are split
  Comm* ep = nullptr;   //!< with expert parallelism: the ep group (a split of dp x cp), which splits the experts
  Comm* edp = nullptr;  //!< with expert parallelism: the expert-data-parallel group, over which experts' gradients
                        //!< are averaged
  int ep_size = 1;
};

//! Rank ctx's RankInLayout in layout Cfg. The first call for a context is collective over its groups.
template <class Cfg, class Backend>
auto rank_in_layout(Context<Cfg, Backend>& ctx) {
  constexpr int stages = Cfg::template size<Axis::pp>;
  constexpr bool pipelined = stages > 1;
  constexpr int chunks = pipelined ? pipeline::chunks_per_stage(Cfg::schedule, Cfg::virtual_stages) : 1;
  constexpr int cp = Cfg::template size<Axis::cp>;
  constexpr int ep = Cfg::template size<Axis::ep>;
  static_assert(ep == 1 || Cfg::shard_group == Cfg::template size<Axis::dp>,
                "loom: DP<n, ZeRO<k>, HybridShard<s>> with EP<m> (m > 1) is not implemented yet");
  static_assert(cp == 1 || Cfg::shard_group == Cfg::template size<Axis::dp>,
                "loom: DP<n, ZeRO<k>, HybridShard<s>> with CP<m> (m > 1) is not implemented (its shard groups are "
                "data-parallel ranks alone; with context parallelism they would span dp x cp)");
  typename Backend::Comm* dp = nullptr;
  if constexpr (cp > 1) dp = &ctx.template comm<Axis::dp, Axis::cp>();
  else dp = &ctx.template comm<Axis::dp>();
  RankInLayout<typename Backend::Comm, pipelined, Cfg::zero_stage> at{Cfg::keep_gathered,
                                                                     &ctx.template comm<Axis::tp>(),
                                                                     dp,
                                                                     &ctx.template comm<Axis::pp>(), &ctx.world(),
                                                                     nullptr, ctx.template coord<Axis::dp>(),
                                                                     ctx.template coord<Axis::pp>(), stages,
                                                                     Cfg::schedule, chunks};
  at.reduce_in_storage = Cfg::reduce_in_storage_type;
  at.dp_size = Cfg::template size<Axis::dp>;
  if constexpr (cp > 1) at.cp = &ctx.template comm<Axis::cp>();
  if constexpr (ep > 1) {
    at.ep = &ctx.template comm<Axis::ep>();
    at.edp = &ctx.template comm<Axis::edp>();
    at.ep_size = ep;
  }
  if constexpr (Cfg::shard_group < Cfg::template size<Axis::dp>) {  // hybrid sharding: groups of s, replicated
    constexpr int s = Cfg::shard_group, dp = Cfg::template size<Axis::dp>;
    const auto all = Cfg::template group<Axis::dp>(ctx.rank());
    const int d = at.dp_rank;
    std::vector<int> group, replicas;
    for (int i = 0; i < s; ++i) group.push_back(all[std::size_t(d / s * s + i)]);
    for (int k = 0; k < dp / s; ++k) replicas.push_back(all[std::size_t(k * s + d % s)]);
    at.shard = &ctx.get(comm::GroupInfo{"shard", group});
    at.replicas = &ctx.get(comm::GroupInfo{"replicas", replicas});
  }
  if constexpr (pipelined) {
    // The stages holding the first part (embedding) and the last (output layer) share the tied table.
    const int first = pipeline::stage_chunk(Cfg::schedule, stages, 0).stage;
    const int last = pipeline::stage_chunk(Cfg::schedule, stages, stages * chunks - 1).stage;
    if (first != last) {
      Coords a = Cfg::coords(ctx.rank()), b = a;
      a.pp = first, b.pp = last;
      std::vector<int> ranks{Cfg::rank_of(a), Cfg::rank_of(b)};
      std::sort(ranks.begin(), ranks.end());
      if (at.stage == first || at.stage == last) at.tied = &ctx.get(comm::GroupInfo{"embedding", ranks});
    }
  }
  return at;
}

//! A rank's RankInLayout over type-erased communicators (comm::AnyComm), which refer to the given rank's: a trainer
//! built from get() is one type whatever the backend, so a program that runs several backends compiles its
//! trainer once. It must not outlive the communicators it refers to.
template <bool Pipelined, int Zero>
class AnyRankInLayout {
 public:
  template <class Comm>
  explicit AnyRankInLayout(const RankInLayout<Comm, Pipelined, Zero>& at)
      : tp_(*at.tp), dp_(*at.dp), pp_(*at.pp), world_(*at.world),
        tied_(at.tied ? std::make_unique<comm::AnyComm>(*at.tied) : nullptr),
        shard_(at.shard ? std::make_unique<comm::AnyComm>(*at.shard) : nullptr),
        replicas_(at.replicas ? std::make_unique<comm::AnyComm>(*at.replicas) : nullptr),
        cp_(at.cp ? std::make_unique<comm::AnyComm>(*at.cp) : nullptr),
        ep_(at.ep ? std::make_unique<comm::AnyComm>(*at.ep) : nullptr),
        edp_(at.edp ? std::make_unique<comm::AnyComm>(*at.edp) : nullptr),
        at_{at.keep_gathered, &tp_,     &dp_,      &pp_,        &world_,   tied_.get(),  at.dp_rank,
            at.stage,         at.stages, at.schedule, at.chunks, shard_.get(), replicas_.get(), at.reduce_in_storage,
            cp_.get(),        at.dp_size, ep_.get(), edp_.get(), at.ep_size} {}
  AnyRankInLayout(const AnyRankInLayout&) = delete;
  AnyRankInLayout& operator=(const AnyRankInLayout&) = delete;

  const RankInLayout<comm::AnyComm, Pipelined, Zero>& get() const { return at_; }

 private:
  comm::AnyComm tp_, dp_, pp_, world_;
  std::unique_ptr<comm::AnyComm> tied_, shard_, replicas_, cp_, ep_, edp_;
  RankInLayout<comm::AnyComm, Pipelined, Zero> at_;
};

}  // namespace loom::train

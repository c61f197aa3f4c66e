// One trainer for every layout: Trainer<Cfg, Model, Optimizer> trains a model on rank ctx of layout Cfg, whatever
// axes Cfg has. The type decides: without a pipeline axis the rank holds its tensor-parallel part of the whole
// model, runs its micro-batches one after the other and averages gradients over data parallelism bucket by bucket
// during the last backward; with one it holds the parts its stage holds (layers split evenly over the p·v virtual
// stages, or as an explicit split says), runs the schedule PP<p, Schedule, Interleaved<v>> names over its
// micro-batches, averages each part's gradients as soon as its backward is done, and sums the tied embedding's
// gradient between the stages that hold its two uses. Then, for every layout alike: the loss over the global batch,
// the global gradient norm (each element once), a step skipped on every rank when either is not finite, clipping,
// and every part's optimizer step.
#pragma once

#include <loom/comm/any.hpp>
#include <loom/comm/context.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/pipeline/executor.hpp>
#include <loom/train/data.hpp>
#include <loom/train/data_parallel.hpp>
#include <loom/train/zero.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <functional>
#include <memory>
#include <span>
#include <vector>

namespace loom::train {

//! How one optimizer step is made: global batch, micro-batches, clipping, warmup.
struct StepConfig {
  int batch = 16;          //!< sequences per step, over the whole data-parallel group
  int seq = 64;            //!< tokens per sequence
  int micro_batches = 1;   //!< per rank: gradient accumulation
  double lr = 3e-3;
  int warmup = 0;
  double grad_clip = 1.0;  //!< 0: off
  std::size_t bucket_bytes = std::size_t{25} << 20;
  bool overlap = true;
};

//! What a step did. A step whose loss or gradient norm is not finite on some rank is skipped on every rank: no
//! parameter and no optimizer state changes (the optimizer's step counter included), and the caller decides how
//! many skipped steps in a row a run tolerates.
struct StepResult {
  double loss;       //!< mean over the global batch
  double grad_norm;  //!< before clipping
  bool skipped;      //!< the loss or a gradient was not finite on some rank: no update anywhere
  double lr;
  //! What a mixture of experts routed in the step, summed over every rank and MoE layer (empty without experts).
  layers::MoeStats moe;
};

//! The first block of each of `parts` virtual stages and, last, `layers`: from an explicit split (blocks per virtual
//! stage, each at least one, adding up to layers), or an even one. Errors name the numbers that do not fit.
inline std::vector<int> layer_bounds(int layers, int parts, const std::vector<int>& split) {
  std::vector<int> at{0};
  if (split.empty()) {
    LOOM_CHECK(layers % parts == 0, "the model's ", layers, " layers do not split evenly over ", parts,
               " pipeline parts (pp x chunks); give an explicit split of the layers");
    for (int k = 0; k < parts; ++k) at.push_back(at.back() + layers / parts);
    return at;
  }
  LOOM_CHECK(static_cast<int>(split.size()) == parts, "the layer split has ", split.size(),
             " entries but the pipeline has ", parts, " parts (pp x chunks)");
  for (std::size_t k = 0; k < split.size(); ++k) {
    LOOM_CHECK(split[k] >= 1, "part ", k, " of the layer split has ", split[k],
               " layers; each part needs at least one");
    at.push_back(at.back() + split[k]);
  }
  LOOM_CHECK(at.back() == layers, "the layer split adds up to ", at.back(), " layers but the model has ", layers);
  return at;
}

//! What the trainer needs of a model part; models::Gpt has it. Comm is any communicator type: the trainer builds
//! each part from (seed, tensor-parallel communicator, part, options).
template <class M>
concept TrainableModel = requires(M& m, const M& cm, int i, double s, const typename M::value_type* p,
                                  const typename M::MicroBatch& mb) {
  typename M::value_type;
  typename M::Options;
  typename M::config;
  typename M::ParamRange;
  { M::no_param } -> std::convertible_to<std::size_t>;
  { m.forward(i, mb, p) } -> std::convertible_to<double>;
  m.backward(i, s, p);
  m.backward_inputs(i, s, p);
  m.backward_weights(i);
  { m.backward_chunks() } -> std::convertible_to<int>;
  { m.backward_chunk(i, i, s) } -> std::same_as<typename M::ParamRange>;
  { cm.output(i) } -> std::convertible_to<const typename M::value_type*>;
  { cm.input_grad() } -> std::convertible_to<const typename M::value_type*>;
  { cm.slots() } -> std::convertible_to<int>;
  m.set_slots(i);
  m.zero_grad();
  { m.grad_square(true) } -> std::convertible_to<double>;
  { m.tied_grad() } -> std::convertible_to<std::span<typename M::value_type>>;
  { cm.embedding() } -> std::convertible_to<bool>;
  { cm.head() } -> std::convertible_to<bool>;
  cm.specs();
  m.params();
  m.grads();
  cm.ops();
  { cm.io_elements(i, i) } -> std::convertible_to<std::size_t>;
};

//! What a trainer builds and steps for Model: for models::Gpt<S, T, Cfg, Dev>, models::GptModel<T, Cfg, Dev> (the
//! same code for every shape); any other model (a type derived from Gpt among them) is its own.
template <class M>
struct PartOf {
  using type = M;
};
template <models::GptShape S, class T, class Cfg, class Dev>
struct PartOf<models::Gpt<S, T, Cfg, Dev>> {
  using type = models::GptModel<T, Cfg, Dev>;
};
template <class M>
using part_of_t = typename PartOf<M>::type;

//! What an optimizer needs to offer the trainer.
template <class O, class Model>
concept TrainerOptimizer = requires(O& o, Model& m, double lr) { o.step(m.params(), m.grads(), lr); };

//! What the layout type does not say: how the model starts, how a step is made, and an explicit layer split.
struct TrainerOptions {
  std::uint64_t seed = 0;    //!< initialises the model: the same whole model on every layout
  models::GptOptions model;  //!< recompute, dropout, layer-norm epsilon
  StepConfig step;           //!< global batch, sequence length, micro-batches, lr, warmup, clipping, buckets
  std::vector<int> split;    //!< blocks per virtual pipeline stage, in pipeline order; empty: an even split
};

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

//! What a rank holds of a model part's flat buffers, as ranges [lo, hi) of the part's flat parameters, each with
//! `at`, where element lo sits in the optimizer's state (the parameters sit at lo in the part's buffer): `params`
//! and `state`, what it holds (under ZeRO its shard, else all); `written`, what it writes to a sharded checkpoint
//! (its shard once over the replicas, or an even share of what data parallelism replicates).
struct Holding {
  struct Range {
    std::int64_t lo, hi, at;
  };
  std::vector<Range> params, state, written;
};

namespace detail {

//! A trainer as Trainer<Cfg, ...> holds it, whatever its backend.
template <class Model, class Optimizer>
class TrainerBase {
 public:
  using T = typename Model::value_type;
  using acc = loom::acc_t<T>;
  virtual ~TrainerBase() = default;
  virtual StepResult step(int step) = 0;
  //! Sums a buffer of parameters (or of optimizer state) over the pipeline group; nothing without a pipeline.
  virtual void sum_over_pipeline(std::span<T> x) = 0;
  virtual void sum_state_over_pipeline(std::span<acc> x) = 0;
  //! Part c's parameters in host memory, laid out as its flat buffer: under ZeRO-3 gathered from every rank's
  //! chunks (a collective over data parallelism), else a copy.
  virtual std::vector<T> params_of(std::size_t c) = 0;
  //! Under ZeRO: optimizer state held as part c's shard, laid out as the part's flat parameters (a collective over
  //! data parallelism); and the shard of a buffer so laid out.
  virtual std::vector<acc> gather_state(std::size_t c, const acc* shard) = 0;
  virtual void take_state(std::size_t c, const acc* whole, acc* shard) const = 0;
  //! What this rank holds of part c, for sharded checkpoints (Holding).
  virtual Holding holding(std::size_t c) const = 0;
  //! The world's size and this rank's place in it; a barrier over the world.
  virtual int world_rank() const = 0;
  virtual int world_size() const = 0;
  virtual void barrier() = 0;
  std::vector<std::unique_ptr<Model>> parts;
  std::vector<Optimizer> optimizers;
};

//! The step, for a model, optimizer and communicator type; with or without a pipeline (a compile-time choice).
template <class Model, class Optimizer, class Comm, bool Pipelined, int Zero>
class TrainerCore final : public TrainerBase<Model, Optimizer> {
  using Base = TrainerBase<Model, Optimizer>;
  using T = typename Base::T;
  using acc = typename Base::acc;

 public:
  template <class MakeOptimizer>
  TrainerCore(const RankInLayout<Comm, Pipelined, Zero>& at, const Batches& data, const TrainerOptions& o, int layers,
              const std::function<std::unique_ptr<Model>(models::GptPart)>& make_part, MakeOptimizer&& make_optimizer)
      : at_(at), data_(data), cfg_(o.step), average_(at.reduce_in_storage) {
    const StepConfig& cfg = o.step;
    const int dp = at.dp_size;
    LOOM_CHECK(cfg.micro_batches >= 1 && cfg.batch % (dp * cfg.micro_batches) == 0, "the global batch of ",
               cfg.batch, " sequences does not split into ", dp, " data-parallel ranks x ", cfg.micro_batches,
               " micro-batches");
    rows_ = cfg.batch / dp;
    micro_ = rows_ / cfg.micro_batches;
    const int parts = at.stages * at.chunks;
    if constexpr (Pipelined) {
      table_ = pipeline::make_schedule_checked(at.schedule, at.stages, cfg.micro_batches, at.chunks);
    }
    const std::vector<int> bounds = layer_bounds(layers, parts, o.split);
    for (int c = 0; c < at.chunks; ++c) {
      const int k = Pipelined ? pipeline::virtual_stage(at.schedule, at.stages, at.stage, c) : 0;
      const models::GptPart part{bounds[std::size_t(k)], bounds[std::size_t(k) + 1]};
      {  // what ZeRO accounts for itself is made uncounted
        const int shard = at.shard ? at.shard->size() : at.dp->size();
        const UncountedMemoryScope uncounted(Zero > 0 ? ShardedDataParallel<Model, Comm>::uncounted_uses(Zero, shard)
                                                      : std::vector<MemoryUse>{});
        this->parts.push_back(make_part(part));
      }
      Model& m = *this->parts.back();
      if constexpr (Zero > 0) {  // the optimizer holds this rank's shard (the tied table counts on the embedding's)
        zero_.push_back(std::make_unique<ShardedDataParallel<Model, Comm>>(
            m, at.shard ? *at.shard : *at.dp, Zero, cfg.bucket_bytes, cfg.overlap, Pipelined && !m.embedding(),
            at.keep_gathered, at.replicas, at.reduce_in_storage, at.edp, at.ep_size));
        if constexpr (requires { m.initialise(o.seed, 0, 0); })
          if (!m.options().write_buffers)  // ZeRO-3: the model was built unwritten; the rank initialises its shard
            for (const auto& p : zero_.back()->plan().pieces) m.initialise(o.seed, p.own_lo, p.own_hi);
        this->optimizers.push_back(make_optimizer(zero_.back()->plan().slices, zero_.back()->plan().numel));
      } else {
        this->optimizers.push_back(make_optimizer(m.specs(), m.params().numel()));
      }
    }
    if constexpr (Pipelined) {
      std::vector<Model*> raw;
      for (auto& p : this->parts) raw.push_back(p.get());
      exec_ = std::make_unique<pipeline::Executor<Model, Comm>>(raw, *at.pp, at.schedule);
      exec_->prepare(table_);  // verified here, once, not at every step
      in_.resize(std::size_t(cfg.micro_batches));
      tg_.resize(in_.size());
    } else {
      if constexpr (Zero == 0)
        ddp_ = std::make_unique<DataParallel<Model, Comm>>(*this->parts.front(), *at.dp, cfg.bucket_bytes,
                                                            cfg.overlap, at.reduce_in_storage, at.edp, at.ep_size);
      in_.resize(1);
      tg_.resize(1);
    }
  }

  StepResult step(int step) override {
    auto& parts = this->parts;
    for (std::size_t c = 0; c < parts.size(); ++c) {
      if constexpr (Zero > 0) zero_[c]->zero_grad();  // under ZeRO-2, what the rank holds
      else parts[c]->zero_grad();
    }
    const double loss = Pipelined ? run_pipeline(step) : run_micro_batches(step);
    // The loss of the global batch: on the last stage, summed over the pipeline, averaged over data parallelism
    // (and context parallelism: each cp rank's is the mean over its share of the sequences).
    std::vector<double> l{loss};
    if constexpr (Pipelined) at_.pp->all_reduce(l, comm::Reduce::sum);
    at_.dp->all_reduce(l, comm::Reduce::avg);
    // The global norm: every element once (tensor-parallel ranks sum their parts; the tied table counts on the
    // stage with the embedding).
    double sq = 0;
    std::vector<double> s{0};
    if constexpr (Zero > 0) {  // each rank's shards; summed over the data- and tensor-parallel groups
      for (auto& z : zero_) sq += z->grad_square();
      s[0] = sq;
      (at_.shard ? at_.shard : at_.dp)->all_reduce(s, comm::Reduce::sum);  // one copy of each shard
      at_.tp->all_reduce(s, comm::Reduce::sum);
    } else {
      for (auto& p : parts) sq += p->grad_square(/*skip_tied=*/!p->embedding());
      s[0] = sq;
    }
    if constexpr (Pipelined) at_.pp->all_reduce(s, comm::Reduce::sum);
    const double norm = std::sqrt(s[0]);
    const layers::MoeStats moe = routed();
    // Every rank skips the update, or none does (StepResult).
    std::vector<int> finite{std::isfinite(norm) && std::isfinite(l[0]) ? 1 : 0};
    at_.world->all_reduce(finite, comm::Reduce::min);
    const double lr = optim::warmup_lr(cfg_.lr, step, cfg_.warmup);
    if (!finite[0]) return {l[0], norm, true, lr, moe};
    for (std::size_t c = 0; c < parts.size(); ++c) {
      if constexpr (Zero > 0) {  // this rank's shard, then every rank's updated parameters
        zero_[c]->clip(norm, cfg_.grad_clip);
        this->optimizers[c].step(parts[c]->params(), parts[c]->grads(), lr);
        zero_[c]->gather_params();
      } else {
        optim::clip_to(parts[c]->grads(), norm, cfg_.grad_clip, parts[c]->ops());
        this->optimizers[c].step(parts[c]->params(), parts[c]->grads(), lr);
      }
    }
    return {l[0], norm, false, lr, moe};
  }

  void sum_over_pipeline(std::span<T> x) override {
    if constexpr (Pipelined) at_.pp->all_reduce(x, comm::Reduce::sum);
  }
  void sum_state_over_pipeline(std::span<acc> x) override {
    if constexpr (Pipelined) at_.pp->all_reduce(x, comm::Reduce::sum);
  }

  std::vector<T> params_of(std::size_t c) override {
    if constexpr (Zero > 0) {
      return zero_[c]->whole_params();
    } else {
      const auto& w = this->parts[c]->params();
      std::vector<T> out(static_cast<std::size_t>(w.numel()));
      this->parts[c]->ops().to_host(w.data(), out.data(), out.size());
      return out;
    }
  }
  std::vector<acc> gather_state(std::size_t c, const acc* shard) override {
    if constexpr (Zero > 0) return zero_[c]->gather_shard(shard);
    else return std::vector<acc>(shard, shard + this->parts[c]->params().numel());
  }
  void take_state(std::size_t c, const acc* whole, acc* shard) const override {
    if constexpr (Zero > 0) zero_[c]->take_shard(whole, shard);
    else std::copy_n(whole, this->parts[c]->params().numel(), shard);
  }

  Holding holding(std::size_t c) const override {
    const std::int64_t n = this->parts[c]->params().numel();
    Holding h;
    if constexpr (Zero > 0) {
      const auto& pieces = zero_[c]->plan().pieces;
      const bool first_replica = !at_.replicas || at_.replicas->rank() == 0;
      for (const auto& p : pieces) {
        if (p.own() == 0) continue;
        h.state.push_back({p.own_lo, p.own_hi, p.at});
        if (first_replica) h.written.push_back({p.own_lo, p.own_hi, p.at});
      }
      if (Zero >= 3 && (at_.shard ? at_.shard : at_.dp)->size() > 1) h.params = h.state;
      else h.params.push_back({0, n, 0});
    } else {  // replicated over data parallelism: each rank writes an even share
      const int d = at_.dp->size(), r = at_.dp->rank();
      h.state.push_back({0, n, 0});
      h.params = h.state;
      const std::int64_t lo = n * r / d, hi = n * (r + 1) / d;
      if (lo < hi) h.written.push_back({lo, hi, lo});
    }
    return h;
  }
  int world_rank() const override { return at_.world->rank(); }
  int world_size() const override { return at_.world->size(); }
  void barrier() override { at_.world->barrier(); }

  const DataParallel<Model, Comm>* data_parallel() const { return ddp_.get(); }

 private:
  //! What the parts' mixtures of experts routed in this step, summed over every rank (a collective over the world
  //! when the model has experts); the time in all-to-alls is this rank's own.
  layers::MoeStats routed() {
    layers::MoeStats moe;
    if constexpr (requires(Model& m) { m.take_moe_stats(); }) {
      if (this->parts.front()->shape().experts == 0) return moe;
      for (auto& p : this->parts) moe += p->take_moe_stats();
      std::vector<double> v{moe.assignments, moe.dropped, moe.imbalance, moe.forwards, moe.aux_loss, moe.z_loss};
      at_.world->all_reduce(v, comm::Reduce::sum);
      moe = {v[0], v[1], v[2], v[3], v[4], v[5], moe.a2a_seconds};
    }
    return moe;
  }

  //! Rows [row0, row0 + micro_) of the global batch of `step`, for micro-batch i of this rank.
  std::int64_t row0(int i) const { return std::int64_t(at_.dp_rank) * rows_ + std::int64_t(i) * micro_; }

  //! Without a pipeline: each micro-batch forward and backward in turn; the last backward averages the gradients
  //! over data parallelism, bucket by bucket, as they complete.
  double run_micro_batches(int step) {
    Model& m = *this->parts.front();
    auto& in = in_.front();
    auto& tg = tg_.front();
    in.resize(std::size_t(micro_) * cfg_.seq);
    tg.resize(in.size());
    double loss = 0;
    const int mbs = cfg_.micro_batches;
    for (int i = 0; i < mbs; ++i) {
      data_.fill(step, row0(i), micro_, in.data(), tg.data());
      const typename Model::MicroBatch mb{in.data(), tg.data(), micro_, cfg_.seq, static_cast<std::uint64_t>(step),
                                          row0(i)};
      if constexpr (Zero > 0) loss += zero_.front()->forward(0, mb) / mbs;  // ZeRO-3 gathers each unit
      else loss += m.forward(0, mb) / mbs;
      if (i + 1 < mbs) {
        if constexpr (Zero >= 2) {  // the micro-batches' gradients accumulate in every bucket
          if (i == 0) zero_.front()->hold_all();
          zero_.front()->accumulate(0, 1.0 / mbs);
        } else {
          m.backward(0, 1.0 / mbs);
        }
      } else if constexpr (Zero > 0) {
        zero_.front()->backward(0, 1.0 / mbs);
      } else {
        ddp_->backward(0, 1.0 / mbs);
      }
    }
    return loss;
  }

  //! With a pipeline: the schedule's table over every micro-batch; each part's gradients are averaged over data
  //! parallelism as soon as its last backward is done, while this stage (and the others) compute on; then the tied
  //! table's sum over its two holders (both are sums over other ranks, so their order does not matter).
  double run_pipeline(int step) {
    auto& parts = this->parts;
    // Data only where it is needed: token ids for the embedding, targets for the loss.
    const bool needs_data =
        std::any_of(parts.begin(), parts.end(), [](auto& p) { return p->embedding() || p->head(); });
    for (int i = 0; needs_data && i < cfg_.micro_batches; ++i) {
      auto& in = in_[std::size_t(i)];
      auto& tg = tg_[std::size_t(i)];
      in.resize(std::size_t(micro_) * cfg_.seq);
      tg.resize(in.size());
      data_.fill(step, row0(i), micro_, in.data(), tg.data());
    }
    auto& dp = *at_.dp;
    if constexpr (Zero >= 2)  // every bucket is written before the parts are reduce-scattered
      for (auto& z : zero_) z->hold_all();
    if constexpr (Zero >= 3)  // KeepGathered: every part gathered for the whole schedule
      for (auto& z : zero_) z->gather_units();
    // Each part's average over data parallelism starts on Comm as soon as its last backward is done; the executor's
    // graph waits for it before returning.
    const double loss = exec_->run(
        table_,
        [&](int i) {
          const auto u = std::size_t(i);
          return typename Model::MicroBatch{needs_data ? in_[u].data() : nullptr, needs_data ? tg_[u].data() : nullptr,
                                            micro_, cfg_.seq, static_cast<std::uint64_t>(step), row0(i)};
        },
        [&](int chunk) {
          const auto& p = *parts[std::size_t(chunk)];
          return dp.size() > 1 && Zero == 0
                     ? average_.start(AverageGroups<Comm>{&dp, at_.edp, at_.ep_size}, p.specs(), p.grads().span())
                     : comm::Handles();
        });
    average_.finish();
    reduce_tied();
    // Under ZeRO the tied table's two holders sum their gradients first: their shards do not line up.
    if constexpr (Zero > 0)
      for (auto& z : zero_) z->reduce_all(), z->release_units();
    return loss;
  }

  //! Sums the tied table's gradient over its two holders: two chunks of one stage, or the first and last stages.
  void reduce_tied() {
    std::vector<std::span<T>> held;
    for (auto& p : this->parts)
      if (auto g = p->tied_grad(); !g.empty()) held.push_back(g);
    if (held.empty()) return;
    if (!at_.tied) {  // both uses on this stage (a one-stage pipeline holds one part)
      if (held.size() == 2) {
        for (std::size_t i = 0; i < held[0].size(); ++i) held[0][i] += held[1][i];
        std::copy(held[0].begin(), held[0].end(), held[1].begin());
      }
      return;
    }
    at_.tied->all_reduce(held[0], comm::Reduce::sum);
  }

  RankInLayout<Comm, Pipelined, Zero> at_;
  const Batches& data_;
  StepConfig cfg_;
  int rows_ = 0, micro_ = 0;
  pipeline::RuntimeTable table_;
  std::unique_ptr<pipeline::Executor<Model, Comm>> exec_;
  std::unique_ptr<DataParallel<Model, Comm>> ddp_;
  std::vector<std::unique_ptr<ShardedDataParallel<Model, Comm>>> zero_;  //!< per part, under ZeRO
  GradientAverage<T, typename Model::device> average_;  //!< each part's, after the schedule's last backward of it
  std::vector<std::vector<std::int32_t>> in_, tg_;
};

}  // namespace detail

//! A trainer whatever its layout: built from a rank's RankInLayout (or, through Trainer<Cfg, ...>, from its context),
//! for code that runs and checkpoints a training without depending on the layout's type, and so is compiled once for
//! a model, optimizer and backend, not once per layout.
template <class Model, class Optimizer>
class TrainerOf {
 public:
  //! What the trainer builds and steps (part_of_t): for models::Gpt<S, ...>, the shape-free models::GptModel.
  using Part = part_of_t<Model>;
  static_assert(TrainableModel<Part>, "loom: the model does not have what the trainer needs (train::TrainableModel)");
  static_assert(TrainerOptimizer<Optimizer, Part>,
                "loom: the optimizer does not step the model's parameters (opt.step(params, grads, lr))");
  using T = typename Part::value_type;
  using acc = loom::acc_t<T>;

  //! Builds this rank's model parts (from options.seed: the same whole model on every layout) and, with
  //! make_optimizer(specs, numel), one optimizer per part. Checks what the type cannot: that the global batch
  //! splits over data parallelism and micro-batches, that the micro-batch count fits the schedule, that the layers
  //! split over the virtual stages. For a model whose type fixes its shape (models::Gpt<S, ...>).
  template <class Comm, bool Pipelined, int Zero, class MakeOptimizer>
    requires requires { Model::static_shape; }
  TrainerOf(const RankInLayout<Comm, Pipelined, Zero>& at, const Batches& data, const TrainerOptions& options,
            MakeOptimizer&& make_optimizer)
      : TrainerOf(Model::static_shape, at, data, options, std::forward<MakeOptimizer>(make_optimizer), 0) {}
  //! The same for a model of shape `shape` (models::GptModel), built as Model(shape, seed, tp, part, options).
  template <class Comm, bool Pipelined, int Zero, class MakeOptimizer>
    requires(!requires { Model::static_shape; })
  TrainerOf(const models::GptShape& shape, const RankInLayout<Comm, Pipelined, Zero>& at, const Batches& data,
            const TrainerOptions& options, MakeOptimizer&& make_optimizer)
      : TrainerOf(shape, at, data, options, std::forward<MakeOptimizer>(make_optimizer), 0) {}

  //! Optimizer step `step` (it keys the batch and dropout): forward and backward of every micro-batch, gradients
  //! averaged and clipped, the update; or, when the loss or gradient norm is not finite on some rank, no update on
  //! any rank.
  StepResult step(int step) { return core_->step(step); }

  //! This rank's model parts: one without pipeline parallelism, the stage's chunks with it.
  const std::vector<std::unique_ptr<Part>>& parts() const { return core_->parts; }
  //! The model's shape.
  const models::GptShape& shape() const { return core_->parts.front()->shape(); }
  //! The model, where this rank holds one part.
  Part& model() {
    LOOM_CHECK(core_->parts.size() == 1, "model(): this rank holds ", core_->parts.size(), " parts (parts())");
    return *core_->parts.front();
  }
  const std::vector<Optimizer>& optimizers() const { return core_->optimizers; }
  std::vector<Optimizer>& optimizers() { return core_->optimizers; }
  //! Whether the layout has pipeline parallelism (the model is in parts over stages).
  bool pipelined() const { return pipelined_; }
  //! The layout's ZeRO stage: above 0, each optimizer holds this rank's shard of its part (ShardPlan).
  int zero_stage() const { return zero_; }
  //! Part c's parameters in host memory, laid out as its flat buffer. Under ZeRO-3 a rank holds its chunks alone
  //! between steps: they are gathered from every rank (a collective over data parallelism); else a copy.
  std::vector<T> params_of_part(std::size_t c) { return core_->params_of(c); }
  //! Optimizer state of part c (a buffer of optimizers()[c].state()), laid out as the part's flat parameters: under
  //! ZeRO every data-parallel rank's shard, gathered (a collective over data parallelism), else a copy.
  std::vector<acc> state_of_part(std::size_t c, const acc* state) { return core_->gather_state(c, state); }
  //! Sets optimizer state of part c from a buffer laid out as the part's flat parameters (this rank's shard of it
  //! under ZeRO).
  void set_state_of_part(std::size_t c, const acc* whole, acc* state) const { core_->take_state(c, whole, state); }
  //! What this rank holds of part c and writes of it to a sharded checkpoint (no communication).
  Holding holding(std::size_t c) const { return core_->holding(c); }
  //! This rank in the world, the world's size, and a barrier over it.
  int world_rank() const { return core_->world_rank(); }
  int world_size() const { return core_->world_size(); }
  void barrier() { core_->barrier(); }

  //! A buffer laid out as the whole model's parameters, put together from every stage's parts: gather(c) gives part
  //! c's (zero where it holds nothing); the tied table is taken from the part with the embedding. A collective over
  //! the pipeline group (and, through gather, the tensor-parallel group).
  template <class U, class Gather>
  std::vector<U> assemble(Gather&& gather) {
    const auto& parts = core_->parts;
    if (!pipelined_) return gather(0);
    std::vector<U> whole(static_cast<std::size_t>(shape().params()), U(0));
    const auto global = parts.front()->param_specs(0, true);
    for (std::size_t c = 0; c < parts.size(); ++c) {
      const auto g = gather(c);
      for (const auto& s : parts[c]->specs()) {
        if (s.index == 0 && !parts[c]->embedding()) continue;  // the tied table's second holder
        const auto& at = global[s.index];
        std::copy_n(g.begin() + at.offset, numel_of(at.shape), whole.begin() + at.offset);
      }
    }
    if constexpr (std::is_same_v<U, T>) core_->sum_over_pipeline(std::span<U>(whole));
    else core_->sum_state_over_pipeline(std::span<U>(whole));
    return whole;
  }

 private:
  template <class Comm, bool Pipelined, int Zero, class MakeOptimizer>
  TrainerOf(const models::GptShape& shape, const RankInLayout<Comm, Pipelined, Zero>& at, const Batches& data,
            const TrainerOptions& options, MakeOptimizer&& make_optimizer, int)
      : pipelined_(Pipelined), zero_(Zero) {
    static_assert(Zero == 0 || kernels::is_host_v<typename Part::device>,
                  "loom: DP<n, ZeRO<k>> trains on the host for now (its CUDA path has not run on a GPU)");
    static_assert(Zero < 3 || UnitModel<Part>,
                  "loom: DP<n, ZeRO<3>> needs a model that runs in units (train::UnitModel: param_units, "
                  "forward_units, forward_unit, ...)");
    constexpr int tp = Part::config::template size<Axis::tp>;
    LOOM_CHECK(at.tp->size() == tp, "the model is split over ", tp, " tensor-parallel ranks but the layout's "
               "tensor-parallel group has ", at.tp->size());
    // Under ZeRO-3 over several ranks each rank writes only its shard of the parameters (TrainerCore).
    models::GptOptions model = options.model;
    if constexpr (Zero >= 3) model.write_buffers = (at.shard ? at.shard : at.dp)->size() == 1;
    constexpr int cp = Part::config::template size<Axis::cp>;
    LOOM_CHECK(cp == 1 || at.cp, "the model is split over ", cp, " context-parallel ranks but the rank was given no "
               "context-parallel group (RankInLayout::cp)");
    LOOM_CHECK(at.ep_size == 1 || (at.ep && at.edp && at.ep->size() == at.ep_size), "the layout splits the experts "
               "over ", at.ep_size, " expert-parallel ranks but the rank was given ",
               at.ep ? "a group of " + std::to_string(at.ep->size()) : std::string("no expert-parallel groups"),
               " (RankInLayout::ep, edp)");
    Comm* ep = at.ep_size > 1 ? at.ep : nullptr;
    const std::function<std::unique_ptr<Part>(models::GptPart)> make_part = [&](models::GptPart part) {
      if constexpr (requires { Model::static_shape; })
        return std::unique_ptr<Part>(std::make_unique<Model>(options.seed, *at.tp, at.cp, ep, part, model));
      else
        return std::make_unique<Model>(shape, options.seed, *at.tp, at.cp, ep, part, model);
    };
    core_ = std::make_unique<detail::TrainerCore<Part, Optimizer, Comm, Pipelined, Zero>>(
        at, data, options, shape.layers, make_part, std::forward<MakeOptimizer>(make_optimizer));
  }

  std::unique_ptr<detail::TrainerBase<Part, Optimizer>> core_;
  bool pipelined_;
  int zero_;
};

namespace detail {
//! Whether Model meets every rule of layout Cfg: a model whose type fixes its shape is checked against the whole
//! layout at compile time (models::LayoutRules, its expert-parallel degree too), one of any shape when it is built.
template <class Model, class Cfg>
constexpr bool fits_layout() {
  if constexpr (requires { Model::static_shape; })
    return models::LayoutRules<Model::static_shape, Cfg, typename Model::device>::ok;
  else
    return true;
}
}  // namespace detail

//! Trains Model (models::Gpt<S, T, ModelLayout<Cfg>, Dev>) on one rank of layout Cfg with Optimizer. The layout type
//! is the whole configuration: its tensor-parallel degree and sequence parallelism are the model's, its pipeline
//! degree, schedule and chunks per stage (PP<p, Schedule, Interleaved<v>>) the step's; what it does not say (the
//! global batch, micro-batches, learning rate, an explicit layer split) is in TrainerOptions, checked once, here.
//! Only its construction depends on the layout: it is a TrainerOf<Model, Optimizer> built from rank_in_layout(ctx).
template <class Cfg, class Model, class Optimizer>
class Trainer : public TrainerOf<Model, Optimizer> {
  static_assert(ParallelLayout<Cfg>, "loom: a trainer's layout must be a loom::Parallel<...>");
  static_assert(std::is_same_v<typename Model::config, models::ModelLayout<Cfg>>,
                "loom: the model's layout must be ModelLayout<Cfg>: its tensor-parallel degree and sequence "
                "parallelism are the trainer's layout's");
  static_assert(models::DeviceRules<typename Model::device, Cfg>::ok);
  static_assert(detail::fits_layout<Model, Cfg>());

 public:
  static constexpr int stages = Cfg::template size<Axis::pp>;
  static constexpr bool pipelined = stages > 1;
  static constexpr Schedule schedule = Cfg::schedule;
  static constexpr int chunks = pipelined ? pipeline::chunks_per_stage(Cfg::schedule, Cfg::virtual_stages) : 1;

  template <class Backend, class MakeOptimizer>
  Trainer(Context<Cfg, Backend>& ctx, const Batches& data, const TrainerOptions& options,
          MakeOptimizer&& make_optimizer)
      : TrainerOf<Model, Optimizer>(rank_in_layout(ctx), data, options, std::forward<MakeOptimizer>(make_optimizer)) {}
};

}  // namespace loom::train

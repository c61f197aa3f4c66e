// One optimizer step on a rank, for every layout: how a step is made (StepConfig, TrainerOptions), what it did
// (StepResult), the layers' split over pipeline parts, what a rank holds of a part (Holding: what checkpoints read),
// and the step itself (detail::TrainerCore): micro-batches or a pipeline schedule, gradients averaged over data
// parallelism (DDP or ZeRO), the tied table's sum, the loss and the global norm, a non-finite step skipped on every
// rank, clipping and every part's optimizer step.
#pragma once

#include <loom/comm/types.hpp>
#include <loom/layers/moe.hpp>
#include <loom/models/part.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/pipeline/executor.hpp>
#include <loom/train/any_part.hpp>
#include <loom/train/concepts.hpp>
#include <loom/train/data.hpp>
#include <loom/train/data_parallel.hpp>
#include <loom/train/rank_in_layout.hpp>
#include <loom/train/zero.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace loom::train {

//! How one optimizer step is made: global batch, micro-batches, clipping, the learning rate.
struct StepConfig {
  int batch = 16;          //!< sequences per step, over the whole data-parallel group
  int seq = 64;            //!< tokens per sequence
  int micro_batches = 1;   //!< per rank: gradient accumulation
  double lr = 3e-3;        //!< without a schedule: the rate after a linear warm-up of `warmup` steps
  int warmup = 0;
  //! The learning rate of each step (optim::LrSchedule, or any function of the step: a run resumed at step s
  //! continues on it); empty: lr after the warm-up.
  std::function<double(int)> schedule;
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

//! What the layout type does not say: how the model starts (its seed, and ModelOptions, the model's own Options:
//! for models::Gpt recompute, dropout, the norms' epsilon), how a step is made, and an explicit layer split.
template <class ModelOptions>
struct TrainerOptions {
  std::uint64_t seed = 0;  //!< initialises the model: the same whole model on every layout
  ModelOptions model{};    //!< how each part is built
  StepConfig step;         //!< global batch, sequence length, micro-batches, lr, warmup, clipping, buckets
  std::vector<int> split;  //!< blocks per virtual pipeline stage, in pipeline order; empty: an even split
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
  //! The loss of global batch `batch` of `data` (the mean over its sequences, on every rank), the model unchanged:
  //! without a pipeline the step's forwards alone; with one the schedule's forwards and backwards (its table pairs
  //! them) without the update, their gradients dropped.
  virtual double evaluate(const DataSource& data, std::int64_t batch) = 0;
  //! The world's size and this rank's place in it; a barrier over the world.
  virtual int world_rank() const = 0;
  virtual int world_size() const = 0;
  virtual void barrier() = 0;
  std::vector<std::unique_ptr<Model>> parts;
  std::vector<Optimizer> optimizers;
};

//! How the step builds a rank's model parts: part `part` of the model behind AnyPart (TrainerOf wraps its own).
template <class T, class Dev>
using PartFactory = std::function<std::unique_ptr<AnyPart<T, Dev>>(models::Part)>;
//! How the step builds each part's optimizer: over the part's parameter table without ZeRO (`whole`), over the
//! rank's shard of it under ZeRO (`shard`, ShardPlan::slices).
template <class Optimizer>
struct OptimizerFactory {
  std::function<Optimizer(const std::vector<layers::ParamSpec>&, std::int64_t)> whole;
  std::function<Optimizer(const std::vector<optim::Slice>&, std::int64_t)> shard;
};
//! What the step reads of TrainerOptions: the seed (ZeRO-3 initialises its shard from it), the step, a layer split.
struct CoreOptions {
  std::uint64_t seed = 0;
  StepConfig step;
  std::vector<int> split;
};

//! The step, for an element type, device, optimizer and communicator type, with or without a pipeline, and a ZeRO
//! stage: over AnyPart, so that it is compiled once for every model (loom::cpu_kernels holds the host's, CoreOf).
template <class T, class Dev, class Optimizer, class Comm, bool Pipelined, int Zero>
class TrainerCore final : public TrainerBase<AnyPart<T, Dev>, Optimizer> {
  using Model = AnyPart<T, Dev>;
  using Base = TrainerBase<Model, Optimizer>;
  //! The stage's type (ZeRO-1 where there is none: its list of parts stays empty).
  using Sharded = ShardedDataParallel<Model, Comm, (Zero > 0 ? Zero : 1)>;
  using acc = typename Base::acc;

 public:
  TrainerCore(const RankInLayout<Comm, Pipelined, Zero>& at, const DataSource& data, const CoreOptions& o, int layers,
              const PartFactory<T, Dev>& make_part, const OptimizerFactory<Optimizer>& make_optimizer)
      : at_(at), data_(&data), cfg_(o.step), average_(at.reduce_in_storage) {
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
      const models::Part part{bounds[std::size_t(k)], bounds[std::size_t(k) + 1]};
      {  // what ZeRO accounts for itself is made uncounted
        const int shard = at.shard ? at.shard->size() : at.dp->size();
        const UncountedMemoryScope uncounted(Zero > 0 ? Sharded::uncounted_uses(shard) : std::vector<MemoryUse>{});
        this->parts.push_back(make_part(part));
      }
      Model& m = *this->parts.back();
      if constexpr (Zero > 0) {  // the optimizer holds this rank's shard (the tied table counts on the embedding's)
        zero_.push_back(std::make_unique<Sharded>(
            m, at.shard ? *at.shard : *at.dp, cfg.bucket_bytes, cfg.overlap, Pipelined && !m.embedding(),
            at.keep_gathered, at.replicas, at.reduce_in_storage, at.edp, at.ep_size));
        if constexpr (Zero >= 3)
          if (!m.options().write_buffers)  // ZeRO-3: the model was built unwritten; the rank initialises its shard
            for (const auto& p : zero_.back()->plan().pieces) m.initialise(o.seed, p.own_lo, p.own_hi);
        this->optimizers.push_back(make_optimizer.shard(zero_.back()->plan().slices, zero_.back()->plan().numel));
      } else {
        this->optimizers.push_back(make_optimizer.whole(m.specs(), m.params().numel()));
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
    const std::vector<double> l{forward_backward(step)};
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
    const double lr = cfg_.schedule ? cfg_.schedule(step) : optim::warmup_lr(cfg_.lr, step, cfg_.warmup);
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

  double evaluate(const DataSource& data, std::int64_t batch) override {
    const DataSource* training = std::exchange(data_, &data);
    double loss = 0;
    try {
      loss = Pipelined ? pipeline_forward_only(batch) : forward_only(batch);
    } catch (...) {
      data_ = training;
      throw;
    }
    data_ = training;
    routed();  // what the experts routed here is not the next step's
    return loss;
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
    if constexpr (Zero > 0) {
      return zero_[c]->gather_shard(shard);
    } else {
      std::vector<acc> out(static_cast<std::size_t>(this->parts[c]->params().numel()));
      this->parts[c]->ops().to_host(shard, out.data(), out.size());
      return out;
    }
  }
  void take_state(std::size_t c, const acc* whole, acc* shard) const override {
    if constexpr (Zero > 0) zero_[c]->take_shard(whole, shard);
    else this->parts[c]->ops().from_host(whole, shard, static_cast<std::size_t>(this->parts[c]->params().numel()));
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
    } else {  // replicated over data parallelism (an expert's over the expert-data-parallel group): even shares
      h.state.push_back({0, n, 0});
      h.params = h.state;
      auto share = [&](const Comm& group, std::int64_t first, std::int64_t last) {
        const std::int64_t d = group.size(), r = group.rank(), len = last - first;
        const std::int64_t lo = first + len * r / d, hi = first + len * (r + 1) / d;
        if (lo < hi) h.written.push_back({lo, hi, lo});
      };
      if (at_.ep_size == 1) {
        share(*at_.dp, 0, n);
      } else {
        for (const auto& s : this->parts[c]->specs())
          share(s.expert ? *at_.edp : *at_.dp, s.offset, s.offset + numel_of(s.shape));
      }
    }
    return h;
  }
  int world_rank() const override { return at_.world->rank(); }
  int world_size() const override { return at_.world->size(); }
  void barrier() override { at_.world->barrier(); }

 private:
  //! What the parts' mixtures of experts routed in this step, summed over every rank (a collective over the world
  //! when the model has experts); the time in all-to-alls is this rank's own.
  layers::MoeStats routed() {
    layers::MoeStats moe;
    if (!this->parts.front()->has_experts()) return moe;
    for (auto& p : this->parts) moe += p->take_moe_stats();
    std::vector<double> v{moe.assignments, moe.dropped, moe.imbalance, moe.forwards, moe.aux_loss, moe.z_loss};
    at_.world->all_reduce(v, comm::Reduce::sum);
    return {v[0], v[1], v[2], v[3], v[4], v[5], moe.a2a_seconds};
  }

  //! Every part's gradients zeroed, the forward and backward of global batch `step` of data_, and its loss: on the
  //! last stage, summed over the pipeline, averaged over data parallelism (and context parallelism: each cp rank's is
  //! the mean over its share of the sequences).
  double forward_backward(std::int64_t step) {
    for (std::size_t c = 0; c < this->parts.size(); ++c) {
      if constexpr (Zero > 0) zero_[c]->zero_grad();  // under ZeRO-2, what the rank holds
      else this->parts[c]->zero_grad();
    }
    std::vector<double> l{Pipelined ? run_pipeline(step) : run_micro_batches(step)};
    if constexpr (Pipelined) at_.pp->all_reduce(l, comm::Reduce::sum);
    at_.dp->all_reduce(l, comm::Reduce::avg);
    return l[0];
  }

  //! The loss of the global batch of `step` without a pipeline: each micro-batch's forward alone (the same forward,
  //! and so the same loss, as a step's), averaged over data parallelism; the gradients untouched.
  double forward_only(std::int64_t step) {
    std::vector<double> l{0};
    const int mbs = cfg_.micro_batches;
    for (int i = 0; i < mbs; ++i) l[0] += forward_micro_batch(step, i, false) / mbs;
    if constexpr (Zero >= 3) zero_.front()->release_units();  // KeepGathered kept them for a backward
    at_.dp->all_reduce(l, comm::Reduce::avg);
    return l[0];
  }

  //! The loss of the global batch of `step` through the pipeline by forward alone (Executor::forward_only), summed
  //! over the pipeline and averaged over data parallelism; the gradients untouched.
  double pipeline_forward_only(std::int64_t step) {
    std::vector<double> l{0};
    if constexpr (Pipelined) {
      fill_micro_batches(step);
      if constexpr (Zero >= 3)  // every part gathered for the forwards
        for (auto& z : zero_) z->gather_units();
      l[0] = exec_->forward_only(table_, [&](int i) { return micro_batch(step, i); });
      if constexpr (Zero >= 3)
        for (auto& z : zero_) z->release_units();
      at_.pp->all_reduce(l, comm::Reduce::sum);
    }
    at_.dp->all_reduce(l, comm::Reduce::avg);
    return l[0];
  }

  //! Rows [row0, row0 + micro_) of the global batch of `step`, for micro-batch i of this rank.
  std::int64_t row0(int i) const { return std::int64_t(at_.dp_rank) * rows_ + std::int64_t(i) * micro_; }

  //! Without a pipeline: micro-batch i of this rank's rows of the global batch of `step` read and run forward in
  //! activation slot 0 (through ZeRO where there is: ZeRO-3 gathers each unit); its loss. `backward`: whether a
  //! backward of it follows (MicroBatch::backward).
  double forward_micro_batch(std::int64_t step, int i, bool backward = true) {
    auto& in = in_.front();
    auto& tg = tg_.front();
    in.resize(std::size_t(micro_) * cfg_.seq);
    tg.resize(in.size());
    data_->fill(step, row0(i), micro_, in.data(), tg.data());
    const typename Model::MicroBatch mb{in.data(), tg.data(), micro_, cfg_.seq, static_cast<std::uint64_t>(step),
                                        row0(i), backward};
    if constexpr (Zero > 0) return zero_.front()->forward(0, mb);
    else return this->parts.front()->forward(0, mb, nullptr);
  }

  //! Without a pipeline: each micro-batch forward and backward in turn; the last backward averages the gradients
  //! over data parallelism, bucket by bucket, as they complete.
  double run_micro_batches(std::int64_t step) {
    Model& m = *this->parts.front();
    double loss = 0;
    const int mbs = cfg_.micro_batches;
    for (int i = 0; i < mbs; ++i) {
      loss += forward_micro_batch(step, i) / mbs;
      if (i + 1 < mbs) {
        if constexpr (Zero >= 2) {  // the micro-batches' gradients accumulate in every bucket
          if (i == 0) zero_.front()->hold_all();
          zero_.front()->accumulate(0, 1.0 / mbs);
        } else {
          m.backward(0, 1.0 / mbs, nullptr);
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
  double run_pipeline(std::int64_t step) {
    auto& parts = this->parts;
    fill_micro_batches(step);
    auto& dp = *at_.dp;
    if constexpr (Zero >= 2)  // every bucket is written before the parts are reduce-scattered
      for (auto& z : zero_) z->hold_all();
    if constexpr (Zero >= 3)  // KeepGathered: every part gathered for the whole schedule
      for (auto& z : zero_) z->gather_units();
    // Each part's average over data parallelism starts on Comm as soon as its last backward is done; the executor's
    // graph waits for it before returning.
    if (dp.size() > 1 && Zero == 0) {
      std::size_t n = 0;
      for (auto& p : parts) n += static_cast<std::size_t>(p->grads().numel());
      average_.reserve(n);
    }
    const double loss = exec_->run(
        table_,
        [&](int i) { return micro_batch(step, i); },
        [&](int chunk) {
          const auto& p = *parts[std::size_t(chunk)];
          return dp.size() > 1 && Zero == 0
                     ? average_.start(AverageGroups<Comm>{&dp, at_.edp, at_.ep_size}, p.specs(), p.grads().span(),
                                      p.ops())
                     : comm::Handles();
        });
    average_.finish();
    reduce_tied();
    // Under ZeRO the tied table's two holders sum their gradients first: their shards do not line up.
    if constexpr (Zero > 0)
      for (auto& z : zero_) {
        z->reduce_all();
        if constexpr (Zero >= 3) z->release_units();
      }
    return loss;
  }

  //! Whether this rank's parts read data: token ids for the embedding, targets for the loss.
  bool needs_data() const {
    return std::any_of(this->parts.begin(), this->parts.end(), [](auto& p) { return p->embedding() || p->head(); });
  }
  //! With a pipeline: every micro-batch of this rank's rows of the global batch of `step` read, where needed.
  void fill_micro_batches(std::int64_t step) {
    for (int i = 0; needs_data() && i < cfg_.micro_batches; ++i) {
      auto& in = in_[std::size_t(i)];
      auto& tg = tg_[std::size_t(i)];
      in.resize(std::size_t(micro_) * cfg_.seq);
      tg.resize(in.size());
      data_->fill(step, row0(i), micro_, in.data(), tg.data());
    }
  }
  //! With a pipeline: micro-batch i of fill_micro_batches(step).
  typename Model::MicroBatch micro_batch(std::int64_t step, int i) const {
    const auto u = std::size_t(i);
    const bool data = needs_data();
    return typename Model::MicroBatch{data ? in_[u].data() : nullptr, data ? tg_[u].data() : nullptr, micro_,
                                      cfg_.seq, static_cast<std::uint64_t>(step), row0(i)};
  }

  //! Sums the tied table's gradient over its two holders: two chunks of one stage, or the first and last stages.
  void reduce_tied() {
    std::vector<std::span<T>> held;
    for (auto& p : this->parts)
      if (auto g = p->tied_grad(); !g.empty()) held.push_back(g);
    if (held.empty()) return;
    const auto& ops = this->parts.front()->ops();
    if (!at_.tied) {  // both uses on this stage (a one-stage pipeline holds one part)
      if (held.size() == 2) {
        ops.accumulate(held[1].data(), held[0].data(), held[0].size());
        ops.copy(held[0].data(), held[1].data(), held[0].size());
      }
      return;
    }
    ops.synchronize();  // on a device: backward's kernels are done before the collective reads
    at_.tied->all_reduce(held[0], comm::Reduce::sum);
  }

  RankInLayout<Comm, Pipelined, Zero> at_;
  const DataSource* data_;  //!< the training data, or what evaluate() reads
  StepConfig cfg_;
  int rows_ = 0, micro_ = 0;
  pipeline::RuntimeTable table_;
  std::unique_ptr<pipeline::Executor<Model, Comm>> exec_;
  std::unique_ptr<DataParallel<Model, Comm>> ddp_;
  std::vector<std::unique_ptr<Sharded>> zero_;  //!< per part, under ZeRO
  GradientAverage<T, Dev> average_;  //!< each part's, after the schedule's last backward of it
  std::vector<std::vector<std::int32_t>> in_, tg_;
};

//! Builds the step for a rank (TrainerCore): a function defined apart from its class, so that a program built with
//! LOOM_EXTERN_KERNELS takes the host's steps over comm::AnyComm from loom::cpu_kernels (LOOM_TRAINER_CORES) and
//! compiles no step of its own.
template <class T, class Dev, class Optimizer, class Comm, bool Pipelined, int Zero>
struct CoreOf {
  static std::unique_ptr<TrainerBase<AnyPart<T, Dev>, Optimizer>> make(
      const RankInLayout<Comm, Pipelined, Zero>& at, const DataSource& data, const CoreOptions& o, int layers,
      const PartFactory<T, Dev>& make_part, const OptimizerFactory<Optimizer>& make_optimizer);
};
template <class T, class Dev, class Optimizer, class Comm, bool Pipelined, int Zero>
std::unique_ptr<TrainerBase<AnyPart<T, Dev>, Optimizer>> CoreOf<T, Dev, Optimizer, Comm, Pipelined, Zero>::make(
    const RankInLayout<Comm, Pipelined, Zero>& at, const DataSource& data, const CoreOptions& o, int layers,
    const PartFactory<T, Dev>& make_part, const OptimizerFactory<Optimizer>& make_optimizer) {
  return std::make_unique<TrainerCore<T, Dev, Optimizer, Comm, Pipelined, Zero>>(at, data, o, layers, make_part,
                                                                                 make_optimizer);
}

}  // namespace detail

}  // namespace loom::train

// The host's steps that loom::cpu_kernels compiles (src/trainer_*.cpp): element type T, optimizer optim::OPT<T, Host>,
// over comm::AnyComm (every trainer's communicators: TrainerOf wraps others), with and without a pipeline, under every
// ZeRO stage. SPEC is `extern` where they are declared, empty where they are instantiated.
#define LOOM_TRAINER_CORES_OF(SPEC, T, OPT, PIPELINED)                                                              \
  SPEC template struct ::loom::train::detail::CoreOf<T, ::loom::Host, ::loom::optim::OPT<T, ::loom::Host>,         \
                                                     ::loom::comm::AnyComm, PIPELINED, 0>;                          \
  SPEC template struct ::loom::train::detail::CoreOf<T, ::loom::Host, ::loom::optim::OPT<T, ::loom::Host>,         \
                                                     ::loom::comm::AnyComm, PIPELINED, 1>;                          \
  SPEC template struct ::loom::train::detail::CoreOf<T, ::loom::Host, ::loom::optim::OPT<T, ::loom::Host>,         \
                                                     ::loom::comm::AnyComm, PIPELINED, 2>;                          \
  SPEC template struct ::loom::train::detail::CoreOf<T, ::loom::Host, ::loom::optim::OPT<T, ::loom::Host>,         \
                                                     ::loom::comm::AnyComm, PIPELINED, 3>;
#define LOOM_TRAINER_CORES(SPEC, T, PIPELINED)     \
  LOOM_TRAINER_CORES_OF(SPEC, T, AdamW, PIPELINED) \
  LOOM_TRAINER_CORES_OF(SPEC, T, Sgd, PIPELINED)

#ifdef LOOM_EXTERN_KERNELS
LOOM_TRAINER_CORES(extern, float, false)
LOOM_TRAINER_CORES(extern, float, true)
LOOM_TRAINER_CORES(extern, double, false)
LOOM_TRAINER_CORES(extern, double, true)
#endif

// Sharded data parallelism, ZeRO stage 1 (the distributed optimizer): every data-parallel rank holds the whole
// model and its gradients, but the optimizer state of only one N-th of them. A model part's flat gradient buffer is
// split into the same buckets plain data parallelism uses; each bucket is split into N chunks of ceil(L / N)
// elements (the last may be short, or empty), and rank r owns chunk r of every bucket. Each bucket is
// reduce-scattered (averaged) as soon as backward completes it, so that rank r receives the average of its chunks,
// which it puts back in place in the gradient buffer; the global norm, clipping and the optimizer step act on those
// chunks alone; then every bucket's parameters are all-gathered from their owners. Per step each rank sends
// (N - 1) / N of the gradients and (N - 1) / N of the parameters: as much as plain data parallelism's all-reduce.
//
// ZeRO stage 2 shards the gradients as well: once a bucket is reduce-scattered a rank keeps only its chunk of it.
// The rest of the bucket's gradient storage is released (the ledger credits it; on the host its whole pages are
// offered back to the system, madvise(MADV_FREE); so from the start, before the first step) and taken again, and
// zeroed, when the next backward first writes the bucket: with one micro-batch, chunk by chunk as backward reaches
// it, so that the buckets already reduced are not held while the rest is computed; with several, when the first
// micro-batch's backward starts, since gradients accumulate over the step's micro-batches and are reduce-scattered
// once. The gradient buffer is made whole and uncounted (UncountedMemoryScope); this class charges the ledger for
// what the rank holds of it (on the host: the ledger counts host memory, and a device's tensors are not in it).
//
// ZeRO stage 3 shards the parameters as well (ShardedParameters). Its buckets are the model's units (the embedding,
// each block, the final norm), each gathered before the forward unit or backward chunk that reads it and released
// after the last that does; the next unit's all-gather runs on the Comm resource while the current unit computes
// (one exec::Graph per forward and per backward: gathers and reduce-scatters are issued on Comm in one order, the
// same on every rank). With KeepGathered a unit stays gathered from its forward to the step's last backward. After
// the optimizer step a rank holds its chunks alone: nothing is all-gathered until the next forward.
//
// Every stage reduces bf16 gradients in fp32 (from a copy widened on the gradients' device, rounded back into the
// rank's chunk), or in bf16 with ReduceIn<bf16>; HybridShard<s> shards over a group of s ranks and averages each
// reduced shard over the ranks that hold it in the other groups.
#pragma once

#include <loom/comm/communicator.hpp>
#include <loom/core/memory.hpp>
#include <loom/exec/graph.hpp>
#include <loom/exec/pipeline.hpp>
#include <loom/layers/param.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/any_part.hpp>
#include <loom/train/data_parallel.hpp>
#include <loom/train/shard_plan.hpp>
#include <loom/train/sharded_params.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace loom::train {

//! A model part's units (UnitModel::param_units) as buckets, the last first (the order backward completes them):
//! what ZeRO-3 gathers, releases and reduce-scatters. A unit that holds experts is two buckets, the experts' (sharded
//! over the expert-data-parallel group) and the others'. Empty for a model that does not run in units.
template <class Model>
std::vector<Bucket> unit_buckets_of(const Model& m) {
  std::vector<Bucket> out;
  if constexpr (UnitModel<Model>) {
    const auto units = m.param_units();
    const auto& specs = m.specs();
    for (auto r = units.rbegin(); r != units.rend(); ++r) {
      std::size_t end = r->last;
      for (std::size_t i = r->last; i-- > r->first;) {
        if (i > r->first && specs[i - 1].expert == specs[i].expert) continue;
        const auto& last = specs[end - 1];
        out.push_back({i, end, specs[i].offset, last.offset + numel_of(last.shape), specs[i].expert});
        end = i;
      }
    }
  }
  return out;
}

namespace detail {

//! What every ZeRO stage does for one model part, and ZeRO-1 and ZeRO-2 whole: the reduce-scatter of its buckets
//! (overlapped with the last backward, or after a pipeline's schedule), the rank's chunks' part of the global norm,
//! their clipping, and the all-gather of the updated parameters; with `shard_grads` (ZeRO-2 over several ranks) the
//! release of each reduced bucket but the rank's chunk. The optimizer (built over plan().slices) steps the model's
//! parameters where this rank owns them, from the averaged gradients there. What the reduce-scatter receives into
//! (the shard, and a padded bucket's copy) is a communication buffer held from the first bucket's start to the end
//! of the reduction. ShardedDataParallel<Model, Comm, Stage> is the stage's type.
template <class Model, class Comm>
class ZeroBase {
 public:
  using T = typename Model::value_type;
  using Dev = typename std::remove_cvref_t<decltype(std::declval<Model&>().params())>::device;
  using Buf = Tensor<T, Dev>;
  //! What gradients are reduced in: acc_t<T> (bf16 gradients in fp32), on every device.
  using R = loom::acc_t<T>;
  using Ops = std::remove_cvref_t<decltype(std::declval<Model&>().ops())>;

  //! ZeRO stage `stage` of `model` over the data-parallel group `comm`, in `buckets`; from stage 2 over several
  //! ranks, each bucket but the rank's chunk is released once reduced. With hybrid sharding (HybridShard<s>)
  //! `comm` is the rank's group of s and `replicas` the ranks holding the same shard in the other groups, over which
  //! each reduced shard is averaged. `in_storage`: gradients reduced in their own type even where it is narrower than
  //! acc_t (ReduceIn<bf16>). When buckets are released the model's gradient buffer was made uncounted
  //! (uncounted_uses).
  //! With expert parallelism over ep ranks the experts' buckets are sharded over edp, the expert-data-parallel
  //! group, and their averages divided by ep (AverageGroups).
  ZeroBase(Model& model, Comm& comm, int stage, std::vector<Bucket> buckets, bool overlap, bool skip_tied,
           Comm* replicas, bool in_storage, Comm* edp, int ep)
      : model_(model), comm_(comm), edp_(edp), ep_(ep), buckets_(std::move(buckets)),
        plan_(buckets_, model.specs(), comm.size(), comm.rank(), skip_tied ? tied_offset(model) : -1,
              edp ? edp->size() : comm.size(), edp ? edp->rank() : comm.rank()),
        overlap_(overlap), shard_grads_(stage >= 2 && comm.size() > 1), replicas_(replicas),
        ledger_(rank_memory_ledger()),
        held_(buckets_.size(), 1), bucket_of_(model.specs().size(), 0), widen_(!std::is_same_v<R, T> && !in_storage) {
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      for (std::size_t p = buckets_[b].first; p < buckets_[b].last; ++p) bucket_of_[p] = b;
    LOOM_CHECK(ep == 1 || (edp && !(replicas && replicas->size() > 1)), "ZeRO-", stage, " with expert parallelism "
               "over ", ep, " ranks needs the expert-data-parallel group and no hybrid sharding");
    if (shard_grads_) {  // until the first backward writes them, a rank holds the gradients of its shard alone
      std::size_t own = 0;
      for (const auto& p : plan_.pieces) own += static_cast<std::size_t>(p.own()) * sizeof(T);
      if constexpr (counted) ledger_->debit(MemoryUse::gradients, own);
      for (std::size_t b = 0; b < held_.size(); ++b) held_[b] = 0, offer(b);
    }
  }
  ~ZeroBase() {  // what the ledger was charged for the gradients (the buffer was not)
    if (!shard_grads_) return;
    std::size_t held = 0;
    for (std::size_t b = 0; b < held_.size(); ++b)
      held += static_cast<std::size_t>(plan_.pieces[b].own()) * sizeof(T) + (held_[b] ? released_bytes(b) : 0);
    if constexpr (counted) ledger_->credit(MemoryUse::gradients, held);
  }
  ZeroBase(const ZeroBase&) = delete;
  ZeroBase& operator=(const ZeroBase&) = delete;

  const ShardPlan& plan() const { return plan_; }

  //! Before a step: zeroes the gradients this rank holds (under ZeRO-2 a released bucket is zeroed when it is
  //! taken again).
  void zero_grad() {
    if (!shard_grads_) return model_.zero_grad();
    T* g = model_.grads().data();
    for (std::size_t b = 0; b < plan_.pieces.size(); ++b) {
      const auto& p = plan_.pieces[b];
      if (held_[b]) model_.ops().fill(g + p.lo, static_cast<std::size_t>(p.hi - p.lo), T(0));
      else model_.ops().fill(g + p.own_lo, static_cast<std::size_t>(p.own()), T(0));
    }
  }
  //! Under ZeRO-2, before a backward that writes every bucket (the first of several micro-batches, a pipeline's
  //! schedule): takes every released bucket back.
  void hold_all() {
    for (std::size_t b = 0; b < held_.size(); ++b) hold(b);
  }
  const std::vector<Bucket>& buckets() const { return buckets_; }

  //! Forward of micro-batch mb in activation slot `slot` (Model::forward's arguments).
  double forward(int slot, const typename Model::MicroBatch& mb, const T* input = nullptr) {
    return model_.forward(slot, mb, input);
  }
  //! Backward of a micro-batch before the step's last (activation slot `slot`): gradients accumulate, nothing is
  //! reduced.
  void accumulate(int slot, double scale) { model_.backward(slot, scale, nullptr); }

  //! Backward of the last micro-batch of a step (activation slot `slot`), each bucket reduce-scattered once
  //! complete; this rank's chunks of the gradient buffer hold the averages when it returns.
  void backward(int slot, double scale) {
    if (!overlap_ || comm_.size() == 1) {
      hold_all();
      model_.backward(slot, scale, nullptr);
      model_.ops().synchronize();
      reduce_all();
      return;
    }
    begin();
    backward_by_buckets(model_, buckets_, slot, scale, ReduceScatterBucket{this}, HoldWritten{this});
    finish();
  }

  //! Reduce-scatters every bucket of the model's gradients (after a pipeline's schedule: the whole part is done).
  void reduce_all() {
    if (comm_.size() == 1) return;  // one rank's gradients are their own average
    // The buffers the collectives write are made before the wait: on a device the wait then also covers the kernels
    // of any rank sharing the GPU that last used their blocks (the collectives do not run on the kernels' stream).
    begin();
    model_.ops().synchronize();  // on a device: backward's kernels are done before the collectives read
    comm::Handles all;
    for (std::size_t b = 0; b < plan_.pieces.size(); ++b) all.all.push_back(start(b));
    all.wait();
    finish();
  }

  //! This rank's chunks' terms of the global norm's sum of squares (each element of the whole model counted once
  //! over the data-, tensor- and pipeline-parallel groups once summed over them).
  double grad_square() const {
    const std::size_t k = plan_.norm.size();
    std::vector<std::int64_t> at(k), n(k);
    std::vector<double> sums(k);
    for (std::size_t i = 0; i < k; ++i) at[i] = plan_.norm[i].at, n[i] = plan_.norm[i].n;
    model_.ops().sums_of_squares(model_.grads().data(), at.data(), n.data(), k, sums.data());  // one wait
    double s = 0;
    for (std::size_t i = 0; i < k; ++i) s += plan_.norm[i].weight * sums[i];
    return s;
  }

  //! Scales this rank's chunks of the gradients as optim::clip_to scales whole gradients.
  void clip(double norm, double max_norm) {
    const double s = optim::clip_scale(norm, max_norm);
    if (s == 1.0) return;
    T* g = model_.grads().data();
    for (const auto& p : plan_.pieces)
      model_.ops().scale(g + p.own_lo, static_cast<std::size_t>(p.own()), static_cast<loom::acc_t<T>>(s));
  }

  //! The part's whole parameters in host memory: a copy.
  std::vector<T> whole_params() {
    const auto& w = model_.params();
    std::vector<T> out(static_cast<std::size_t>(w.numel()));
    model_.ops().to_host(w.data(), out.data(), out.size());
    return out;
  }

  //! After the optimizer updated this rank's chunks of the parameters: every bucket's parameters from its owners.
  void gather_params() {
    if (comm_.size() == 1) return;
    const auto& ops = model_.ops();
    T* params = model_.params().data();
    MemoryUseScope use(MemoryUse::communication);
    Buf own({std::max<std::int64_t>(1, max_chunk())});  // the rank's chunk, sent from a copy: it is received in place
    for (std::size_t b = 0; b < plan_.pieces.size(); ++b) {
      const auto& p = plan_.pieces[b];
      Comm& comm = comm_of(b);
      const int n = comm.size();
      const std::size_t chunk = static_cast<std::size_t>(p.chunk), len = static_cast<std::size_t>(p.hi - p.lo);
      ops.copy(params + p.own_lo, own.data(), static_cast<std::size_t>(p.own()));
      if (p.own() < p.chunk) ops.fill(own.data() + p.own(), chunk - static_cast<std::size_t>(p.own()), T(0));
      // Made before the wait: a block freed with work still queued on the stream (this rank's or another's
      // sharing the device) is done with once the wait returns, before the collective writes it.
      const Buf all = p.padded(n) ? Buf({p.chunk * n}) : Buf();
      ops.synchronize();  // on a device: the update and the copy are done before the collective reads them
      const std::span<const T> send(own.data(), chunk);
      if (p.padded(n)) {
        comm.all_gather(send, std::span<T>(all.data(), chunk * static_cast<std::size_t>(n)));
        ops.copy(all.data(), params + p.lo, len);
      } else {
        comm.all_gather(send, std::span<T>(params + p.lo, len));
      }
    }
    ops.synchronize();
  }

  //! A buffer in host memory laid out as this part's flat parameters from one on the part's device laid out as the
  //! shard (an optimizer's state): every rank's chunks, gathered. A collective over the data-parallel group.
  template <class U>
  std::vector<U> gather_shard(const U* shard) {
    std::vector<U> whole(static_cast<std::size_t>(model_.params().numel()), U(0));
    std::vector<U> own, all;
    for (std::size_t b = 0; b < plan_.pieces.size(); ++b) {
      const auto& p = plan_.pieces[b];
      Comm& comm = comm_of(b);
      own.assign(static_cast<std::size_t>(p.chunk), U(0));
      model_.ops().to_host(shard + p.at, own.data(), static_cast<std::size_t>(p.own()));
      all.resize(own.size() * static_cast<std::size_t>(comm.size()));
      comm.all_gather(own, all);
      std::copy_n(all.begin(), p.hi - p.lo, whole.begin() + p.lo);
    }
    return whole;
  }
  //! This rank's shard (on the part's device) of a buffer in host memory laid out as the part's flat parameters (no
  //! communication).
  template <class U>
  void take_shard(const U* whole, U* shard) const {
    for (const auto& p : plan_.pieces)
      model_.ops().from_host(whole + p.own_lo, shard + p.at, static_cast<std::size_t>(p.own()));
  }

 protected:
  struct ReduceScatterBucket {
    static constexpr const char* name = "reduce_scatter buckets";
    ZeroBase* self;
    comm::Handle operator()(std::size_t b) const { return self->start(b); }
    void chunk_done(bool failed) const { self->chunk_started(failed); }
  };
  //! Before backward chunk c: the buckets released whose reduce-scatter has read them (on the host, those the
  //! chunks up to c - 2 completed, once read: what a rank holds does not depend on how fast its collectives
  //! run), and the ones chunk c writes held (for a model that does not say what a chunk writes,
  //! backward_chunk_writes(c), every bucket before chunk 0).
  struct HoldWritten {
    ZeroBase* self;
    void operator()(std::size_t c) const {
      if constexpr (kernels::is_host_v<Dev>) self->release_started_before(c);
      else self->release_reduced();
      if constexpr (requires { self->model_.backward_chunk_writes(0); }) {
        const auto r = self->model_.backward_chunk_writes(static_cast<int>(c));
        for (std::size_t p = r.first; p < r.last; ++p) self->hold(self->bucket_of_[p]);
        if (r.also != Model::no_param) self->hold(self->bucket_of_[r.also]);
      } else if (c == 0) {
        self->hold_all();
      }
    }
  };

  //! Bytes of bucket b that are not this rank's chunk: what ZeRO-2 releases.
  std::size_t released_bytes(std::size_t b) const {
    const auto& p = plan_.pieces[b];
    return static_cast<std::size_t>(p.hi - p.lo - p.own()) * sizeof(T);
  }
  //! Counts bucket b's released part as held again (it is about to be written); beyond the cap, throws.
  //! The bucket's released part is zeroed (gradients accumulate into it).
  void hold(std::size_t b) {
    if (held_[b]) return;
    if constexpr (counted) ledger_->debit(MemoryUse::gradients, released_bytes(b));
    held_[b] = 1;
    const auto& p = plan_.pieces[b];
    T* g = model_.grads().data();
    model_.ops().fill(g + p.lo, static_cast<std::size_t>(p.own_lo - p.lo), T(0));
    model_.ops().fill(g + p.own_hi, static_cast<std::size_t>(p.hi - p.own_hi), T(0));
  }
  //! Under ZeRO-2, once every bucket is reduce-scattered (or before the first step): releases each bucket but this
  //! rank's chunk.
  void release() {
    for (std::size_t b = 0; b < plan_.pieces.size(); ++b) release(b);
  }
  //! Under ZeRO-2, during backward: releases the buckets whose reduce-scatter has read them (a padded bucket's was
  //! copied when it started).
  void release_reduced() {
    if (!shard_grads_) return;
    std::lock_guard lock(mu_);
    for (std::size_t b = 0; b < reading_.size(); ++b)
      if (started_[b] && reading_[b].test()) release(b);
  }
  //! Under ZeRO-2, before backward chunk c (on the host): releases, once their reduce-scatter has read them, the
  //! buckets chunks 0 .. c - 2 started, and no other. So a rank holds, besides its chunks, the buckets of the two
  //! chunks backward computes last, however fast or slow the collectives are (plan::memory counts the same), and
  //! chunk c waits, if it must, for the collectives of chunk c - 2: the reductions keep pace with backward.
  void release_started_before(std::size_t c) {
    if (!shard_grads_ || c < 2) return;
    std::vector<std::size_t> ready;
    std::vector<comm::Handle> reading;
    {
      std::unique_lock lock(mu_);
      const auto timeout = comm::default_timeout();
      LOOM_CHECK(started_cv_.wait_for(lock, timeout, [&] { return chunks_started_ + 1 >= c || start_failed_; }),
                 "ZeRO: backward chunk ", c, " waited ", timeout.count(), " ms for the reduce-scatters of chunk ",
                 c - 2, " to start");
      if (start_failed_) return;  // the step fails with the start's error once backward's tasks are done
      for (std::size_t b = 0; b < started_.size(); ++b)
        if (held_[b] && started_[b] && started_at_[b] + 2 <= c) ready.push_back(b), reading.push_back(reading_[b].share());
    }
    for (auto& h : reading) h.wait();
    for (std::size_t b : ready) release(b);
  }
  //! On Comm, once a backward chunk's reduce-scatters are issued, or one failed to be (then no later chunk's will:
  //! a chunk waiting for them goes on).
  void chunk_started(bool failed) {
    {
      std::lock_guard lock(mu_);
      ++chunks_started_;
      start_failed_ = start_failed_ || failed;
    }
    started_cv_.notify_all();
  }
  //! Bucket b's storage but this rank's chunk: credited to the ledger, and on the host its whole pages offered.
  void release(std::size_t b) {
    if (!shard_grads_ || !held_[b]) return;
    if constexpr (counted) ledger_->credit(MemoryUse::gradients, released_bytes(b));
    held_[b] = 0;
    offer(b);
  }
  void offer(std::size_t b) {
    if constexpr (kernels::is_host_v<Dev>) {
      const auto& p = plan_.pieces[b];
      T* g = model_.grads().data();
      offer_pages(g, p.lo, p.own_lo);
      offer_pages(g, p.own_hi, p.hi);
    }
  }

  //! Where the part's tied table starts in its flat buffer (-1: it holds none).
  static std::int64_t tied_offset(Model& m) {
    const auto g = m.tied_grad();
    return g.empty() ? -1 : g.data() - m.grads().data();
  }
  std::int64_t max_chunk() const {
    std::int64_t c = 0;
    for (const auto& p : plan_.pieces) c = std::max(c, p.chunk);
    return c;
  }

  //! What a reduction of gradients in type U receives into: the shard and, for each bucket reduced from a copy,
  //! the copy.
  template <class U>
  struct Reduction {
    Tensor<U, Dev> shard;                //!< this rank's averages, as plan().pieces lay them out
    std::vector<Tensor<U, Dev>> staged;  //!< per bucket: empty, or its copy and the rank's chunk after it
  };
  //! Whether bucket b is reduced (in U) from a copy: when n does not divide it (zero-padded), or when U is wider
  //! than the gradients (bf16 in fp32).
  template <class U>
  bool staged(std::size_t b) const {
    return plan_.pieces[b].padded(comm_of(b).size()) || !std::is_same_v<U, T>;
  }
  //! Where bucket b is sharded: the experts' over the expert-data-parallel group, the others' over comm_.
  Comm& comm_of(std::size_t b) const { return buckets_[b].expert && edp_ ? *edp_ : comm_; }
  //! dst = src converted, n elements, by ops (the part's device): copied, widened from T to R, or rounded back.
  template <class A, class B>
  static void convert(const Ops& ops, const A* src, B* dst, std::size_t n) {
    if constexpr (std::is_same_v<A, B>) ops.copy(src, dst, n);
    else if constexpr (std::is_same_v<A, T>) ops.widen(src, dst, n);
    else ops.narrow(src, dst, n);
  }

  //! Makes what the reduce-scatters receive into.
  void begin() {
    if (shard_grads_) {
      std::lock_guard lock(mu_);
      started_.assign(plan_.pieces.size(), 0);
      started_at_.assign(plan_.pieces.size(), 0);
      chunks_started_ = 0, start_failed_ = false;
      reading_.clear();
      reading_.resize(plan_.pieces.size());
    }
    if (widen_) begin_in(wide_);
    else begin_in(own_);
  }
  template <class U>
  void begin_in(Reduction<U>& red) {
    MemoryUseScope use(MemoryUse::communication);
    red.shard = Tensor<U, Dev>({std::max<std::int64_t>(1, plan_.numel)});
    red.staged.assign(plan_.pieces.size(), Tensor<U, Dev>());
    for (std::size_t b = 0; b < plan_.pieces.size(); ++b)
      if (staged<U>(b)) red.staged[b] = Tensor<U, Dev>({plan_.pieces[b].chunk * (comm_of(b).size() + 1)});
  }
  //! Starts bucket b's reduce-scatter: into the shard, or within its staging copy (zero-padded, widened).
  comm::Handle start(std::size_t b) { return widen_ ? start_in(b, wide_) : start_in(b, own_); }
  template <class U>
  comm::Handle start_in(std::size_t b, Reduction<U>& red) {
    const auto& p = plan_.pieces[b];
    Comm& comm = comm_of(b);
    const int n = comm.size();
    const std::size_t chunk = static_cast<std::size_t>(p.chunk), len = static_cast<std::size_t>(p.hi - p.lo);
    const T* g = model_.grads().data() + p.lo;
    if constexpr (std::is_same_v<U, T>) {
      if (!p.padded(n)) {
        comm::Handle h = comm.reduce_scatter_async(std::span<const T>(g, len),
                                                    std::span<T>(red.shard.data() + p.at, chunk), comm::Reduce::avg);
        if (shard_grads_) {  // ZeRO-2 releases the bucket once the collective has read it
          std::lock_guard lock(mu_);
          static_cast<void>(reading_[b] = h.share());
          started_[b] = 1, started_at_[b] = chunks_started_;
        }
        return h;
      }
    }
    // The staging copy was made by begin(), before backward's kernels were queued, and the bucket is written: on a
    // device the copy runs on a stream of its own, not after the kernels queued on the model's stream since.
    U* s = red.staged[b].data();
    const Ops& ops = side_.ops(model_.ops());
    convert(ops, g, s, len);
    ops.fill(s + len, chunk * static_cast<std::size_t>(n) - len, U(0));
    ops.mark().wait();  // the copy is written before the collective reads it
    if (shard_grads_) {
      std::lock_guard lock(mu_);
      started_[b] = 1, started_at_[b] = chunks_started_;  // the copy is read, not the bucket
    }
    // The rank's average lands in the chunk after the copy.
    const std::size_t all = chunk * static_cast<std::size_t>(n);
    return comm.reduce_scatter_async(std::span<const U>(s, all), std::span<U>(s + all, chunk), comm::Reduce::avg);
  }
  //! Puts this rank's averages in place in the gradient buffer (with hybrid sharding, averaged over the replicas
  //! first; reduced in a wider type, rounded) and frees what they were received into.
  void finish() {
    if (widen_) finish_in(wide_);
    else finish_in(own_);
    if (shard_grads_) {
      std::lock_guard lock(mu_);
      reading_.clear();
      release();
    }
  }
  template <class U>
  void finish_in(Reduction<U>& red) {
    T* g = model_.grads().data();
    auto averages = [&](std::size_t b) -> const U* {
      const auto& p = plan_.pieces[b];
      return staged<U>(b) ? red.staged[b].data() + comm_of(b).size() * p.chunk : red.shard.data() + p.at;
    };
    if (replicas_ && replicas_->size() > 1) {  // the shard, whole, then one average over the replicas
      for (std::size_t b = 0; b < plan_.pieces.size(); ++b)
        if (staged<U>(b))
          convert(model_.ops(), averages(b), red.shard.data() + plan_.pieces[b].at,
                  static_cast<std::size_t>(plan_.pieces[b].own()));
      model_.ops().synchronize();
      replicas_->all_reduce(std::span<U>(red.shard.data(), static_cast<std::size_t>(plan_.numel)), comm::Reduce::avg);
      for (const auto& p : plan_.pieces)
        convert(model_.ops(), red.shard.data() + p.at, g + p.own_lo, static_cast<std::size_t>(p.own()));
    } else {
      for (std::size_t b = 0; b < plan_.pieces.size(); ++b) {
        const auto& p = plan_.pieces[b];
        convert(model_.ops(), averages(b), g + p.own_lo, static_cast<std::size_t>(p.own()));
        if (buckets_[b].expert && ep_ > 1)  // the average over edp, of sums over ep ranks' tokens: over dp x cp
          model_.ops().scale(g + p.own_lo, static_cast<std::size_t>(p.own()), static_cast<loom::acc_t<T>>(1.0 / ep_));
      }
    }
    model_.ops().synchronize();
    red = Reduction<U>();
  }

  Model& model_;
  Comm& comm_;
  Comm* edp_;  //!< with expert parallelism: the experts' group
  int ep_;
  std::vector<Bucket> buckets_;
  ShardPlan plan_;
  bool overlap_;
  bool shard_grads_;                           //!< ZeRO-2 and 3 over more than one rank
  Comm* replicas_;                             //!< hybrid sharding: the ranks holding this rank's shard elsewhere
  std::shared_ptr<MemoryLedger> ledger_;       //!< the rank's, which the gradient buffer is charged to
  //! Whether the ledger counts the gradients: host memory (a device's tensors are not counted, as Tensor's are not).
  static constexpr bool counted = kernels::is_host_v<Dev>;
  std::vector<char> held_;                     //!< per bucket: whether its released part is held (counted)
  std::vector<std::size_t> bucket_of_;         //!< per parameter: its bucket
  std::mutex mu_;                      //!< guards started_, started_at_, chunks_started_ and reading_ (set on Comm)
  std::condition_variable started_cv_;  //!< chunks_started_ grew
  std::vector<char> started_;          //!< during a reduction, per bucket: its reduce-scatter has started
  std::vector<std::size_t> started_at_;  //!< ... by the start stage of which backward chunk
  std::size_t chunks_started_ = 0;     //!< backward chunks whose reduce-scatters are issued
  bool start_failed_ = false;          //!< a chunk's reduce-scatters failed to start
  std::vector<comm::Handle> reading_;  //!< during a reduction, per bucket: its reduce-scatter, while it reads it
  bool widen_;           //!< gradients are reduce-scattered in R (wider than T), not in T (ReduceIn<bf16>)
  Reduction<R> wide_;    //!< during a reduction in R
  Reduction<T> own_;     //!< during a reduction in T
  kernels::SideStream<Dev> side_;  //!< where a bucket is copied for its reduce-scatter
};

}  // namespace detail

//! ZeRO stage Stage (DP<n, ZeRO<Stage>>) for one model part, built by the trainer as
//! ShardedDataParallel<Model, Comm, Stage>(model, comm, bucket_bytes, overlap, skip_tied, keep, replicas, in_storage,
//! edp, ep). The stage is the type: ZeRO-1 and ZeRO-2 are detail::ZeroBase over the gradient buffer's buckets
//! (ZeRO-2 releasing each reduced bucket but the rank's chunk), ZeRO-3 the specialisation below, over the model's
//! units, which gathers parameters; code one stage does not run is not compiled for it.
template <class Model, class Comm, int Stage>
class ShardedDataParallel : public detail::ZeroBase<Model, Comm> {
  static_assert(Stage == 1 || Stage == 2, "loom: ZeRO's stages are 1, 2 and 3");
  using Base = detail::ZeroBase<Model, Comm>;

 public:
  using T = typename Base::T;

  //! `keep` (KeepGathered) is ZeRO-3's alone, and not read here.
  ShardedDataParallel(Model& model, Comm& comm, std::size_t bucket_bytes, bool overlap, bool skip_tied,
                      bool /*keep*/ = false, Comm* replicas = nullptr, bool in_storage = false, Comm* edp = nullptr,
                      int ep = 1)
      : Base(model, comm, Stage, make_buckets(model.specs(), sizeof(T), bucket_bytes), overlap, skip_tied, replicas,
             in_storage, edp, ep) {}

  //! The uses of a model part's buffers that this stage over `ranks` accounts for itself: a part built for it is
  //! made with them uncounted (UncountedMemoryScope).
  static std::vector<MemoryUse> uncounted_uses(int ranks) {
    if (Stage >= 2 && ranks > 1) return {MemoryUse::gradients};
    return {};
  }
};

//! ZeRO-3: ZeRO-2 over the model's units (the embedding, each block, the final norm), whose parameters each rank
//! holds its chunks of. A unit is gathered before the forward unit or backward chunk that reads it and released
//! after the last that does, the next unit's all-gather on Comm while the current one computes; with KeepGathered
//! (`keep`) a unit stays gathered from its forward to the step's last backward.
template <class Model, class Comm>
class ShardedDataParallel<Model, Comm, 3> : public detail::ZeroBase<Model, Comm> {
  static_assert(UnitModel<Model>, "loom: DP<n, ZeRO<3>> needs a model that runs in units (train::UnitModel: "
                                  "param_units, forward_units, forward_unit, ...)");
  using Base = detail::ZeroBase<Model, Comm>;
  using Base::begin, Base::buckets_, Base::finish, Base::model_, Base::overlap_;
  using typename Base::HoldWritten;

 public:
  using T = typename Base::T;

  ShardedDataParallel(Model& model, Comm& comm, std::size_t /*bucket_bytes*/, bool overlap, bool skip_tied,
                      bool keep = false, Comm* replicas = nullptr, bool in_storage = false, Comm* edp = nullptr,
                      int ep = 1)
      : Base(model, comm, 3, unit_buckets_of(model), overlap, skip_tied, replicas, in_storage, edp, ep), keep_(keep) {
    if (comm.size() > 1)
      params_ = std::make_unique<ShardedParameters<Model, Comm>>(model, comm, this->plan_, this->bucket_of_, edp);
  }

  static std::vector<MemoryUse> uncounted_uses(int ranks) {
    if (ranks > 1) return {MemoryUse::gradients, MemoryUse::parameters};
    return {};
  }

  //! Forward of micro-batch mb in activation slot `slot`: each unit's parameters gathered ahead of it, the next
  //! while the current computes, and released after the last unit that reads them (with KeepGathered, kept for the
  //! backward).
  double forward(int slot, const typename Model::MicroBatch& mb, const T* input = nullptr) {
    if (!params_) return Base::forward(slot, mb, input);
    model_.forward_begin(slot, mb, input);
    std::vector<models::ParamRange> reads;
    for (int u = 0; u < model_.forward_units(); ++u) reads.push_back(model_.forward_unit_reads(u));
    double loss = 0;
    run_gathered("forward", reads, !keep_, [&](int u) { loss = model_.forward_unit(slot, u); });
    return loss;
  }
  //! Backward of a micro-batch before the step's last: its units gathered as the last backward's are, and kept with
  //! KeepGathered; gradients accumulate.
  void accumulate(int slot, double scale) {
    if (!params_) return Base::accumulate(slot, scale);
    gathered_backward(slot, scale, false);
  }
  //! Backward of the last micro-batch of a step: its units gathered, and every bucket reduce-scattered as backward
  //! completes it.
  void backward(int slot, double scale) {
    if (!params_) return Base::backward(slot, scale);
    gathered_backward(slot, scale, true);
  }

  //! Before a pipeline's schedule: every unit gathered, for the whole step (KeepGathered).
  void gather_units() {
    if (params_) params_->gather_all();
  }
  //! After a pipeline's schedule: every unit but this rank's chunks released.
  void release_units() {
    if (params_) params_->release_all();
  }
  //! The part's whole parameters in host memory, gathered from every rank's chunks (a collective over the
  //! data-parallel group).
  std::vector<T> whole_params() {
    if (!params_) return Base::whole_params();
    // The rank's chunks, laid out as its shard on its device (gather_shard reads from there).
    const typename Base::Buf own({std::max<std::int64_t>(1, this->plan_.numel)});
    const T* w = model_.params().data();
    for (const auto& p : this->plan_.pieces)
      model_.ops().copy(w + p.own_lo, own.data() + p.at, static_cast<std::size_t>(p.own()));
    return this->gather_shard(own.data());
  }
  //! Nothing: each unit is gathered when it is next read.
  void gather_params() {
    if (!params_) Base::gather_params();
  }

 private:
  //! Runs step(c) for c = 0 .. reads.size() - 1 on Compute, each once the units holding the parameters reads[c]
  //! names are gathered; step c + 1's gathers start on Comm once step c - 1 is done, so that they run while step c
  //! computes and at most two steps' units are gathered at a time (besides the ones kept). With `release` each
  //! unit is released after the last step that reads it, and every unit still held after the last step. then(c),
  //! when given, runs on Comm once step c is done and returns what it started. Which units are gathered and
  //! released where is decided before anything runs, from what every rank holds alike: every rank issues the same
  //! collectives in the same order.
  template <class Step, class Then = std::nullptr_t>
  void run_gathered(const char* name, const std::vector<models::ParamRange>& reads, bool release, Step step,
                    Then then = nullptr) {
    const int n = static_cast<int>(reads.size());
    const std::size_t units = params_->units();
    std::vector<char> held(units);
    for (std::size_t u = 0; u < units; ++u) held[u] = params_->gathered(u);
    const auto steps = static_cast<std::size_t>(n);
    std::vector<std::vector<std::size_t>> need(steps), drop(steps);
    std::vector<int> last(units, n - 1);  // a unit no step reads goes after the last
    for (int c = 0; c < n; ++c)
      for (std::size_t u : params_->units_of(reads[std::size_t(c)])) {
        last[u] = c;
        if (!held[u]) need[std::size_t(c)].push_back(u), held[u] = 1;
      }
    for (std::size_t u = 0; release && u < units; ++u)
      if (held[u]) drop[std::size_t(last[u])].push_back(u);
    exec::Graph g;
    std::vector<exec::Graph::Id> gather(steps), run(steps);
    // Step c's gathers are prepared (their chunks copied on the model's stream) once step c - 2 is queued, and start
    // once its kernels and those copies are done: on a device they then run while step c - 1 computes.
    std::vector<std::optional<typename ShardedParameters<Model, Comm>::Mark>> prepared(steps);
    auto prepare = [&](int c) { prepared[std::size_t(c)].emplace(params_->prepare(need[std::size_t(c)])); };
    auto add_gather = [&](int c) {
      std::vector<exec::Graph::Id> after;
      if (c >= 2) after.push_back(run[std::size_t(c - 2)]);
      gather[std::size_t(c)] = g.add<exec::Comm>(
          "all_gather params",
          [this, &need, &prepared, c] {
            prepared[std::size_t(c)]->wait();
            return params_->launch(need[std::size_t(c)]);
          },
          std::move(after));
    };
    for (int c = 0; c < std::min(n, 2); ++c) prepare(c);
    add_gather(0);
    for (int c = 0; c < n; ++c) {
      if (c + 1 < n) add_gather(c + 1);
      run[std::size_t(c)] = g.add<exec::Compute>(
          name,
          [&, c] {
            params_->finish(need[std::size_t(c)]);
            step(c);
            for (std::size_t u : drop[std::size_t(c)]) params_->release(u);
            if (c + 2 < n) prepare(c + 2);
          },
          {gather[std::size_t(c)]});
      if constexpr (!std::is_same_v<Then, std::nullptr_t>)
        g.add<exec::Comm>(Then::name, [&then, c] { return then(static_cast<std::size_t>(c)); }, {run[std::size_t(c)]});
    }
    g.run();
  }

  //! ZeRO-3's backward of the micro-batch in `slot`: its units gathered (run_gathered) and, when `reduce` (the
  //! step's last micro-batch), released after, and every bucket reduce-scattered as backward completes it.
  void gathered_backward(int slot, double scale, bool reduce) {
    const int n = model_.backward_chunks();
    std::vector<models::ParamRange> reads;
    for (int c = 0; c < n; ++c) reads.push_back(model_.backward_chunk_reads(c));
    std::vector<typename Model::ParamRange> done(static_cast<std::size_t>(n));
    std::vector<std::optional<Mark>> marks(static_cast<std::size_t>(n));  // where each chunk's kernels end
    auto step = [&](int c) {
      if (reduce && overlap_) HoldWritten{this}(static_cast<std::size_t>(c));
      done[std::size_t(c)] = model_.backward_chunk(slot, c, scale);
      marks[std::size_t(c)].emplace(model_.ops().mark());
    };
    const bool release = !keep_ || reduce;
    if (!reduce || !overlap_) {
      if (reduce) this->hold_all();
      run_gathered("backward", reads, release, step);
      if (reduce) this->reduce_all();
      return;
    }
    begin();
    std::vector<char> complete(model_.specs().size(), 0);
    std::size_t next = 0;
    run_gathered("backward", reads, release, step, StartComplete{this, &done, &marks, &complete, &next});
    LOOM_CHECK(next == buckets_.size(), "ZeRO-3: ", buckets_.size() - next, " of ", buckets_.size(),
               " units' gradients were never complete");
    finish();
  }
  using Mark = decltype(std::declval<Model&>().ops().mark());
  //! On Comm after backward chunk c, once its work is done (on a device: its kernels): starts the reduce-scatter of
  //! every unit that is now complete, in order.
  struct StartComplete {
    static constexpr const char* name = "reduce_scatter buckets";
    ShardedDataParallel* self;
    std::vector<typename Model::ParamRange>* done;
    std::vector<std::optional<Mark>>* marks;
    std::vector<char>* complete;
    std::size_t* next;
    comm::Handles operator()(std::size_t c) const {
      (*marks)[c]->wait();
      typename Base::ReduceScatterBucket start{self};
      return detail::start_completed<Model>((*done)[c], self->buckets_, *complete, *next, start);
    }
  };

  bool keep_;                                               //!< KeepGathered
  std::unique_ptr<ShardedParameters<Model, Comm>> params_;  //!< over more than one rank
};

}  // namespace loom::train

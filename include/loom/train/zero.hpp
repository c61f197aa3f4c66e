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
// once.
#pragma once

#include <loom/comm/communicator.hpp>
#include <loom/core/memory.hpp>
#include <loom/exec/pipeline.hpp>
#include <loom/layers/param.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data_parallel.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

namespace loom::train {

//! Which elements of a model part's flat buffer one data-parallel rank owns under ZeRO: chunk `rank` of each bucket.
struct ShardPlan {
  //! One bucket as it is reduce-scattered: elements [lo, hi) of the flat buffer in `ranks` chunks of `chunk`
  //! elements (the last ones padded); this rank's part of it, [own_lo, own_hi), is at `at` in the shard.
  struct Piece {
    std::int64_t lo, hi, chunk, own_lo, own_hi, at;
    std::int64_t own() const { return own_hi - own_lo; }
    bool padded(int ranks) const { return chunk * ranks != hi - lo; }
  };
  //! Elements [at, at + n) of the part's flat gradient buffer, weighted in the global norm's sum of squares.
  struct NormRun {
    std::int64_t at, n;
    double weight;
  };

  std::vector<Piece> pieces;           //!< in the order of the buckets (the order backward completes them)
  std::vector<optim::Slice> slices;    //!< what the optimizer updates: the shard, by parameter
  std::vector<NormRun> norm;           //!< the shard's terms of the global norm
  std::int64_t numel = 0;              //!< elements of the shard

  //! Rank `rank` of `ranks`, over a part with parameters `specs` in `buckets`; the parameter at flat offset
  //! `uncounted` (the tied table, where another part counts it) stays out of the norm; -1: none does.
  ShardPlan(const std::vector<Bucket>& buckets, const std::vector<layers::ParamSpec>& specs, int ranks, int rank,
            std::int64_t uncounted = -1) {
    for (const auto& b : buckets) {
      const std::int64_t len = b.hi - b.lo, chunk = (len + ranks - 1) / ranks;
      const std::int64_t own_lo = std::min(b.hi, b.lo + rank * chunk), own_hi = std::min(b.hi, own_lo + chunk);
      pieces.push_back({b.lo, b.hi, chunk, own_lo, own_hi, numel});
      numel += own_hi - own_lo;
    }
    for (const auto& p : pieces)
      for (std::size_t i = 0; i < specs.size(); ++i) {
        const auto& s = specs[i];
        const std::int64_t lo = std::max(p.own_lo, s.offset), hi = std::min(p.own_hi, s.offset + numel_of(s.shape));
        if (lo >= hi) continue;
        const std::int64_t at = p.at + (lo - p.own_lo);
        slices.push_back({lo, at, hi - lo, s.decay});
        if (s.offset == uncounted) continue;
        // Each piece of the parameter's tensor-parallel layout that meets the shard, weighted 1 / its replicas.
        s.layout.for_each_piece([&](std::int64_t l, std::int64_t, std::int64_t n, int replicas) {
          const std::int64_t a = std::max(lo, s.offset + l), z = std::min(hi, s.offset + l + n);
          if (a < z) norm.push_back({a, z - a, 1.0 / replicas});
        });
      }
  }
};

//! ZeRO-1 for one model part: the reduce-scatter of its buckets (overlapped with the last backward, or after a
//! pipeline's schedule), the rank's chunks' part of the global norm, their clipping, and the all-gather of the
//! updated parameters. The optimizer (built over plan().slices) steps the model's parameters where this rank owns
//! them, from the averaged gradients there. What the reduce-scatter receives into (the shard, and a padded bucket's
//! copy) is a communication buffer held from the first bucket's start to the end of the reduction.
template <class Model, class Comm>
class ShardedDataParallel {
 public:
  using T = typename Model::value_type;
  using Dev = typename std::remove_cvref_t<decltype(std::declval<Model&>().params())>::device;
  using Buf = Tensor<T, Dev>;

  //! ZeRO stage `stage` (1 or 2) of `model` over the data-parallel group `comm`.
  ShardedDataParallel(Model& model, Comm& comm, int stage, std::size_t bucket_bytes, bool overlap, bool skip_tied)
      : model_(model), comm_(comm), buckets_(make_buckets(model.specs(), sizeof(T), bucket_bytes)),
        plan_(buckets_, model.specs(), comm.size(), comm.rank(), skip_tied ? tied_offset(model) : -1),
        overlap_(overlap), shard_grads_(stage >= 2 && comm.size() > 1), ledger_(rank_memory_ledger()),
        held_(buckets_.size(), 1), bucket_of_(model.specs().size(), 0) {
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      for (std::size_t p = buckets_[b].first; p < buckets_[b].last; ++p) bucket_of_[p] = b;
    release();  // ZeRO-2: until the first backward writes them, a rank holds the gradients of its shard alone
  }
  ~ShardedDataParallel() {  // the gradient buffer's credit, when the model frees it, counts every bucket
    for (std::size_t b = 0; b < held_.size(); ++b)
      if (!held_[b]) ledger_->restore(MemoryUse::gradients, released_bytes(b));
  }
  ShardedDataParallel(const ShardedDataParallel&) = delete;
  ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;

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

  //! Backward of the last micro-batch of a step (activation slot `slot`), each bucket reduce-scattered once
  //! complete; this rank's chunks of the gradient buffer hold the averages when it returns.
  void backward(int slot, double scale) {
    if (!overlap_ || comm_.size() == 1) {
      hold_all();
      model_.backward(slot, scale);
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
    begin();
    comm::Handles all;
    for (std::size_t b = 0; b < plan_.pieces.size(); ++b) all.all.push_back(start(b));
    all.wait();
    finish();
  }

  //! This rank's chunks' terms of the global norm's sum of squares (each element of the whole model counted once
  //! over the data-, tensor- and pipeline-parallel groups once summed over them).
  double grad_square() const {
    double s = 0;
    const T* g = model_.grads().data();
    for (const auto& r : plan_.norm)
      s += r.weight * model_.ops().sum_squares(g + r.at, static_cast<std::size_t>(r.n));
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

  //! After the optimizer updated this rank's chunks of the parameters: every bucket's parameters from its owners.
  void gather_params() {
    const int n = comm_.size();
    if (n == 1) return;
    const auto& ops = model_.ops();
    T* params = model_.params().data();
    MemoryUseScope use(MemoryUse::communication);
    Buf own({std::max<std::int64_t>(1, max_chunk())});  // the rank's chunk, sent from a copy: it is received in place
    for (const auto& p : plan_.pieces) {
      const std::size_t chunk = static_cast<std::size_t>(p.chunk), len = static_cast<std::size_t>(p.hi - p.lo);
      ops.copy(params + p.own_lo, own.data(), static_cast<std::size_t>(p.own()));
      if (p.own() < p.chunk) ops.fill(own.data() + p.own(), chunk - static_cast<std::size_t>(p.own()), T(0));
      const std::span<const T> send(own.data(), chunk);
      if (p.padded(n)) {
        Buf all({p.chunk * n});
        comm_.all_gather(send, std::span<T>(all.data(), chunk * static_cast<std::size_t>(n)));
        ops.copy(all.data(), params + p.lo, len);
      } else {
        comm_.all_gather(send, std::span<T>(params + p.lo, len));
      }
    }
    ops.synchronize();
  }

  //! A buffer laid out as this part's flat parameters from one laid out as the shard (an optimizer's state):
  //! every rank's chunks, gathered. A collective over the data-parallel group.
  template <class U>
  std::vector<U> gather_shard(const U* shard) {
    const int n = comm_.size();
    std::vector<U> whole(static_cast<std::size_t>(model_.params().numel()), U(0));
    std::vector<U> own, all;
    for (const auto& p : plan_.pieces) {
      own.assign(static_cast<std::size_t>(p.chunk), U(0));
      std::copy_n(shard + p.at, p.own(), own.begin());
      all.resize(own.size() * static_cast<std::size_t>(n));
      comm_.all_gather(own, all);
      std::copy_n(all.begin(), p.hi - p.lo, whole.begin() + p.lo);
    }
    return whole;
  }
  //! This rank's shard of a buffer laid out as the part's flat parameters (no communication).
  template <class U>
  void take_shard(const U* whole, U* shard) const {
    for (const auto& p : plan_.pieces) std::copy_n(whole + p.own_lo, p.own(), shard + p.at);
  }

 private:
  struct ReduceScatterBucket {
    static constexpr const char* name = "reduce_scatter buckets";
    ShardedDataParallel* self;
    comm::Handle operator()(std::size_t b) const { return self->start(b); }
  };
  //! Before backward chunk c: the buckets whose reduce-scatter is done are released, and the ones it writes held.
  struct HoldWritten {
    ShardedDataParallel* self;
    void operator()(std::size_t c) const {
      self->release_reduced();
      const auto r = self->model_.backward_chunk_writes(static_cast<int>(c));
      for (std::size_t p = r.first; p < r.last; ++p) self->hold(self->bucket_of_[p]);
      if (r.also != Model::no_param) self->hold(self->bucket_of_[r.also]);
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
    ledger_->debit(MemoryUse::gradients, released_bytes(b));
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
  //! Bucket b's storage but this rank's chunk: credited to the ledger, and on the host its whole pages given back.
  void release(std::size_t b) {
    if (!shard_grads_ || !held_[b]) return;
    const auto& p = plan_.pieces[b];
    ledger_->credit(MemoryUse::gradients, released_bytes(b));
    held_[b] = 0;
    if constexpr (kernels::is_host_v<Dev>) {
      T* g = model_.grads().data();
      release_pages(g, p.lo, p.own_lo);
      release_pages(g, p.own_hi, p.hi);
    }
  }
  //! Lets the system take back the whole pages of elements [lo, hi) of g when it needs memory (MADV_FREE: until
  //! then they stay, and writing them again costs nothing; what they read after is zeroed by hold()).
  static void release_pages(T* g, std::int64_t lo, std::int64_t hi) {
#ifdef MADV_FREE
    static const std::uintptr_t page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto a = reinterpret_cast<std::uintptr_t>(g + lo), z = reinterpret_cast<std::uintptr_t>(g + hi);
    const std::uintptr_t first = (a + page - 1) / page * page, last = z / page * page;
    if (first < last) madvise(reinterpret_cast<void*>(first), last - first, MADV_FREE);  // a hint: failure is harmless
#else
    (void)g, (void)lo, (void)hi;
#endif
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

  //! Makes what the reduce-scatters receive into: the shard and, for each padded bucket, its zero-padded copy.
  void begin() {
    if (shard_grads_) {
      std::lock_guard lock(mu_);
      started_.assign(plan_.pieces.size(), 0);
      reading_.clear();
      reading_.resize(plan_.pieces.size());
    }
    MemoryUseScope use(MemoryUse::communication);
    shard_ = Buf({std::max<std::int64_t>(1, plan_.numel)});
    staged_.assign(plan_.pieces.size(), Buf());
    for (std::size_t b = 0; b < plan_.pieces.size(); ++b)
      if (const auto& p = plan_.pieces[b]; p.padded(comm_.size())) staged_[b] = Buf({p.chunk * (comm_.size() + 1)});
  }
  //! Starts bucket b's reduce-scatter: into the shard, or, for a padded bucket, within its staging copy.
  comm::Handle start(std::size_t b) {
    const auto& p = plan_.pieces[b];
    const int n = comm_.size();
    const std::size_t chunk = static_cast<std::size_t>(p.chunk), len = static_cast<std::size_t>(p.hi - p.lo);
    const T* g = model_.grads().data() + p.lo;
    if (!p.padded(n)) {
      comm::Handle h = comm_.reduce_scatter_async(std::span<const T>(g, len),
                                                  std::span<T>(shard_.data() + p.at, chunk), comm::Reduce::avg);
      if (shard_grads_) {  // ZeRO-2 releases the bucket once the collective has read it
        std::lock_guard lock(mu_);
        static_cast<void>(reading_[b] = h.share());
        started_[b] = 1;
      }
      return h;
    }
    T* s = staged_[b].data();
    model_.ops().copy(g, s, len);
    model_.ops().fill(s + len, chunk * static_cast<std::size_t>(n) - len, T(0));
    model_.ops().synchronize();
    if (shard_grads_) {
      std::lock_guard lock(mu_);
      started_[b] = 1;  // the copy is read, not the bucket
    }
    // The rank's average lands in the chunk after the copy.
    const std::size_t all = chunk * static_cast<std::size_t>(n);
    return comm_.reduce_scatter_async(std::span<const T>(s, all), std::span<T>(s + all, chunk), comm::Reduce::avg);
  }
  //! Puts this rank's averages in place in the gradient buffer and frees what they were received into.
  void finish() {
    const int n = comm_.size();
    T* g = model_.grads().data();
    for (std::size_t b = 0; b < plan_.pieces.size(); ++b) {
      const auto& p = plan_.pieces[b];
      const T* avg = p.padded(n) ? staged_[b].data() + n * p.chunk : shard_.data() + p.at;
      model_.ops().copy(avg, g + p.own_lo, static_cast<std::size_t>(p.own()));
    }
    model_.ops().synchronize();
    shard_ = Buf();
    staged_.clear();
    if (shard_grads_) {
      std::lock_guard lock(mu_);
      reading_.clear();
      release();
    }
  }

  Model& model_;
  Comm& comm_;
  std::vector<Bucket> buckets_;
  ShardPlan plan_;
  bool overlap_;
  bool shard_grads_;                           //!< ZeRO-2 over more than one rank
  std::shared_ptr<MemoryLedger> ledger_;       //!< the rank's, which the gradient buffer is charged to
  std::vector<char> held_;                     //!< per bucket: whether its released part is held (counted)
  std::vector<std::size_t> bucket_of_;         //!< per parameter: its bucket
  std::mutex mu_;                      //!< guards started_ and reading_ (set on Comm, read on Compute)
  std::vector<char> started_;          //!< during a reduction, per bucket: its reduce-scatter has started
  std::vector<comm::Handle> reading_;  //!< during a reduction, per bucket: its reduce-scatter, while it reads it
  Buf shard_;                //!< during a reduction: this rank's averages, as plan().pieces lay them out
  std::vector<Buf> staged_;  //!< during a reduction, per bucket: empty, or a padded bucket's copy and the rank's chunk
};

}  // namespace loom::train

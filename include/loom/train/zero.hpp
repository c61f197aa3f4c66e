// Sharded data parallelism, ZeRO stage 1 (the distributed optimizer): every data-parallel rank holds the whole
// model and its gradients, but the optimizer state of only one N-th of them. A model part's flat gradient buffer is
// split into the same buckets plain data parallelism uses; each bucket is split into N chunks of ceil(L / N)
// elements (the last may be short, or empty), and rank r owns chunk r of every bucket. Each bucket is
// reduce-scattered (averaged) as soon as backward completes it, so that rank r receives the average of its chunks,
// which it puts back in place in the gradient buffer; the global norm, clipping and the optimizer step act on those
// chunks alone; then every bucket's parameters are all-gathered from their owners. Per step each rank sends
// (N - 1) / N of the gradients and (N - 1) / N of the parameters: as much as plain data parallelism's all-reduce.
#pragma once

#include <loom/comm/communicator.hpp>
#include <loom/exec/pipeline.hpp>
#include <loom/layers/param.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data_parallel.hpp>

#include <algorithm>
#include <cstdint>
#include <span>
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

  ShardedDataParallel(Model& model, Comm& comm, std::size_t bucket_bytes, bool overlap, bool skip_tied)
      : model_(model), comm_(comm), buckets_(make_buckets(model.specs(), sizeof(T), bucket_bytes)),
        plan_(buckets_, model.specs(), comm.size(), comm.rank(), skip_tied ? tied_offset(model) : -1),
        overlap_(overlap) {}

  const ShardPlan& plan() const { return plan_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }

  //! Backward of the last micro-batch of a step (activation slot `slot`), each bucket reduce-scattered once
  //! complete; this rank's chunks of the gradient buffer hold the averages when it returns.
  void backward(int slot, double scale) {
    if (!overlap_ || comm_.size() == 1) {
      model_.backward(slot, scale);
      model_.ops().synchronize();
      reduce_all();
      return;
    }
    begin();
    backward_by_buckets(model_, buckets_, slot, scale, ReduceScatterBucket{this});
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
    if (!p.padded(n))
      return comm_.reduce_scatter_async(std::span<const T>(g, len), std::span<T>(shard_.data() + p.at, chunk),
                                        comm::Reduce::avg);
    T* s = staged_[b].data();
    model_.ops().copy(g, s, len);
    model_.ops().fill(s + len, chunk * static_cast<std::size_t>(n) - len, T(0));
    model_.ops().synchronize();
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
  }

  Model& model_;
  Comm& comm_;
  std::vector<Bucket> buckets_;
  ShardPlan plan_;
  bool overlap_;
  Buf shard_;                //!< during a reduction: this rank's averages, as plan().pieces lay them out
  std::vector<Buf> staged_;  //!< during a reduction, per bucket: empty, or a padded bucket's copy and the rank's chunk
};

}  // namespace loom::train

// Data parallelism: every rank of a data-parallel group holds the whole model and a slice of the global batch.
// Gradients are grouped into buckets (by bytes, in reverse order of the parameters, which is the order backward
// completes them); each bucket's average over the group (of bf16 gradients, in fp32 from a widened copy, on the
// host) starts as soon as backward has finished its last parameter, on the Comm resource of a stage pipeline,
// while backward goes on on Compute. A bucket is a contiguous range of the flat gradient buffer, so small tensors
// are fused into one collective without a copy.
#pragma once

#include <loom/comm/communicator.hpp>
#include <loom/exec/pipeline.hpp>
#include <loom/layers/param.hpp>
#include <loom/tensor/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <exception>
#include <span>
#include <type_traits>
#include <vector>

namespace loom::train {

//! One bucket: parameters [first, last) of the model's specs, elements [lo, hi) of its flat gradient buffer; an
//! expert bucket holds experts' parameters alone (averaged over the expert-data-parallel group), any other none.
struct Bucket {
  std::size_t first, last;
  std::int64_t lo, hi;
  bool expert = false;
};

//! Buckets of at least `bytes` each (the last may be smaller, and one ends wherever the parameters turn from
//! experts' to others' or back), filled from the last parameter backwards.
inline std::vector<Bucket> make_buckets(const std::vector<layers::ParamSpec>& specs, std::size_t elem_bytes,
                                        std::size_t bytes) {
  std::vector<Bucket> out;
  std::size_t end = specs.size();
  std::size_t acc = 0;
  for (std::size_t i = specs.size(); i-- > 0;) {
    acc += static_cast<std::size_t>(numel_of(specs[i].shape)) * elem_bytes;
    if (acc >= bytes || i == 0 || specs[i - 1].expert != specs[i].expert) {
      const auto& a = specs[i];
      const auto& b = specs[end - 1];
      out.push_back({i, end, a.offset, b.offset + numel_of(b.shape), a.expert});
      end = i;
      acc = 0;
    }
  }
  return out;
}

//! Where a model's gradients are averaged: its data-parallel group and, with expert parallelism over ep ranks, the
//! expert-data-parallel group for the experts' gradients. An expert's gradient on one rank already sums what every
//! rank of its expert-parallel group routed to it; averaged over the expert-data-parallel group and divided by ep,
//! it is the average over the whole data-parallel group, as the others' are.
template <class Comm>
struct AverageGroups {
  Comm* dp;
  Comm* edp = nullptr;  //!< null without expert parallelism
  int ep = 1;
};

//! The runs of a model's flat gradient buffer that are experts' or not, in order: [lo, hi) and which.
inline std::vector<Bucket> expert_runs(const std::vector<layers::ParamSpec>& specs) {
  return make_buckets(specs, 1, static_cast<std::size_t>(-1));
}

namespace detail {
//! backward_by_buckets' stage 0, on Compute: issues backward chunk c (after before(c)) and returns the parameters
//! it completes, pending until its work is done (on a device: an event after the chunk's kernels, which the
//! collective waits for; the compute stream goes on with the next chunk).
template <class Model, class Before>
struct BackwardChunk {
  using Mark = decltype(std::declval<Model&>().ops().mark());
  using Range = typename Model::ParamRange;
  static constexpr const char* name = "backward";
  Model* m;
  int slot;
  double scale;
  Before before;
  exec::Pending<Range, Mark> operator()(std::size_t c) const {
    before(c);
    const Range done = m->backward_chunk(slot, static_cast<int>(c), scale);
    return {done, m->ops().mark()};
  }
};
//! Records the parameters r a backward chunk completed (r.also too) in `complete`, and calls start(b) for every
//! bucket from `next` on that is now complete, in bucket order, so that every rank issues the same collectives.
//! Then start.chunk_done(failed), where Start has one: the chunk's starts are issued, or one of them failed.
template <class Model, class Range, class Start>
comm::Handles start_completed(const Range& r, const std::vector<Bucket>& buckets, std::vector<char>& complete,
                              std::size_t& next, Start& start) {
  struct Done {
    Start& start;
    int unwinding = std::uncaught_exceptions();
    ~Done() {
      if constexpr (requires { start.chunk_done(false); }) start.chunk_done(std::uncaught_exceptions() > unwinding);
    }
  } done{start};
  for (std::size_t p = r.first; p < r.last; ++p) complete[p] = 1;
  if (r.also != Model::no_param) complete[r.also] = 1;
  comm::Handles started;
  while (next < buckets.size() &&
         std::all_of(complete.begin() + static_cast<std::ptrdiff_t>(buckets[next].first),
                     complete.begin() + static_cast<std::ptrdiff_t>(buckets[next].last), [](char x) { return x; }))
    started.all.push_back(start(next++));
  return started;
}
//! backward_by_buckets' stage 1, on Comm: starts the collective of every bucket that is now complete.
template <class Model, class Start, class Chunk>
struct StartReady {
  static constexpr const char* name = Start::name;
  const std::vector<Bucket>* buckets;
  Start* start;
  std::vector<char>* complete;
  std::size_t* next;
  comm::Handles operator()(exec::Pending<typename Chunk::Range, typename Chunk::Mark>& chunk) const {
    return start_completed<Model>(chunk.value, *buckets, *complete, *next, *start);
  }
};
//! Nothing to do before a chunk.
struct NoBefore {
  void operator()(std::size_t) const {}
};
}  // namespace detail

//! Backward of the last micro-batch of a step (activation slot `slot`) in chunks on the Compute resource and, on
//! Comm, once a chunk's gradients are in memory, start(b) for every bucket b that is now complete, in bucket order,
//! so that every rank issues the same collectives; the step waits for them before it returns. Start has a static
//! `name` (the Comm stage's, in traces) and returns the comm::Handle of the collective it started. Both forms of
//! data parallelism (DataParallel, ShardedDataParallel) run their backward so; before(c) runs on Compute before
//! chunk c (ZeRO-2 counts the gradient buckets the chunk writes as held there).
template <class Model, class Start, class Before = detail::NoBefore>
void backward_by_buckets(Model& model, const std::vector<Bucket>& buckets, int slot, double scale, Start start,
                         Before before = {}) {
  std::vector<char> complete(model.specs().size(), 0);
  std::size_t next = 0;
  using Chunk = detail::BackwardChunk<Model, Before>;
  using Ready = detail::StartReady<Model, Start, Chunk>;
  exec::Pipeline<exec::Stage<exec::Compute, Chunk>, exec::Stage<exec::Comm, Ready>> p(
      Chunk{&model, slot, scale, before}, Ready{&buckets, &start, &complete, &next});
  p.run(static_cast<std::size_t>(model.backward_chunks()));
  LOOM_CHECK(next == buckets.size(), Start::name, ": ", buckets.size() - next, " of ", buckets.size(),
             " gradient buckets were never complete");
}

//! Averages over a group of gradient buffers, each started as soon as it is complete and all finished together: in
//! place, or, for bf16 gradients, in fp32 from a widened copy (a communication buffer, widened on the device that
//! holds the gradients) that finish() rounds back; in their own type with `in_storage` (ReduceIn<bf16>). Starts come
//! from one thread at a time (the Comm resource, or the rank's), each once its buffer is written (on a device: the
//! kernels that wrote it are done).
template <class T, class Dev>
class GradientAverage {
 public:
  //! What gradients are averaged in: acc_t<T>, on every device.
  using R = loom::acc_t<T>;
  using Ops = kernels::Ops<Dev>;

  explicit GradientAverage(bool in_storage) : widen_(!std::is_same_v<R, T> && !in_storage) {}

  //! On a device, where gradients are widened: memory for the widened copies of n elements, made on the thread that
  //! queues the model's kernels before the backward whose gradients start() then averages. start() widens into it
  //! on a stream of its own as soon as the gradients are written (a block made before backward's kernels were
  //! queued is used by none of them), where a copy made in start() would have to wait for every kernel queued on
  //! the model's stream by then, later backward chunks included. finish() frees it. Nothing elsewhere.
  void reserve([[maybe_unused]] std::size_t n) {
    if constexpr (!std::is_same_v<R, T> && !kernels::is_host_v<Dev>) {
      if (!widen_) return;
      clear();  // what a failed step left (it did not reach finish())
      MemoryUseScope use(MemoryUse::communication);
      pool_ = Tensor<R, Dev>({static_cast<std::int64_t>(std::max<std::size_t>(n, 1))});
      pool_size_ = n, pool_used_ = 0;
    }
  }

  //! Starts the average of g (on ops' device, written: on a device, the kernels that wrote it are done) over comm;
  //! finish() then multiplies it by `then` (an expert's 1 / ep).
  template <class Comm>
  comm::Handle start(Comm& comm, std::span<T> g, const Ops& ops, double then = 1.0) {
    ops_ = &ops;
    if (then != 1.0) scaled_.emplace_back(g, then);
    if constexpr (!std::is_same_v<R, T>) {
      if (widen_) {
        if (pool_used_ + g.size() <= pool_size_) {  // reserved: widened on a stream of its own
          R* copy = pool_.data() + pool_used_;
          pool_used_ += g.size();
          const auto& side = side_.ops(ops);
          side.widen(g.data(), copy, g.size());
          side.mark().wait();  // the copy is written before the collective reads it
          wide_.emplace_back(g, copy);
          return comm.all_reduce_async(std::span<R>(copy, g.size()), comm::Reduce::avg);
        }
        MemoryUseScope use(MemoryUse::communication);
        R* copy = made_.emplace_back(Tensor<R, Dev>({static_cast<std::int64_t>(g.size())})).data();
        wide_.emplace_back(g, copy);
        ops.widen(g.data(), copy, g.size());
        ops.mark().wait();  // the copy is written before the collective reads it
        return comm.all_reduce_async(std::span<R>(copy, g.size()), comm::Reduce::avg);
      }
    }
    return comm.all_reduce_async(g, comm::Reduce::avg);
  }
  //! Starts the averages of a model's gradients g (laid out by specs) over `groups`: the experts' over the
  //! expert-data-parallel group (then divided by ep), the others' over the data-parallel group.
  template <class Comm>
  comm::Handles start(const AverageGroups<Comm>& groups, const std::vector<layers::ParamSpec>& specs,
                      std::span<T> g, const Ops& ops) {
    comm::Handles h;
    if (!groups.edp) {
      h.all.push_back(start(*groups.dp, g, ops));
      return h;
    }
    for (const Bucket& b : expert_runs(specs))  // from the last run back, as backward completes them
      h.all.push_back(start(b.expert ? *groups.edp : *groups.dp, g.subspan(std::size_t(b.lo), std::size_t(b.hi - b.lo)),
                            ops, b.expert ? 1.0 / groups.ep : 1.0));
    return h;
  }
  //! Once every average started has completed: the widened ones rounded back into their buffers, the experts'
  //! divided by ep (on the device's stream, in order with what reads them next).
  void finish() {
    for (auto& [to, copy] : wide_) ops_->narrow(copy, to.data(), to.size());
    for (auto& [to, by] : scaled_) ops_->scale(to.data(), to.size(), static_cast<R>(by));
    clear();
  }

 private:
  void clear() {
    wide_.clear();
    made_.clear();
    scaled_.clear();
    pool_ = Tensor<R, Dev>();
    pool_size_ = pool_used_ = 0;
  }

  bool widen_;
  const Ops* ops_ = nullptr;                             //!< the gradients' device, from the last start
  std::vector<std::pair<std::span<T>, R*>> wide_;        //!< while averaged: each widened buffer and its copy
  std::vector<Tensor<R, Dev>> made_;                     //!< the copies made by start()
  Tensor<R, Dev> pool_;                                  //!< the copies reserve() made (pool_size_ elements)
  std::size_t pool_size_ = 0, pool_used_ = 0;            //!< ... and how many of them start() took
  kernels::SideStream<Dev> side_;                        //!< where a reserved copy is widened
  std::vector<std::pair<std::span<T>, double>> scaled_;  //!< what finish() multiplies, and by what
};

//! Averages a model's gradients over a data-parallel communicator, bucket by bucket, overlapped with backward.
template <class Model, class Comm>
class DataParallel {
 public:
  using T = typename std::remove_cvref_t<decltype(std::declval<Model&>().grads())>::value_type;

  //! `in_storage`: average gradients in their own type even where it is narrower than acc_t (ReduceIn<bf16>).
  //! With expert parallelism over ep ranks, the experts' gradients are averaged over edp, the
  //! expert-data-parallel group (AverageGroups).
  DataParallel(Model& model, Comm& comm, std::size_t bucket_bytes = std::size_t{25} << 20, bool overlap = true,
               bool in_storage = false, Comm* edp = nullptr, int ep = 1)
      : model_(model), comm_(comm), edp_(edp), ep_(ep),
        buckets_(make_buckets(model.specs(), sizeof(T), bucket_bytes)), overlap_(overlap), average_(in_storage) {
    LOOM_CHECK(ep == 1 || edp != nullptr, "expert parallelism over ", ep, " ranks needs an expert-data-parallel group");
  }

  const std::vector<Bucket>& buckets() const { return buckets_; }

  //! Backward of the last micro-batch of a step (in activation slot `slot`), with each bucket averaged over the
  //! group once complete.
  void backward(int slot, double scale) {
    if (!overlap_ || comm_.size() == 1) {
      model_.backward(slot, scale, nullptr);
      model_.ops().synchronize();
      if (comm_.size() > 1)
        for (std::size_t b = 0; b < buckets_.size(); ++b) start(b).wait();
      average_.finish();
      return;
    }
    average_.reserve(static_cast<std::size_t>(model_.grads().numel()));
    backward_by_buckets(model_, buckets_, slot, scale, AllReduceBucket{this});
    average_.finish();
  }

 private:
  using Dev = typename std::remove_cvref_t<decltype(std::declval<Model&>().params())>::device;

  struct AllReduceBucket {
    static constexpr const char* name = "all_reduce buckets";
    DataParallel* self;
    comm::Handle operator()(std::size_t b) const { return self->start(b); }
  };

  std::span<T> grads_of(const Bucket& b) {
    return {model_.grads().data() + b.lo, static_cast<std::size_t>(b.hi - b.lo)};
  }
  comm::Handle start(std::size_t b) {
    const Bucket& k = buckets_[b];
    if (k.expert && edp_) return average_.start(*edp_, grads_of(k), model_.ops(), 1.0 / ep_);
    return average_.start(comm_, grads_of(k), model_.ops());
  }

  Model& model_;
  Comm& comm_;
  Comm* edp_;
  int ep_;
  std::vector<Bucket> buckets_;
  bool overlap_;
  GradientAverage<T, Dev> average_;
};

}  // namespace loom::train

// Data parallelism: every rank of a data-parallel group holds the whole model and a slice of the global batch.
// Gradients are grouped into buckets (by bytes, in reverse order of the parameters, which is the order backward
// completes them); each bucket's average over the group starts as soon as backward has finished its last
// parameter, on the Comm resource of a stage pipeline, while backward goes on on Compute. A bucket is a contiguous
// range of the flat gradient buffer, so small tensors are fused into one collective without a copy.
#pragma once

#include <loom/comm/communicator.hpp>
#include <loom/exec/pipeline.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data.hpp>

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

namespace loom::train {

//! One bucket: parameters [first, last) of the model's specs, elements [lo, hi) of its flat gradient buffer.
struct Bucket {
  std::size_t first, last;
  std::int64_t lo, hi;
};

//! Buckets of at least `bytes` each (the last may be smaller), filled from the last parameter backwards.
inline std::vector<Bucket> make_buckets(const std::vector<layers::ParamSpec>& specs, std::size_t elem_bytes,
                                        std::size_t bytes) {
  std::vector<Bucket> out;
  std::size_t end = specs.size();
  std::size_t acc = 0;
  for (std::size_t i = specs.size(); i-- > 0;) {
    acc += static_cast<std::size_t>(numel_of(specs[i].shape)) * elem_bytes;
    if (acc >= bytes || i == 0) {
      const auto& a = specs[i];
      const auto& b = specs[end - 1];
      out.push_back({i, end, a.offset, b.offset + numel_of(b.shape)});
      end = i;
      acc = 0;
    }
  }
  return out;
}

//! Averages a model's gradients over a data-parallel communicator, bucket by bucket, overlapped with backward.
template <class Model, class Comm>
class DataParallel {
 public:
  using T = typename std::remove_cvref_t<decltype(std::declval<Model&>().grads())>::value_type;

  DataParallel(Model& model, Comm& comm, std::size_t bucket_bytes = std::size_t{25} << 20, bool overlap = true)
      : model_(model), comm_(comm), buckets_(make_buckets(model.specs(), sizeof(T), bucket_bytes)),
        overlap_(overlap) {}

  const std::vector<Bucket>& buckets() const { return buckets_; }

  //! Backward of the last micro-batch of a step, with each bucket averaged over the group once complete.
  void backward(double scale) {
    if (!overlap_ || comm_.size() == 1) {
      model_.backward(scale);
      model_.ops().synchronize();
      if (comm_.size() > 1)
        for (const auto& b : buckets_) reduce(b);
      return;
    }
    std::vector<char> complete(model_.specs().size(), 0);
    std::size_t next = 0;  // buckets are launched in order, so every rank issues the same collectives
    exec::Pipeline<exec::Stage<exec::Compute, BackwardChunk>, exec::Stage<exec::Comm, ReduceReady>> p(
        BackwardChunk{&model_, scale}, ReduceReady{this, &complete, &next});
    p.run(static_cast<std::size_t>(model_.backward_chunks()));
    LOOM_CHECK(next == buckets_.size(), "data parallel: ", buckets_.size() - next, " of ", buckets_.size(),
               " gradient buckets were never complete");
  }

 private:
  //! Stage 0, on Compute: backward chunk c; returns the parameters it completed, once they are in memory (on a
  //! device, the chunk's kernels have finished: the reduction reads them from another stream).
  struct BackwardChunk {
    static constexpr const char* name = "backward";
    Model* m;
    double scale;
    auto operator()(std::size_t c) const {
      const auto done = m->backward_chunk(static_cast<int>(c), scale);
      m->ops().synchronize();
      return done;
    }
  };
  //! Stage 1, on Comm: averages every bucket that is now complete, in bucket order.
  struct ReduceReady {
    static constexpr const char* name = "all_reduce buckets";
    DataParallel* self;
    std::vector<char>* complete;
    std::size_t* next;
    void operator()(typename Model::ParamRange r) const {
      for (std::size_t p = r.first; p < r.last; ++p) (*complete)[p] = 1;
      if (r.also != Model::no_param) (*complete)[r.also] = 1;
      auto& bs = self->buckets_;
      while (*next < bs.size() &&
             std::all_of(complete->begin() + static_cast<std::ptrdiff_t>(bs[*next].first),
                         complete->begin() + static_cast<std::ptrdiff_t>(bs[*next].last), [](char x) { return x; }))
        self->reduce(bs[(*next)++]);
    }
  };

  void reduce(const Bucket& b) {
    std::span<T> g(model_.grads().data() + b.lo, static_cast<std::size_t>(b.hi - b.lo));
    comm_.all_reduce(g, comm::Reduce::avg);
  }

  Model& model_;
  Comm& comm_;
  std::vector<Bucket> buckets_;
  bool overlap_;
};

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
};

//! One data-parallel training step per call: rank r of the group takes rows [r*B/n, (r+1)*B/n) of the global
//! batch, in micro-batches; gradients are averaged over the group; every rank applies the same update, or every
//! rank skips it. A tensor-parallel model takes the same rows on each of its ranks and sums what they share itself;
//! the data-parallel group then holds one rank per tensor-parallel coordinate.
template <class Model, class Optimizer, class Comm>
class DataParallelTrainer {
 public:
  DataParallelTrainer(Model& model, Optimizer& opt, Comm& dp, const Batches& data, StepConfig cfg)
      : model_(model), opt_(opt), dp_(dp), data_(data), cfg_(cfg), ddp_(model, dp, cfg.bucket_bytes, cfg.overlap) {
    const int n = dp.size();
    LOOM_CHECK(cfg.batch % (n * cfg.micro_batches) == 0, "the global batch of ", cfg.batch,
               " sequences does not split into ", n, " data-parallel ranks x ", cfg.micro_batches,
               " micro-batches");
    rows_ = cfg.batch / n;
    micro_ = rows_ / cfg.micro_batches;
    in_.resize(static_cast<std::size_t>(micro_) * cfg.seq);
    tg_.resize(in_.size());
  }

  StepResult step(int step) {
    model_.zero_grad();
    double loss = 0;
    const int m = cfg_.micro_batches;
    for (int mb = 0; mb < m; ++mb) {
      const int row0 = dp_.rank() * rows_ + mb * micro_;
      data_.fill(step, row0, micro_, in_.data(), tg_.data());
      loss += model_.forward(in_.data(), tg_.data(), micro_, cfg_.seq, static_cast<std::uint64_t>(step), row0) / m;
      if (mb + 1 < m) model_.backward(1.0 / m);
      else ddp_.backward(1.0 / m);
    }
    std::vector<double> l{loss};
    dp_.all_reduce(l, comm::Reduce::avg);
    // The averaged gradients are the same on every rank of the group; agree on finiteness anyway, so that no rank
    // can differ. The model's norm counts each element of the whole model once (tensor-parallel ranks hold parts).
    const double norm = model_.grad_norm();
    std::vector<int> finite{std::isfinite(norm) && std::isfinite(l[0]) ? 1 : 0};
    dp_.all_reduce(finite, comm::Reduce::min);
    const double lr = optim::warmup_lr(cfg_.lr, step, cfg_.warmup);
    if (!finite[0]) return {l[0], norm, true, lr};
    optim::clip_to(model_.grads(), norm, cfg_.grad_clip, model_.ops());
    opt_.step(model_.params(), model_.grads(), lr);
    return {l[0], norm, false, lr};
  }

  const DataParallel<Model, Comm>& data_parallel() const { return ddp_; }

 private:
  Model& model_;
  Optimizer& opt_;
  Comm& dp_;
  const Batches& data_;
  StepConfig cfg_;
  DataParallel<Model, Comm> ddp_;
  int rows_ = 0, micro_ = 0;
  std::vector<std::int32_t> in_, tg_;
};

}  // namespace loom::train

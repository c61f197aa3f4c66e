// Training on a layout with pipeline parallelism (and tensor and data parallelism): each rank builds the model parts
// its pipeline stage holds (layers split evenly over the p·v parts, or as an explicit split says), runs a schedule
// table over the micro-batches of its data-parallel slice, averages each part's gradients over the data-parallel
// group as soon as its backward is done (overlapping the rest of the pipeline), sums the tied embedding's gradient
// between the stages that hold its two uses, clips by the global norm and steps every part's optimizer.
#pragma once

#include <loom/comm/context.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/pipeline/executor.hpp>
#include <loom/train/data.hpp>
#include <loom/train/data_parallel.hpp>

#include <algorithm>
#include <memory>
#include <vector>

namespace loom::train {

//! How a model is laid over the pipeline: the schedule, chunks per stage (v, for interleaved) and the blocks of
//! each of the p·v virtual stages, in pipeline order; empty: layers / (p·v) each, which must divide.
struct PipelineOptions {
  Schedule schedule = Schedule::one_f_one_b;
  int chunks = 1;
  std::vector<int> split = {};
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
  LOOM_CHECK(static_cast<int>(split.size()) == parts, "the layer split has ", split.size(), " entries but the pipeline has ",
             parts, " parts (pp x chunks)");
  for (std::size_t k = 0; k < split.size(); ++k) {
    LOOM_CHECK(split[k] >= 1, "part ", k, " of the layer split has ", split[k], " layers; each part needs at least one");
    at.push_back(at.back() + split[k]);
  }
  LOOM_CHECK(at.back() == layers, "the layer split adds up to ", at.back(), " layers but the model has ", layers);
  return at;
}

//! Trains models::Gpt<S, T, ModelLayout<Cfg>> on rank ctx of layout Cfg with `schedule` (v chunks per stage for interleaved).
template <models::GptShape S, class T, class Optimizer, class Ctx>
class PipelineTrainer {
 public:
  using Cfg = typename Ctx::config;
  using Model = models::Gpt<S, T, models::ModelLayout<Cfg>>;
  static constexpr int P = Cfg::template size<Axis::pp>;

  //! make_optimizer(specs, numel) builds one part's optimizer.
  template <class MakeOptimizer>
  PipelineTrainer(Ctx& ctx, std::uint64_t seed, models::GptOptions opt, const Batches& data, StepConfig cfg,
                  const PipelineOptions& pipe, MakeOptimizer&& make_optimizer)
      : ctx_(ctx), data_(data), cfg_(cfg), schedule_(pipe.schedule),
        table_(pipeline::make_schedule_checked(pipe.schedule, P, cfg.micro_batches, pipe.chunks)) {
    const Schedule schedule = pipe.schedule;
    const int V = pipeline::chunks_per_stage(schedule, pipe.chunks), parts = P * V;
    const std::vector<int> at = layer_bounds(S.layers, parts, pipe.split);
    const int dp = Cfg::template size<Axis::dp>;
    LOOM_CHECK(cfg.batch % (dp * cfg.micro_batches) == 0, "the global batch of ", cfg.batch,
               " sequences does not split into ", dp, " data-parallel ranks x ", cfg.micro_batches,
               " micro-batches");
    rows_ = cfg.batch / dp;
    micro_ = rows_ / cfg.micro_batches;
    const int stage = ctx.template coord<Axis::pp>();
    auto& tp = ctx.template comm<Axis::tp>();
    for (int c = 0; c < V; ++c) {
      const int k = pipeline::virtual_stage(schedule, P, stage, c);
      parts_.push_back(std::make_unique<Model>(seed, tp, models::GptPart{at[std::size_t(k)], at[std::size_t(k) + 1]}, opt));
      opts_.push_back(make_optimizer(parts_.back()->specs(), parts_.back()->params().numel()));
    }
    std::vector<Model*> raw;
    for (auto& p : parts_) raw.push_back(p.get());
    exec_ = std::make_unique<pipeline::Executor<Model, typename Ctx::Comm>>(raw, ctx.template comm<Axis::pp>(),
                                                                           schedule);
    exec_->prepare(table_);  // verified here, once, not at every step
    // The stages holding the first part (embedding) and the last (output layer) share the tied table.
    first_stage_ = pipeline::stage_chunk(schedule, P, 0).stage;
    last_stage_ = pipeline::stage_chunk(schedule, P, parts - 1).stage;
    in_.resize(static_cast<std::size_t>(cfg.micro_batches));
    tg_.resize(in_.size());
  }

  const std::vector<std::unique_ptr<Model>>& parts() const { return parts_; }
  const std::vector<Optimizer>& optimizers() const { return opts_; }

  std::vector<Optimizer>& optimizers() { return opts_; }

  StepResult step(int step) {
    for (auto& p : parts_) p->zero_grad();
    const int dp_rank = ctx_.template coord<Axis::dp>();
    // Data only where it is needed: token ids for the embedding, targets for the loss.
    const bool needs_data = std::any_of(parts_.begin(), parts_.end(), [](auto& p) { return p->embedding() || p->head(); });
    for (int i = 0; needs_data && i < cfg_.micro_batches; ++i) {
      auto& in = in_[static_cast<std::size_t>(i)];
      auto& tg = tg_[static_cast<std::size_t>(i)];
      in.resize(static_cast<std::size_t>(micro_) * cfg_.seq);
      tg.resize(in.size());
      data_.fill(step, dp_rank * rows_ + i * micro_, micro_, in.data(), tg.data());
    }
    // Each part's gradients are averaged over data parallelism as soon as its last backward is done, while this
    // stage (and the others) compute on; the tied table's sum over its two holders follows the average (both are
    // sums over other ranks, so their order does not matter).
    auto& dp = ctx_.template comm<Axis::dp>();
    std::vector<comm::Handle> averaging;
    double loss = exec_->run(
        table_,
        [&](int i) {
          const auto u = static_cast<std::size_t>(i);
          return typename Model::MicroBatch{needs_data ? in_[u].data() : nullptr,
                                            needs_data ? tg_[u].data() : nullptr, micro_, cfg_.seq,
                                            static_cast<std::uint64_t>(step), dp_rank * rows_ + i * micro_};
        },
        [&](int chunk) {
          if (dp.size() > 1)
            averaging.push_back(dp.all_reduce_async(parts_[std::size_t(chunk)]->grads().span(), comm::Reduce::avg));
        });
    {
      trace::Scope span("wait for data-parallel averages", "comm");
      for (auto& h : averaging) h.wait();
    }
    reduce_tied();
    // The loss lives on the last stage: sum over the pipeline, average over data parallelism.
    std::vector<double> l{loss};
    ctx_.template comm<Axis::pp>().all_reduce(l, comm::Reduce::sum);
    dp.all_reduce(l, comm::Reduce::avg);
    // The global norm: every part once, the tied table on the first stage only.
    double sq = 0;
    for (auto& p : parts_) sq += p->grad_square(/*skip_tied=*/!p->embedding());
    std::vector<double> s{sq};
    ctx_.template comm<Axis::pp>().all_reduce(s, comm::Reduce::sum);
    const double norm = std::sqrt(s[0]);
    // Every rank skips the update, or none does (StepResult).
    std::vector<int> finite{std::isfinite(norm) && std::isfinite(l[0]) ? 1 : 0};
    ctx_.world().all_reduce(finite, comm::Reduce::min);
    const double lr = optim::warmup_lr(cfg_.lr, step, cfg_.warmup);
    if (!finite[0]) return {l[0], norm, true, lr};
    for (std::size_t c = 0; c < parts_.size(); ++c) {
      optim::clip_to(parts_[c]->grads(), norm, cfg_.grad_clip);
      opts_[c].step(parts_[c]->params(), parts_[c]->grads(), lr);
    }
    return {l[0], norm, false, lr};
  }

  //! A buffer laid out as the whole model's parameters, put together from every stage's parts: gather(c) gives part
  //! c's (zero where it holds nothing); the tied table is taken from the part with the embedding. A collective over
  //! the pipeline group (and, through gather, the tensor-parallel group).
  template <class U, class Gather>
  std::vector<U> assemble(Gather&& gather) {
    std::vector<U> whole(static_cast<std::size_t>(S.params()), U(0));
    const auto global = Model::param_specs(0, true);
    for (std::size_t c = 0; c < parts_.size(); ++c) {
      const auto g = gather(c);
      for (const auto& s : parts_[c]->specs()) {
        if (s.index == 0 && !parts_[c]->embedding()) continue;  // the tied table's second holder
        const auto& at = global[s.index];
        std::copy_n(g.begin() + at.offset, numel_of(at.shape), whole.begin() + at.offset);
      }
    }
    ctx_.template comm<Axis::pp>().all_reduce(whole, comm::Reduce::sum);
    return whole;
  }

 private:
  //! Sums the tied table's gradient over its two holders: two chunks of one stage, or the first and last stages
  //! (same tensor-parallel and data-parallel coordinates).
  void reduce_tied() {
    std::vector<std::span<T>> held;
    for (auto& p : parts_)
      if (auto g = p->tied_grad(); !g.empty()) held.push_back(g);
    if (held.empty()) return;
    if (first_stage_ == last_stage_) {  // both uses on this stage (a one-stage pipeline holds one part)
      if (held.size() == 2) {
        for (std::size_t i = 0; i < held[0].size(); ++i) held[0][i] += held[1][i];
        std::copy(held[0].begin(), held[0].end(), held[1].begin());
      }
      return;
    }
    Coords a = Cfg::coords(ctx_.rank()), b = a;
    a.pp = first_stage_, b.pp = last_stage_;
    std::vector<int> ranks{Cfg::rank_of(a), Cfg::rank_of(b)};
    std::sort(ranks.begin(), ranks.end());
    ctx_.get(comm::GroupInfo{"embedding", ranks}).all_reduce(held[0], comm::Reduce::sum);
  }

  Ctx& ctx_;
  const Batches& data_;
  StepConfig cfg_;
  Schedule schedule_;
  pipeline::RuntimeTable table_;
  std::vector<std::unique_ptr<Model>> parts_;
  std::vector<Optimizer> opts_;
  std::unique_ptr<pipeline::Executor<Model, typename Ctx::Comm>> exec_;
  int first_stage_ = 0, last_stage_ = 0, rows_ = 0, micro_ = 0;
  std::vector<std::vector<std::int32_t>> in_, tg_;
};

}  // namespace loom::train

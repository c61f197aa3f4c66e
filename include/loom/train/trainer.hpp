// One trainer for every layout: Trainer<Cfg, Model, Optimizer> trains a model on rank ctx of layout Cfg, whatever
// axes Cfg has. The type decides: without a pipeline axis the rank holds its tensor-parallel part of the whole
// model, runs its micro-batches one after the other and averages gradients over data parallelism bucket by bucket
// during the last backward; with one it holds the parts its stage holds (layers split evenly over the p·v virtual
// stages, or as an explicit split says), runs the schedule PP<p, Schedule, Interleaved<v>> names over its
// micro-batches, averages each part's gradients as soon as its backward is done, and sums the tied embedding's
// gradient between the stages that hold its two uses. Then, for every layout alike: the loss over the global batch,
// the global gradient norm (each element once), a step skipped on every rank when either is not finite, clipping,
// and every part's optimizer step. By concern: what the trainer needs of a model and an optimizer
// (train/concepts.hpp), the rank's groups and place from the mesh (train/rank_in_layout.hpp), the step and what
// checkpoints read of it (train/step.hpp); this header builds the trainer from them.
#pragma once

#include <loom/comm/context.hpp>
#include <loom/config.hpp>
#include <loom/models/part.hpp>
#include <loom/train/concepts.hpp>
#include <loom/train/rank_in_layout.hpp>
#include <loom/train/step.hpp>

#include <algorithm>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

namespace loom::train {

//! A trainer whatever its layout: built from a rank's RankInLayout (or, through Trainer<Cfg, ...>, from its context),
//! for code that runs and checkpoints a training without depending on the layout's type, and so is compiled once for
//! a model, optimizer and backend, not once per layout.
template <class Model, class Optimizer>
class TrainerOf {
 public:
  //! What the trainer builds and steps (part_of_t): Model::part_type where Model names one, else Model.
  using Part = part_of_t<Model>;
  static_assert(ModelRequirements<Part>::ok,
                "loom: the model does not have what the trainer needs (train::TrainableModel)");
  static_assert(TrainerOptimizer<Optimizer, Part>,
                "loom: the optimizer does not step the model's parameters (opt.step(params, grads, lr))");
  using T = typename Part::value_type;
  using Dev = typename Part::device;
  using acc = loom::acc_t<T>;
  using Shape = typename Part::Shape;
  //! The trainer's options: the seed, the model's Options, the step, a layer split.
  using Options = TrainerOptions<typename Part::Options>;

  //! Builds this rank's model parts (from options.seed: the same whole model on every layout) and, with
  //! make_optimizer(specs, numel), one optimizer per part. Checks what the type cannot: that the global batch
  //! splits over data parallelism and micro-batches, that the micro-batch count fits the schedule, that the layers
  //! split over the virtual stages. For a model whose type fixes its shape (Model::static_shape), each part built
  //! as Model(seed, tp, cp, ep, part, options.model) (BuildableModel).
  template <class Comm, bool Pipelined, int Zero, class MakeOptimizer>
    requires detail::FixesShape<Model>
  TrainerOf(const RankInLayout<Comm, Pipelined, Zero>& at, const DataSource& data, const Options& options,
            MakeOptimizer&& make_optimizer)
      : TrainerOf(Shape(Model::static_shape), at, data, options, std::forward<MakeOptimizer>(make_optimizer), 0) {}
  //! The same for a model of shape `shape` given at run time (models::GptModel), built as Model(shape, seed, tp, cp,
  //! ep, part, options.model).
  template <class Comm, bool Pipelined, int Zero, class MakeOptimizer>
    requires(!detail::FixesShape<Model>)
  TrainerOf(const Shape& shape, const RankInLayout<Comm, Pipelined, Zero>& at, const DataSource& data,
            const Options& options, MakeOptimizer&& make_optimizer)
      : TrainerOf(shape, at, data, options, std::forward<MakeOptimizer>(make_optimizer), 0) {}

  //! Optimizer step `step` (it keys the batch and dropout): forward and backward of every micro-batch, gradients
  //! averaged and clipped, the update; or, when the loss or gradient norm is not finite on some rank, no update on
  //! any rank.
  StepResult step(int step) { return core_->step(step); }
  //! The loss of global batch `batch` of `data` (validation: the mean over its sequences, the same on every rank and
  //! every layout), the model and the optimizer unchanged: the step's forwards alone without a pipeline, the
  //! schedule's forwards and backwards without the update with one. A collective over the world, as a step is.
  double evaluate(const DataSource& data, std::int64_t batch) { return core_->evaluate(data, batch); }

  //! This rank's model parts: one without pipeline parallelism, the stage's chunks with it.
  const std::vector<Part*>& parts() const { return parts_; }
  //! The whole model's shape.
  const Shape& shape() const { return parts_.front()->shape(); }
  //! The model, where this rank holds one part.
  Part& model() {
    LOOM_CHECK(parts_.size() == 1, "model(): this rank holds ", parts_.size(), " parts (parts())");
    return *parts_.front();
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
  //! Part c's gather (the single-rank layout, in host memory) of a buffer in host memory laid out as the part's
  //! flat parameters: a part gathers from its device's memory, so on a device the buffer goes there first.
  template <class U>
  std::vector<U> gather_from_host(std::size_t c, const std::vector<U>& flat) {
    Part& part = *parts_[c];
    if constexpr (kernels::is_host_v<Dev>) {
      return part.gather(flat.data());
    } else {
      const Tensor<U, Dev> on({static_cast<std::int64_t>(flat.size())});
      part.ops().from_host(flat.data(), on.data(), flat.size());
      return part.gather(on.data());
    }
  }
  //! Part c's scatter of `whole` (the single-rank layout, in host memory) into a buffer in host memory laid out as
  //! the part's flat parameters: a part scatters into its device's memory, so on a device it comes back from there.
  template <class U>
  std::vector<U> scatter_to_host(std::size_t c, const U* whole) {
    Part& part = *parts_[c];
    std::vector<U> flat(static_cast<std::size_t>(part.params().numel()));
    if constexpr (kernels::is_host_v<Dev>) {
      part.scatter(whole, flat.data());
    } else {
      const Tensor<U, Dev> on({static_cast<std::int64_t>(flat.size())});
      part.scatter(whole, on.data());
      part.ops().to_host(on.data(), flat.data(), flat.size());
    }
    return flat;
  }
  //! This rank in the world, the world's size, and a barrier over it.
  int world_rank() const { return core_->world_rank(); }
  int world_size() const { return core_->world_size(); }
  void barrier() { core_->barrier(); }

  //! A buffer laid out as the whole model's parameters, put together from every stage's parts: gather(c) gives part
  //! c's (zero where it holds nothing); the tied table is taken from the part with the embedding. A collective over
  //! the pipeline group (and, through gather, the tensor-parallel group).
  template <class U, class Gather>
  std::vector<U> assemble(Gather&& gather) {
    const auto& parts = parts_;
    if (!pipelined_) return gather(0);
    const auto global = parts.front()->param_specs(0, true);
    std::vector<U> whole(static_cast<std::size_t>(layers::numel_of_table(global)), U(0));
    for (std::size_t c = 0; c < parts.size(); ++c) {
      const auto g = gather(c);
      for (const auto& s : parts[c]->specs()) {
        if (second_holder(*parts[c], s)) continue;  // a tied table counts on the part with the embedding
        const auto& at = global[s.index];
        std::copy_n(g.begin() + at.offset, numel_of(at.shape), whole.begin() + at.offset);
      }
    }
    if constexpr (std::is_same_v<U, T>) core_->sum_over_pipeline(std::span<U>(whole));
    else core_->sum_state_over_pipeline(std::span<U>(whole));
    return whole;
  }

  //! The whole model's parameters in the single-rank layout, from every rank's parts (under ZeRO-3 from the
  //! data-parallel ranks' chunks): a collective over the tensor- and pipeline-parallel groups (and, under ZeRO-3, the
  //! data-parallel group).
  std::vector<T> whole_params() {
    return assemble<T>([&](std::size_t c) {
      auto& part = *parts_[c];
      if (zero_ < 3) return part.gather(part.params().data());
      return gather_from_host(c, params_of_part(c));
    });
  }

 private:
  //! Whether parameter s of `part` is a table tied between the input and the output that this part (one without the
  //! embedding) holds for its output layer: the part with the embedding holds it too.
  static bool second_holder(Part& part, const layers::ParamSpec& s) {
    const auto tied = part.tied_grad();
    return !part.embedding() && !tied.empty() && tied.data() == part.grads().data() + s.offset;
  }

  //! Builds over comm::AnyComm whatever the layout's communicators are, so that one step serves every backend (and
  //! loom::cpu_kernels holds it, detail::CoreOf); the communicators wrapped live as long as the trainer.
  template <class Comm, bool Pipelined, int Zero, class MakeOptimizer>
  TrainerOf(const Shape& shape, const RankInLayout<Comm, Pipelined, Zero>& at, const DataSource& data,
            const Options& options, MakeOptimizer&& make_optimizer, int)
      : pipelined_(Pipelined), zero_(Zero) {
    if constexpr (std::is_same_v<Comm, comm::AnyComm>) {
      build(shape, at, data, options, make_optimizer);
    } else {
      auto any = std::make_shared<AnyRankInLayout<Pipelined, Zero>>(at);
      wrapped_ = any;
      build(shape, any->get(), data, options, make_optimizer);
    }
  }

  template <bool Pipelined, int Zero, class MakeOptimizer>
  void build(const Shape& shape, const RankInLayout<comm::AnyComm, Pipelined, Zero>& at, const DataSource& data,
             const Options& options, MakeOptimizer& make_optimizer) {
    using Comm = comm::AnyComm;
    static_assert(BuildableModel<Model, Comm>,
                  "loom: the trainer builds each part of the model as Model(seed, tp, cp, ep, part, options) when "
                  "the type fixes its shape (Model::static_shape), else as Model(shape, seed, tp, cp, ep, part, "
                  "options): tp the tensor-parallel communicator, cp and ep the context- and expert-parallel ones "
                  "(null where the layout has none), part a models::Part (train::BuildableModel)");
    static_assert(Zero < 3 || UnitModel<Part>,
                  "loom: DP<n, ZeRO<3>> needs a model that runs in units (train::UnitModel: param_units, "
                  "forward_units, forward_unit, ...)");
    constexpr int tp = Part::config::template size<Axis::tp>;
    LOOM_CHECK(at.tp->size() == tp, "the model is split over ", tp, " tensor-parallel ranks but the layout's "
               "tensor-parallel group has ", at.tp->size());
    // Under ZeRO-3 over several ranks each rank writes only its shard of the parameters (TrainerCore).
    typename Part::Options model = detail::trained_options(options.model);
    if constexpr (Zero >= 3) model.write_buffers = (at.shard ? at.shard : at.dp)->size() == 1;
    constexpr int cp = Part::config::template size<Axis::cp>;
    LOOM_CHECK(cp == 1 || at.cp, "the model is split over ", cp, " context-parallel ranks but the rank was given no "
               "context-parallel group (RankInLayout::cp)");
    LOOM_CHECK(at.ep_size == 1 || (at.ep && at.edp && at.ep->size() == at.ep_size), "the layout splits the experts "
               "over ", at.ep_size, " expert-parallel ranks but the rank was given ",
               at.ep ? "a group of " + std::to_string(at.ep->size()) : std::string("no expert-parallel groups"),
               " (RankInLayout::ep, edp)");
    Comm* ep = at.ep_size > 1 ? at.ep : nullptr;
    const detail::PartFactory<T, Dev> make_part = [&](models::Part part) {
      std::unique_ptr<Part> m;
      if constexpr (detail::FixesShape<Model>)
        m = std::make_unique<Model>(options.seed, *at.tp, at.cp, ep, part, model);
      else
        m = std::make_unique<Model>(shape, options.seed, *at.tp, at.cp, ep, part, model);
      parts_.push_back(m.get());
      return std::make_unique<AnyPartOf<Part>>(std::move(m));
    };
    detail::OptimizerFactory<Optimizer> make_opt;
    if constexpr (Zero > 0)
      make_opt.shard = [&](const std::vector<optim::Slice>& s, std::int64_t n) -> Optimizer {
        return make_optimizer(s, n);
      };
    else
      make_opt.whole = [&](const std::vector<layers::ParamSpec>& s, std::int64_t n) -> Optimizer {
        return make_optimizer(s, n);
      };
    core_ = detail::CoreOf<T, Dev, Optimizer, Comm, Pipelined, Zero>::make(
        at, data, detail::CoreOptions{options.seed, options.step, options.split}, static_cast<int>(shape.layers),
        make_part, make_opt);
  }

  std::shared_ptr<const void> wrapped_;  //!< the layout's communicators over comm::AnyComm, where they were others
  std::vector<Part*> parts_;             //!< core_'s parts, as the model's own type
  std::unique_ptr<detail::TrainerBase<AnyPart<T, Dev>, Optimizer>> core_;
  bool pipelined_;
  int zero_;
};

namespace detail {
//! Whether Model meets every rule of layout Cfg: a model that states them (Model::fits_layout<Cfg>, models::Gpt's
//! checks its shape against the whole layout at compile time) is held to its own; any other model is refused expert
//! parallelism, which only a model with experts can use.
template <class Model, class Cfg>
constexpr bool fits_layout() {
  if constexpr (requires { Model::template fits_layout<Cfg>; }) {
    return Model::template fits_layout<Cfg>;
  } else {
    static_assert(Cfg::template size<Axis::ep> == 1,
                  "loom: EP<n> (n > 1) needs a model with experts, one that states the layouts it fits "
                  "(Model::fits_layout<Cfg>)");
    return true;
  }
}
}  // namespace detail

//! Trains Model (a train::TrainableModel on model layout ModelLayout<Cfg>: models::Gpt<S, T, ModelLayout<Cfg>, Dev>,
//! or a model of one's own) on one rank of layout Cfg with Optimizer. The layout type
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

  using Options = typename TrainerOf<Model, Optimizer>::Options;

  template <class Backend, class MakeOptimizer>
  Trainer(Context<Cfg, Backend>& ctx, const DataSource& data, const Options& options, MakeOptimizer&& make_optimizer)
      : TrainerOf<Model, Optimizer>(rank_in_layout(ctx), data, options, std::forward<MakeOptimizer>(make_optimizer)) {}
};

}  // namespace loom::train

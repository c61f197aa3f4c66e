// What the trainer needs of a model and of an optimizer: the concepts, each requirement also asserted on its own with
// a message naming the member (ModelRequirements), how the trainer builds a part of a model (BuildableModel), and the
// part a trainer builds for a model type. Any model that has these members trains on every layout its type allows;
// the library's transformers (models::Gpt) are one such model, docs/your-own-model.md writes another.
#pragma once

#include <loom/layers/param.hpp>
#include <loom/models/part.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

namespace loom::train {

//! What the trainer, the pipeline executor, DDP and ZeRO-1/2 and checkpoints need of a part of a model (ZeRO-3 needs
//! UnitModel besides). Parameters live in one flat buffer per part (params(), grads()) described by its parameter
//! table (specs(): names, shapes, offsets, placements over the tensor-parallel group; param_specs(0, true): the whole
//! model's); activations live in slots, one per micro-batch in flight, and every call names the slot it works on:
//! forward(slot, mb, input) keeps what backward needs there, output(slot) is the part's output and input_grad(slot)
//! the gradient of its input after that slot's backward (nothing is shared between slots). backward runs in chunks
//! (backward_chunk), each returning the parameters whose gradients it completed, so that data parallelism reduces
//! them while the rest computes; backward_inputs and backward_weights are the two halves zero-bubble schedules
//! run apart. shape() is the whole model's (shape().layers: the blocks a pipeline splits), flops_per_token(seq) the
//! whole model's training FLOPs per token. gather and scatter move a buffer laid out as the part's parameters to and
//! from the whole model's layout (a collective over the tensor-parallel group).
namespace detail {
//! What the trainer keeps of a model part (its parameter table, buffers and operations) it keeps by reference.
template <class M>
concept HeldByReference = requires(M& m, const M& cm) {
  requires std::is_lvalue_reference_v<decltype(cm.specs())>;
  requires std::is_lvalue_reference_v<decltype(m.params())>;
  requires std::is_lvalue_reference_v<decltype(m.grads())>;
  requires std::is_lvalue_reference_v<decltype(cm.ops())>;
};
}  // namespace detail

template <class M>
concept TrainableModel = requires(M& m, const M& cm, int i, double s, const typename M::value_type* p,
                                  typename M::value_type* q, const typename M::MicroBatch& mb,
                                  const std::int32_t* ids) {
  typename M::value_type;
  typename M::device;
  typename M::Shape;
  typename M::Options;
  typename M::config;
  typename M::ParamRange;
  { M::no_param } -> std::convertible_to<std::size_t>;
  { typename M::MicroBatch{ids, ids, i, i, std::uint64_t{}, std::int64_t{}} };
  { cm.shape() } -> std::convertible_to<const typename M::Shape&>;
  { cm.shape().layers } -> std::convertible_to<int>;
  { cm.options() } -> std::convertible_to<const typename M::Options&>;
  { cm.flops_per_token(i) } -> std::convertible_to<double>;
  { m.forward(i, mb, p) } -> std::convertible_to<double>;
  m.backward(i, s, p);
  m.backward_inputs(i, s, p);
  m.backward_weights(i);
  { m.backward_chunks() } -> std::convertible_to<int>;
  { m.backward_chunk(i, i, s) } -> std::same_as<typename M::ParamRange>;
  { cm.output(i) } -> std::convertible_to<const typename M::value_type*>;
  { cm.input_grad(i) } -> std::convertible_to<const typename M::value_type*>;
  { cm.slots() } -> std::convertible_to<int>;
  m.set_slots(i);
  m.zero_grad();
  { m.grad_square(true) } -> std::convertible_to<double>;
  { m.tied_grad() } -> std::convertible_to<std::span<typename M::value_type>>;
  { cm.embedding() } -> std::convertible_to<bool>;
  { cm.head() } -> std::convertible_to<bool>;
  { cm.specs() } -> std::convertible_to<const std::vector<layers::ParamSpec>&>;
  { cm.param_specs(i, true) } -> std::convertible_to<std::vector<layers::ParamSpec>>;
  m.params();
  m.grads();
  cm.ops();
  requires detail::HeldByReference<M>;
  { cm.io_elements(i, i) } -> std::convertible_to<std::size_t>;
  { m.gather(p) } -> std::convertible_to<std::vector<typename M::value_type>>;
  cm.scatter(p, q);
};

//! How the trainer builds each part of Model on a rank: from the whole model's shape (or, for a model whose type
//! fixes it, Model::static_shape), the seed (the same whole model on every layout), the tensor-parallel
//! communicator, the context- and expert-parallel ones (null where the layout has none), the blocks the part holds
//! and the model's options.
namespace detail {
template <class Model, class Comm>
concept BuiltFromSeed = requires(std::uint64_t seed, Comm& tp, Comm* cp, Comm* ep, models::Part part,
                                 const typename Model::Options& o) { Model(seed, tp, cp, ep, part, o); };
template <class Model, class Comm>
concept BuiltFromShape = requires(const typename Model::Shape& shape, std::uint64_t seed, Comm& tp, Comm* cp,
                                  Comm* ep, models::Part part, const typename Model::Options& o) {
  Model(shape, seed, tp, cp, ep, part, o);
};
template <class Model>
concept FixesShape = requires { Model::static_shape; };
//! The model's options as the trainer builds its parts with them: a model that can leave its loss's gradient in
//! the logits at forward does (the trainer never reads the logits).
template <class Options>
Options trained_options(Options o) {
  if constexpr (requires { o.loss_gradient_in_forward = true; }) o.loss_gradient_in_forward = true;
  return o;
}
}  // namespace detail

template <class Model, class Comm>
concept BuildableModel = (detail::FixesShape<Model> && detail::BuiltFromSeed<Model, Comm>) ||
                         (!detail::FixesShape<Model> && detail::BuiltFromShape<Model, Comm>);

//! What a trainer builds and steps for Model: Model::part_type where Model names one for itself (part_type_for is
//! Model: models::Gpt<S, ...> names the shape-free models::GptModel, the same code for every shape), else Model
//! itself (a type derived from Gpt among them).
template <class M>
struct PartOf {
  using type = M;
};
template <class M>
  requires std::same_as<typename M::part_type_for, M>
struct PartOf<M> {
  using type = typename M::part_type;
};
template <class M>
using part_of_t = typename PartOf<M>::type;

//! What an optimizer needs to offer the trainer.
template <class O, class Model>
concept TrainerOptimizer = requires(O& o, Model& m, double lr) { o.step(m.params(), m.grads(), lr); };

//! Each requirement of TrainableModel on its own, with a message that names the member: what the trainer asserts,
//! so that a model that falls short is told what it lacks, not only that it does.
template <class M>
struct ModelRequirements {
  static_assert(requires { typename M::value_type; typename M::device; },
                "loom: the model has no value_type (the type of its parameters) or device (Host or Cuda) "
                "(train::TrainableModel)");
  static_assert(requires { typename M::Options; typename M::config; },
                "loom: the model has no Options (how it is built) or config (its model layout, "
                "models::ModelLayout<Cfg>) (train::TrainableModel)");
  static_assert(requires(const std::int32_t* ids, int i) {
                  typename M::ParamRange;
                  M::no_param;
                  { typename M::MicroBatch{ids, ids, i, i, std::uint64_t{}, std::int64_t{}} };
                },
                "loom: the model has no MicroBatch{ids, targets, batch, seq, step, row0}, ParamRange or no_param "
                "(train::TrainableModel)");
  static_assert(requires(const M& cm, int i) {
                  typename M::Shape;
                  { cm.shape() } -> std::convertible_to<const typename M::Shape&>;
                  { cm.shape().layers } -> std::convertible_to<int>;
                  { cm.options() } -> std::convertible_to<const typename M::Options&>;
                  { cm.flops_per_token(i) } -> std::convertible_to<double>;
                },
                "loom: the model has no Shape, shape() (with shape().layers, the blocks a pipeline splits), "
                "options() or flops_per_token(seq) (train::TrainableModel)");
  static_assert(requires(M& m, int i, const typename M::MicroBatch& mb, const typename M::value_type* p) {
                  { m.forward(i, mb, p) } -> std::convertible_to<double>;
                },
                "loom: the model has no forward(slot, micro_batch, input) returning the loss (train::TrainableModel)");
  static_assert(requires(M& m, int i, double s, const typename M::value_type* p) {
                  m.backward(i, s, p);
                  m.backward_inputs(i, s, p);
                  m.backward_weights(i);
                },
                "loom: the model has no backward(slot, scale, doutput), backward_inputs(slot, scale, doutput) or "
                "backward_weights(slot) (train::TrainableModel)");
  static_assert(requires(M& m, int i, double s) {
                  { m.backward_chunks() } -> std::convertible_to<int>;
                  { m.backward_chunk(i, i, s) } -> std::same_as<typename M::ParamRange>;
                },
                "loom: the model's backward_chunk(slot, chunk, scale) must return the ParamRange whose gradients it "
                "completed, and backward_chunks() their count (train::TrainableModel)");
  static_assert(requires(M& m, const M& cm, int i) {
                  { cm.output(i) } -> std::convertible_to<const typename M::value_type*>;
                  { cm.input_grad(i) } -> std::convertible_to<const typename M::value_type*>;
                  { cm.io_elements(i, i) } -> std::convertible_to<std::size_t>;
                  { cm.slots() } -> std::convertible_to<int>;
                  m.set_slots(i);
                },
                "loom: the model has no output(slot), input_grad(slot), io_elements(batch, seq), slots() or "
                "set_slots(n): what a pipeline passes between stages (train::TrainableModel)");
  static_assert(requires(M& m, const M& cm) {
                  m.zero_grad();
                  { m.grad_square(true) } -> std::convertible_to<double>;
                  { m.tied_grad() } -> std::convertible_to<std::span<typename M::value_type>>;
                  { cm.embedding() } -> std::convertible_to<bool>;
                  { cm.head() } -> std::convertible_to<bool>;
                },
                "loom: the model has no zero_grad(), grad_square(skip_tied), tied_grad(), embedding() or head() "
                "(train::TrainableModel)");
  static_assert(requires(M& m, const M& cm, int i) {
                  { cm.specs() } -> std::convertible_to<const std::vector<layers::ParamSpec>&>;
                  { cm.param_specs(i, true) } -> std::convertible_to<std::vector<layers::ParamSpec>>;
                  m.params();
                  m.grads();
                  cm.ops();
                },
                "loom: the model has no specs() (its parameter table), param_specs(tp_rank, global), params(), "
                "grads() or ops() (train::TrainableModel)");
  static_assert(detail::HeldByReference<M>,
                "loom: the model's specs(), params(), grads() and ops() must return references to what it holds, "
                "not values: the trainer keeps them (train::TrainableModel)");
  static_assert(requires(M& m, const M& cm, const typename M::value_type* p, typename M::value_type* q) {
                  { m.gather(p) } -> std::convertible_to<std::vector<typename M::value_type>>;
                  cm.scatter(p, q);
                },
                "loom: the model has no gather(local) or scatter(whole, local): a buffer laid out as the part's "
                "parameters to and from the whole model's layout (train::TrainableModel)");
  static constexpr bool ok = TrainableModel<M>;
};

}  // namespace loom::train

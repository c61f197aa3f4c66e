// What the trainer needs of a model and of an optimizer: the concepts, each requirement also asserted on its own with
// a message naming the member (ModelRequirements), and the part a trainer builds for a model type.
#pragma once

#include <loom/models/gpt.hpp>

#include <concepts>
#include <cstddef>
#include <span>

namespace loom::train {

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

//! Each requirement of TrainableModel on its own, with a message that names the member: what the trainer asserts,
//! so that a model that falls short is told what it lacks, not only that it does.
template <class M>
struct ModelRequirements {
  static_assert(requires { typename M::value_type; },
                "loom: the model has no value_type, the type of its parameters (train::TrainableModel)");
  static_assert(requires { typename M::Options; typename M::config; },
                "loom: the model has no Options (how it is built) or config (its model layout) (train::TrainableModel)");
  static_assert(requires { typename M::MicroBatch; typename M::ParamRange; M::no_param; },
                "loom: the model has no MicroBatch, ParamRange or no_param (train::TrainableModel)");
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
                  { cm.input_grad() } -> std::convertible_to<const typename M::value_type*>;
                  { cm.io_elements(i, i) } -> std::convertible_to<std::size_t>;
                  { cm.slots() } -> std::convertible_to<int>;
                  m.set_slots(i);
                },
                "loom: the model has no output(slot), input_grad(), io_elements(batch, seq), slots() or "
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
  static_assert(requires(M& m, const M& cm) {
                  cm.specs();
                  m.params();
                  m.grads();
                  cm.ops();
                },
                "loom: the model has no specs() (its parameter table), params(), grads() or ops() "
                "(train::TrainableModel)");
  static constexpr bool ok = TrainableModel<M>;
};

}  // namespace loom::train

// A model part behind virtual calls: train::AnyPart<T, Dev> is what the step, the pipeline executor, DDP and ZeRO see
// of a model, whatever the model is, so that they are compiled once per element type, device, optimizer and trainer
// kind (loom::cpu_kernels holds them for the host: src/trainer_*.cpp), not once per model and model layout.
// train::AnyPartOf<Model> wraps one part of a concrete model (a train::TrainableModel) and forwards every call to it;
// a call costs one indirect jump, against a forward or backward of whole layers.
#pragma once

#include <loom/kernels/ops.hpp>
#include <loom/layers/moe.hpp>
#include <loom/layers/param.hpp>
#include <loom/models/part.hpp>
#include <loom/tensor/tensor.hpp>
#include <loom/train/concepts.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::train {

//! One part of a model as the trainer steps it (every member of train::TrainableModel the step uses, and
//! train::UnitModel's for ZeRO-3), on element type T and device Dev. Built by AnyPartOf<Model> around a part of
//! a concrete model; what the model's own type adds (its shape, its checkpoint files) stays with the concrete part.
template <class T, class Dev>
class AnyPart {
 public:
  using value_type = T;
  using device = Dev;
  using ParamRange = models::ParamRange;
  static constexpr std::size_t no_param = models::no_param;
  //! A micro-batch as every TrainableModel takes one (a model's own MicroBatch has the same members).
  using MicroBatch = models::MicroBatch;
  //! What ZeRO-3 reads of the model's options: whether the part wrote its buffers when it was built.
  struct Options {
    bool write_buffers = true;
  };

  virtual ~AnyPart() = default;

  virtual double forward(int slot, const MicroBatch& mb, const T* input = nullptr) = 0;
  virtual void backward(int slot, double scale, const T* doutput = nullptr) = 0;
  virtual void backward_inputs(int slot, double scale, const T* doutput = nullptr) = 0;
  virtual void backward_weights(int slot) = 0;
  virtual int backward_chunks() const = 0;
  virtual ParamRange backward_chunk(int slot, int c, double scale = 1.0) = 0;
  //! The parameters backward chunk c writes (a model that does not say: every parameter, at chunk 0).
  virtual ParamRange backward_chunk_writes(int c) const = 0;
  virtual const T* output(int slot) const = 0;
  virtual const T* input_grad(int slot) const = 0;
  virtual std::size_t io_elements(int batch, int seq) const = 0;
  virtual int slots() const = 0;
  virtual void set_slots(int n) = 0;

  virtual void zero_grad() = 0;
  virtual double grad_square(bool skip_tied = false) = 0;
  virtual std::span<T> tied_grad() = 0;
  virtual bool embedding() const = 0;
  virtual bool head() const = 0;
  virtual const std::vector<layers::ParamSpec>& specs() const = 0;
  virtual const Tensor<T, Dev>& params() const = 0;
  virtual const Tensor<T, Dev>& grads() const = 0;
  virtual const kernels::Ops<Dev>& ops() const = 0;

  //! Whether the model has experts, and what its mixtures of experts routed since the last call.
  virtual bool has_experts() const = 0;
  virtual layers::MoeStats take_moe_stats() = 0;

  // train::UnitModel, for ZeRO-3 (a model without units throws: the trainer refuses ZeRO-3 for it at compile time).
  virtual const Options& options() const = 0;
  virtual void initialise(std::uint64_t seed, std::int64_t lo, std::int64_t hi) = 0;
  virtual std::vector<ParamRange> param_units() const = 0;
  virtual int forward_units() const = 0;
  virtual ParamRange forward_unit_reads(int u) const = 0;
  virtual ParamRange backward_chunk_reads(int c) const = 0;
  virtual void forward_begin(int slot, const MicroBatch& mb, const T* input) = 0;
  virtual double forward_unit(int slot, int u) = 0;
};

//! What ZeRO-3 needs of a model part beside what the trainer does: its parameters in units (param_units), a forward
//! run unit by unit, which parameters each forward unit and backward chunk reads, and a part built without writing
//! its buffers (options().write_buffers false) whose shard each rank initialises (initialise(seed, lo, hi)).
//! models::GptModel has it.
template <class M>
concept UnitModel = requires(M& m, const M& cm, int i, const typename M::MicroBatch& mb,
                             const typename M::value_type* p, std::uint64_t seed, std::int64_t lo) {
  { cm.options().write_buffers } -> std::convertible_to<bool>;
  m.initialise(seed, lo, lo);
  { cm.param_units() } -> std::convertible_to<std::vector<typename M::ParamRange>>;
  { cm.forward_units() } -> std::convertible_to<int>;
  { cm.forward_unit_reads(i) } -> std::same_as<typename M::ParamRange>;
  { cm.backward_chunk_reads(i) } -> std::same_as<typename M::ParamRange>;
  m.forward_begin(i, mb, p);
  { m.forward_unit(i, i) } -> std::convertible_to<double>;
};

//! Part of a concrete Model behind AnyPart: owns the part, forwards every call to it.
template <class Model>
class AnyPartOf final : public AnyPart<typename Model::value_type, typename Model::device> {
  using T = typename Model::value_type;
  using Base = AnyPart<T, typename Model::device>;
  using typename Base::MicroBatch, typename Base::ParamRange;

 public:
  explicit AnyPartOf(std::unique_ptr<Model> m) : m_(std::move(m)) {
    if constexpr (UnitModel<Model>) options_.write_buffers = m_->options().write_buffers;
  }
  Model& model() { return *m_; }

  double forward(int slot, const MicroBatch& mb, const T* input) override { return m_->forward(slot, of(mb), input); }
  void backward(int slot, double scale, const T* d) override { m_->backward(slot, scale, d); }
  void backward_inputs(int slot, double scale, const T* d) override { m_->backward_inputs(slot, scale, d); }
  void backward_weights(int slot) override { m_->backward_weights(slot); }
  int backward_chunks() const override { return m_->backward_chunks(); }
  ParamRange backward_chunk(int slot, int c, double scale) override {
    return range(m_->backward_chunk(slot, c, scale));
  }
  ParamRange backward_chunk_writes(int c) const override {
    if constexpr (requires { m_->backward_chunk_writes(c); }) return range(m_->backward_chunk_writes(c));
    else return {0, c == 0 ? m_->specs().size() : 0, models::no_param};
  }
  const T* output(int slot) const override { return m_->output(slot); }
  const T* input_grad(int slot) const override { return m_->input_grad(slot); }
  std::size_t io_elements(int batch, int seq) const override { return m_->io_elements(batch, seq); }
  int slots() const override { return m_->slots(); }
  void set_slots(int n) override { m_->set_slots(n); }

  void zero_grad() override { m_->zero_grad(); }
  double grad_square(bool skip_tied) override { return m_->grad_square(skip_tied); }
  std::span<T> tied_grad() override { return m_->tied_grad(); }
  bool embedding() const override { return m_->embedding(); }
  bool head() const override { return m_->head(); }
  const std::vector<layers::ParamSpec>& specs() const override { return m_->specs(); }
  const Tensor<T, typename Model::device>& params() const override { return m_->params(); }
  const Tensor<T, typename Model::device>& grads() const override { return m_->grads(); }
  const kernels::Ops<typename Model::device>& ops() const override { return m_->ops(); }

  bool has_experts() const override {
    if constexpr (requires { m_->take_moe_stats(); m_->shape().experts; }) return m_->shape().experts > 0;
    else return false;
  }
  layers::MoeStats take_moe_stats() override {
    if constexpr (requires { m_->take_moe_stats(); }) return m_->take_moe_stats();
    else return {};
  }

  const typename Base::Options& options() const override { return options_; }
  void initialise(std::uint64_t seed, std::int64_t lo, std::int64_t hi) override {
    if constexpr (UnitModel<Model>) m_->initialise(seed, lo, hi);
    else no_units();
  }
  std::vector<ParamRange> param_units() const override {
    std::vector<ParamRange> out;
    if constexpr (UnitModel<Model>)
      for (const auto& r : m_->param_units()) out.push_back(range(r));
    else no_units();
    return out;
  }
  int forward_units() const override {
    if constexpr (UnitModel<Model>) return m_->forward_units();
    else return no_units(), 0;
  }
  ParamRange forward_unit_reads(int u) const override {
    if constexpr (UnitModel<Model>) return range(m_->forward_unit_reads(u));
    else return no_units(), ParamRange{};
  }
  ParamRange backward_chunk_reads(int c) const override {
    if constexpr (UnitModel<Model>) return range(m_->backward_chunk_reads(c));
    else return no_units(), ParamRange{};
  }
  void forward_begin(int slot, const MicroBatch& mb, const T* input) override {
    if constexpr (UnitModel<Model>) m_->forward_begin(slot, of(mb), input);
    else no_units();
  }
  double forward_unit(int slot, int u) override {
    if constexpr (UnitModel<Model>) return m_->forward_unit(slot, u);
    else return no_units(), 0.0;
  }

 private:
  static decltype(auto) of(const MicroBatch& mb) {
    if constexpr (std::is_same_v<typename Model::MicroBatch, MicroBatch>) return (mb);
    else return typename Model::MicroBatch{mb.ids, mb.targets, mb.batch, mb.seq, mb.step, mb.row0};
  }
  template <class R>
  static ParamRange range(const R& r) {
    return {r.first, r.last, r.also == Model::no_param ? models::no_param : r.also};
  }
  [[noreturn]] static void no_units() {
    throw Error("loom: the model does not run in units (train::UnitModel), which ZeRO-3 needs");
  }

  std::unique_ptr<Model> m_;
  typename Base::Options options_;
};

}  // namespace loom::train

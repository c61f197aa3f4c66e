// A GPT-2-style decoder: pre-LayerNorm blocks, learned positions, tied input and output embedding, GELU MLP,
// optional grouped-query attention, on one rank or split over a tensor-parallel group (with or without sequence
// parallelism) as the layout type Cfg says, whole or as a pipeline part. Its parameters are laid out as Hugging
// Face's GPT-2, each rank holding its part of each in one flat buffer. Forward keeps a micro-batch's activations in
// the slot its caller names, and every backward names the slot it reads: no call depends on which slot an earlier
// call used. The model computes on the device Dev (Host, or Cuda with <loom/kernels/cuda/device_ops.cuh>).
#pragma once

#include <loom/config.hpp>
#include <loom/kernels/ops.hpp>
#include <loom/layers/vocab.hpp>
#include <loom/models/gpt/activations.hpp>
#include <loom/models/gpt/block.hpp>
#include <loom/models/gpt/param_table.hpp>
#include <loom/models/gpt/shape.hpp>
#include <loom/models/gpt/sharding.hpp>
#include <loom/tensor/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace loom::models {

//! A GPT on one rank (Cfg = Parallel<>) or on the tensor-parallel group of layout Cfg, computing on Dev. Other axes
//! of Cfg (data parallelism, ...) replicate or feed the model; they do not change it.
template <GptShape S, class T = float, class Cfg = Parallel<>, class Dev = Host>
class Gpt {
  static_assert(S.layers >= 1 && S.heads >= 1 && S.kv_heads >= 1 && S.d_model >= 1 && S.vocab >= 1 && S.max_seq >= 1,
                "loom: every GPT dimension must be at least 1");
  static_assert(S.d_model % S.heads == 0, "loom: d_model must be divisible by heads");
  static_assert(S.heads % S.kv_heads == 0, "loom: heads must be divisible by kv_heads");
  static_assert(ParallelLayout<Cfg>, "loom: a model's layout must be a loom::Parallel<...>");
  static_assert(ImplementedRules<Cfg>::ok);
  static_assert(DeviceRules<Dev, Cfg>::ok);

  using Block = GptBlock<T, Dev>;
  using Slot = GptSlot<T, Dev>;
  using Buf = Tensor<T, Dev>;

 public:
  using value_type = T;
  using acc = loom::acc_t<T>;
  using config = Cfg;
  using device = Dev;
  using Options = GptOptions;
  using ParamRange = models::ParamRange;
  static constexpr std::size_t no_param = models::no_param;
  static constexpr GptShape shape = S;
  static constexpr int tp_size = Cfg::template size<Axis::tp>;
  static constexpr bool sequence_parallel = Cfg::sequence_parallel;
  static_assert(TensorParallelRules<S, tp_size, sequence_parallel>::ok);

  //! The parameters of tensor-parallel rank tp_rank in part `part` (gpt_param_specs); global: the whole model's.
  static std::vector<ParamSpec> param_specs(int tp_rank = 0, bool global = false, GptPart part = {}) {
    return gpt_param_specs<S, T>(global ? 1 : tp_size, global ? 0 : tp_rank, part);
  }

  //! The single-rank model, initialised from seed: element i of parameter p is a function of (seed, p, i) alone.
  explicit Gpt(std::uint64_t seed, GptOptions opt = {})
    requires(tp_size == 1)
      : Gpt(layers::TpGroup<T>{}, seed, opt, GptPart{}) {}
  //! This rank's part of the model over the tensor-parallel communicator tp (of tp_size ranks); the same seed
  //! gives the same whole model whatever the layout.
  template <class Comm>
  Gpt(std::uint64_t seed, Comm& tp, GptOptions opt = {}) : Gpt(layers::TpGroup<T>(tp), seed, opt, GptPart{}) {}
  //! Part `part` of the model (a pipeline stage's), on the tensor-parallel communicator tp.
  template <class Comm>
  Gpt(std::uint64_t seed, Comm& tp, GptPart part, GptOptions opt = {})
      : Gpt(layers::TpGroup<T>(tp), seed, opt, part) {}

  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;

  const std::vector<ParamSpec>& specs() const { return specs_; }
  //! Parameters and gradients in one flat buffer each, on Dev.
  const Buf& params() const { return params_; }
  const Buf& grads() const { return grads_; }
  const GptOptions& options() const { return opt_; }
  //! A view of this rank's part of one parameter (or its gradient) by its Hugging Face name.
  Buf param(std::string_view name) const { return view_of(params_, name); }
  Buf grad(std::string_view name) const { return view_of(grads_, name); }
  void zero_grad() { grads_.fill(T(0)); }
  //! The operations the model runs on its device (on CUDA: with the stream they are issued on).
  const kernels::Ops<Dev>& ops() const { return ops_; }
  int tp_rank() const { return tp_.rank(); }
  //! The tensor-parallel group, with the counts of the collectives the model has issued.
  layers::TpGroup<T>& tp() { return tp_; }
  const layers::TpGroup<T>& tp() const { return tp_; }

  //! Whether this part holds the embedding (block 0), the loss (the last block); its blocks [first, last).
  bool embedding() const { return ix_.wpe != no_param; }
  bool head() const { return ix_.lnf_w != no_param; }
  int first_layer() const { return ix_.first; }
  int last_layer() const { return ix_.last; }

  //! One micro-batch through this part of the model.
  struct MicroBatch {
    const std::int32_t* ids;      //!< B*T in host memory, read by the part with the embedding
    const std::int32_t* targets;  //!< B*T in host memory, read by the part with the loss
    int batch, seq;               //!< B sequences of T tokens
    std::uint64_t step = 0;       //!< keys dropout, with row0 (the global index of the batch's first sequence),
    std::int64_t row0 = 0;        //!< so that its mask does not depend on how the batch is split
  };

  //! The micro-batches in flight: activation slots, each holding one forward's activations until its backward.
  void set_slots(int n) {
    LOOM_CHECK(n >= 1, "a model needs at least one activation slot, got ", n);
    if (B_ > 0) acts_.allocate(n, activation_shape(), *block_);
    else acts_.slots.resize(static_cast<std::size_t>(n));
  }
  int slots() const { return static_cast<int>(acts_.slots.size()); }

  //! Forward of micro-batch mb, keeping what its backward needs in activation slot `slot` (every slot has the same
  //! B and T). The part with the embedding reads mb.ids, the others `input` (this rank's rows x d_model in Dev's
  //! memory, the previous part's output). Returns the mean loss in the part with the loss; the others return 0 and
  //! leave their output in output(slot).
  double forward(int slot, const MicroBatch& mb, const T* input = nullptr) {
    const int B = mb.batch, T_ = mb.seq;
    LOOM_CHECK(T_ >= 1 && T_ <= S.max_seq, "sequence length ", T_, " is outside 1..", S.max_seq,
               " (the model's max_seq)");
    LOOM_CHECK(B >= 1, "batch of ", B, " sequences");
    LOOM_CHECK(!sequence_parallel || T_ % tp_size == 0, "sequence parallelism splits each sequence over tp = ",
               tp_size, " ranks, but the sequence length ", T_, " is not a multiple of it");
    check_slot(slot);
    LOOM_CHECK(embedding() || input != nullptr, "a part without the embedding needs the previous part's output");
    for (std::int64_t i = 0; i < std::int64_t{B} * T_; ++i) {
      const bool bad_id = embedding() && (mb.ids[i] < 0 || mb.ids[i] >= S.vocab);
      LOOM_CHECK(!bad_id && !(head() && (mb.targets[i] < 0 || mb.targets[i] >= S.vocab)), "token ",
                 bad_id ? mb.ids[i] : mb.targets[i], " at position ", i, " is outside the vocabulary 0..",
                 S.vocab - 1);
    }
    resize(B, T_);
    Slot& st = acts_.slots[static_cast<std::size_t>(slot)];
    st.ids = tokens_on_device(mb.ids, st.ids_on_device, embedding());
    st.targets = tokens_on_device(mb.targets, st.targets_on_device, head());
    st.dropout = {opt_.dropout, mb.step,
                  (static_cast<std::uint64_t>(mb.row0) * T_ + static_cast<std::uint64_t>(region_.first_row())) *
                      S.d_model};
    st.forwarded = true;
    const int N = B * T_, d = S.d_model, rows = region_.rows();
    T* x0 = st.act[0].x.data();
    if (embedding()) {
      emb_->forward(st.ids, param_ptr(ix_.wte), sp_or(acts_.emb_full, x0), x0);
      for_positions([&](int i, int n, int t0) {
        ops_.add_positions(param_ptr(ix_.wpe), x0 + std::ptrdiff_t(i) * d, 1, n, d, t0);
      });
      st.dropout.forward(ops_, x0, x0, std::size_t(rows) * d, 0, 0);
    } else {
      ops_.copy(input, x0, std::size_t(rows) * d);
    }
    {
      auto counted = tp_.counting(layers::Phase::forward);
      for (int l = ix_.first; l < ix_.last; ++l) {
        const auto i = block_index(l);
        block_->forward(l, block_params(params_, l), st.input_of(i, opt_.recompute),
                        opt_.recompute ? acts_.scratch_act : st.act[i], acts_.partial.data(),
                        st.output_of(i, opt_.recompute), st.dropout);
      }
    }
    if (!head()) return 0;
    // Final norm on this rank's rows, logits of this rank's vocabulary against the tied embedding, loss.
    ops_.layernorm_forward(st.out.data(), param_ptr(ix_.lnf_w), param_ptr(ix_.lnf_b), st.lnf.data(),
                           st.lnf_mean.data(), st.lnf_rstd.data(), rows, d, opt_.ln_eps);
    const T* lnf_full = sp_or(st.lnf_full, st.lnf.data());
    region_.enter_forward(st.lnf.data(), const_cast<T*>(lnf_full));
    ops_.matmul(lnf_full, param_ptr(ix_.wte), st.logits.data(), N, slice_.count, d, false, true);
    ce_->forward(st.logits.data(), st.targets, st.losses.data(), st.row_max.data(), st.row_sumexp.data());
    return ops_.sum(st.losses.data(), std::size_t(N)) / N;
  }

  //! The whole model (every part) on one micro-batch in slot 0: the mean cross-entropy of B sequences of T tokens
  //! (ids, targets: B*T each in host memory, the same on every tensor-parallel rank). step and row0 key dropout.
  double forward(const std::int32_t* ids, const std::int32_t* targets, int B, int T_, std::uint64_t step = 0,
                 std::int64_t row0 = 0) {
    LOOM_CHECK(embedding() && head(), "forward(ids, targets, ...) runs the whole model; this part holds blocks ",
               ix_.first, "..", ix_.last - 1, " of ", S.layers, ": use forward(slot, micro_batch, input)");
    return forward(0, MicroBatch{ids, targets, B, T_, step, row0});
  }

  //! This part's output of the micro-batch in `slot` (this rank's rows x d_model, in Dev's memory).
  const T* output(int slot) const { return acts_.slots.at(static_cast<std::size_t>(slot)).out.data(); }
  //! The gradient of this part's input left by the last backward (this rank's rows x d_model, in Dev's memory),
  //! for the previous part.
  const T* input_grad() const { return acts_.dx.data(); }

  //! Backward of the micro-batch in `slot`, accumulating into grads(): from its loss (scaled by `scale`) in the
  //! part with the loss, else from doutput (Dev's memory), the gradient of output(slot). Leaves input_grad().
  void backward(int slot, double scale, const T* doutput = nullptr) {
    check_slot(slot);
    LOOM_CHECK(head() || doutput != nullptr, "a part without the loss needs the gradient of its output");
    if (!head()) ops_.copy(doutput, acts_.dx.data(), std::size_t(region_.rows()) * S.d_model);
    for (int c = 0; c < backward_chunks(); ++c) backward_chunk(slot, c, scale);
  }
  //! The backward of the whole model's forward(ids, targets, ...), in slot 0, scaled by `scale` (1/m when m
  //! micro-batches make one step).
  void backward(double scale = 1.0) { backward(0, scale); }

  //! Backward runs in chunks, so that gradients can be reduced while the rest is computed: first the loss, the
  //! tied head and the final norm (in the part with the loss); then the blocks, last first; last the embedding (in
  //! the part with it). Before chunk 0 of a part without the loss, input_grad() must hold d(output).
  int backward_chunks() const { return (head() ? 1 : 0) + (ix_.last - ix_.first) + (embedding() ? 1 : 0); }

  //! Runs backward chunk c (in order 0, 1, ...) of the micro-batch in `slot` and returns the parameters whose
  //! gradients are now complete (summed over the tensor-parallel ranks that share them).
  ParamRange backward_chunk(int slot, int c, double scale = 1.0) {
    check_slot(slot);
    Slot& st = acts_.slots[static_cast<std::size_t>(slot)];
    LOOM_CHECK(B_ > 0 && st.forwarded, "backward() before forward()");
    LOOM_CHECK(c >= 0 && c < backward_chunks(), "backward chunk ", c, " is outside 0..", backward_chunks() - 1);
    if (!head()) ++c;  // no loss chunk
    if (c == 0) {      // loss, head, final norm; the tied table is complete here unless this part has the embedding
      head_input(st, scale, acts_.dlnf.data());
      head_weight(st, acts_.dlnf.data());
      return {ix_.lnf_w, ix_.lnf_b + 1, embedding() ? no_param : ix_.wte};
    }
    if (c <= ix_.last - ix_.first) {
      const int l = ix_.last - c;
      block_backward_input(st, l, acts_.grads);
      block_backward_weight(st, l, acts_.grads);
      return ix_.of_block(l);
    }
    embedding_weight(st, acts_.dx.data());
    return {ix_.wte, ix_.wpe + 1};
  }

  //! The backward of the micro-batch in `slot` split in two, as zero-bubble schedules run it. B: the gradient of
  //! this part's input (from the loss, scaled by `scale`, in the part with the loss, else from doutput), left in
  //! input_grad(); what the weight gradients need is kept with the slot. Not with recompute.
  void backward_inputs(int slot, double scale, const T* doutput = nullptr) {
    LOOM_CHECK(!opt_.recompute, "the split backward (B, then W) keeps every block's branch gradients; it does not "
               "combine with recompute");
    check_slot(slot);
    LOOM_CHECK(head() || doutput != nullptr, "a part without the loss needs the gradient of its output");
    Slot& st = acts_.slots[static_cast<std::size_t>(slot)];
    auto& sp = acts_.split(slot, activation_shape(), *block_);
    if (head()) head_input(st, scale, sp.dlnf.data());
    else ops_.copy(doutput, acts_.dx.data(), std::size_t(region_.rows()) * S.d_model);
    for (int l = ix_.last - 1; l >= ix_.first; --l) block_backward_input(st, l, sp.blocks[block_index(l)]);
    if (embedding()) ops_.copy(acts_.dx.data(), sp.dx.data(), static_cast<std::size_t>(sp.dx.numel()));
  }
  //! W: the weight gradients of the micro-batch in `slot`, after backward_inputs(slot); accumulates into grads().
  void backward_weights(int slot) {
    check_slot(slot);
    Slot& st = acts_.slots[static_cast<std::size_t>(slot)];
    auto& sp = acts_.split(slot, activation_shape(), *block_);
    if (head()) head_weight(st, sp.dlnf.data());
    for (int l = ix_.last - 1; l >= ix_.first; --l) block_backward_weight(st, l, sp.blocks[block_index(l)]);
    if (embedding()) embedding_weight(st, sp.dx.data());
  }

  //! The global gradient norm: each element of the whole model counted once, whichever ranks hold it.
  double grad_norm() { return std::sqrt(grad_square()); }
  //! The sum of squares of this part's gradients over its tensor-parallel group, each element counted once;
  //! without the tied table when skip_tied (a pipeline counts it on one of the two stages that hold it).
  double grad_square(bool skip_tied = false) {
    double local = 0;
    for (std::size_t p = 0; p < specs_.size(); ++p) {
      if (skip_tied && p == ix_.wte) continue;
      const T* g = grad_ptr(p);
      specs_[p].layout.for_each_piece([&](std::int64_t lo, std::int64_t, std::int64_t n, int replicas) {
        local += ops_.sum_squares(g + lo, static_cast<std::size_t>(n)) / replicas;
      });
    }
    std::vector<acc> sq{static_cast<acc>(local)};
    auto counted = tp_.counting(layers::Phase::grads);
    tp_.all_reduce_acc(sq.data(), 1, comm::Reduce::sum);
    return static_cast<double>(sq[0]);
  }
  //! The tied embedding table's gradient (this rank's rows, in Dev's memory), in a part that holds it; else empty.
  std::span<T> tied_grad() {
    if (ix_.wte == no_param) return {};
    return {grad_ptr(ix_.wte), static_cast<std::size_t>(numel_of(specs_[ix_.wte].shape))};
  }
  //! Elements of an activation passed between parts for B sequences of T tokens: this rank's rows x d_model.
  static constexpr std::size_t io_elements(int B, int T_) {
    return static_cast<std::size_t>(sequence_parallel ? B * T_ / tp_size : B * T_) * S.d_model;
  }

  //! Bytes of this rank's parameters: those every tensor-parallel rank holds in full, and its part of the others.
  struct ParamBytes {
    std::size_t replicated, sharded;
  };
  ParamBytes param_bytes() const {
    ParamBytes b{0, 0};
    for (const auto& s : specs_) (s.replicated ? b.replicated : b.sharded) += numel_of(s.shape) * sizeof(T);
    return b;
  }
  //! Bytes of activations and gradient scratch held for the current batch shape.
  std::size_t activation_bytes() const { return acts_.bytes(); }

  //! The whole model's parameters (or any buffer laid out as them, such as an optimizer's moments, U = acc) in the
  //! single-rank layout, in host memory on every rank (gather_params: a collective over the tensor-parallel
  //! group); local is in Dev's memory.
  template <class U>
  std::vector<U> gather(const U* local) {
    std::vector<U> staged;
    if constexpr (!on_host) {
      staged.resize(static_cast<std::size_t>(params_.numel()));
      ops_.to_host(local, staged.data(), staged.size());
      local = staged.data();
    }
    return gather_params(tp_, specs_, param_specs(0, true), S.params(), local);
  }
  //! Sets this rank's part (local, in Dev's memory) from a buffer in the single-rank layout in host memory (no
  //! communication).
  template <class U>
  void scatter(const U* global_buffer, U* local) const {
    if constexpr (!on_host) {  // every element of local is written: build it on the host, copy it over
      std::vector<U> staged(static_cast<std::size_t>(params_.numel()));
      scatter_params(specs_, param_specs(0, true), global_buffer, staged.data());
      ops_.from_host(staged.data(), local, staged.size());
    } else {
      scatter_params(specs_, param_specs(0, true), global_buffer, local);
    }
  }

 private:
  static constexpr bool on_host = kernels::is_host_v<Dev>;

  Gpt(layers::TpGroup<T> tp, std::uint64_t seed, GptOptions opt, GptPart part)
      : opt_(opt), tp_(std::move(tp)), ix_(S.layers, part), specs_(param_specs(tp_.rank(), false, part)),
        shared_(specs_, sequence_parallel) {
    LOOM_CHECK(0 <= ix_.first && ix_.first < ix_.last && ix_.last <= S.layers, "a part of the model holds blocks [",
               part.first, ", ", part.last, "), which is not a non-empty range of 0..", S.layers);
    LOOM_CHECK(tp_.size() == tp_size, "the tensor-parallel communicator has ", tp_.size(), " ranks but the layout ",
               Cfg::name(), " has tp = ", tp_size);
    const std::int64_t n = specs_.empty() ? 0 : specs_.back().offset + numel_of(specs_.back().shape);
    params_ = Buf::zeros({n});
    grads_ = Buf::zeros({n});
    if constexpr (on_host) {
      layers::initialise(specs_, params_.data(), seed);
    } else {  // made on the host, element by element as there, then copied
      const auto init = Tensor<T>::zeros({n});
      layers::initialise(specs_, init.data(), seed);
      ops_.from_host(init.data(), params_.data(), static_cast<std::size_t>(n));
    }
    slice_ = layers::vocab_slice(S.vocab, tp_size, tp_.rank());
    acts_.slots.resize(1);
  }

  void check_slot(int slot) const {
    LOOM_CHECK(slot >= 0 && slot < slots(), "activation slot ", slot, " is outside 0..", slots() - 1, " (set_slots)");
  }
  std::size_t block_index(int l) const { return static_cast<std::size_t>(l - ix_.first); }
  T* param_ptr(std::size_t p) const { return params_.data() + specs_[p].offset; }
  T* grad_ptr(std::size_t p) const { return grads_.data() + specs_[p].offset; }
  typename Block::Params block_params(const Buf& buf, int l) const {
    return Block::Params::in(buf.data(), specs_, ix_.block(l));
  }
  Buf view_of(const Buf& buf, std::string_view name) const {
    for (const auto& s : specs_)
      if (s.name == name) return buf.slice(0, s.offset, s.offset + numel_of(s.shape)).view(s.shape);
    throw Error(loom::detail::cat("loom: the model has no parameter named '", name, "'"));
  }
  //! buf with sequence parallelism, else alt: where a full (N-row) tensor lives.
  T* sp_or(const Buf& buf, T* alt) const { return sequence_parallel ? buf.data() : alt; }

  //! Where the kernels read B_ x T_ tokens given in host memory: there on the host; on a device, a copy in buf
  //! (when `used`: the part reads them).
  const std::int32_t* tokens_on_device(const std::int32_t* host, Tensor<std::int32_t, Dev>& buf, bool used) const {
    if constexpr (on_host) {
      return host;
    } else {
      if (!used || host == nullptr) return nullptr;
      const std::int64_t n = std::int64_t{B_} * T_;
      if (buf.numel() != n) buf = Tensor<std::int32_t, Dev>({n});
      ops_.from_host(host, buf.data(), static_cast<std::size_t>(n));
      return buf.data();
    }
  }

  //! Block l's backward to the gradient of its input, in acts_.dx, keeping its branch gradients in g; recomputes
  //! its forward first with recompute.
  void block_backward_input(Slot& st, int l, typename Block::Grads& g) {
    auto counted = tp_.counting(layers::Phase::backward);
    const auto i = block_index(l);
    const auto w = block_params(params_, l);
    if (opt_.recompute)
      block_->forward(l, w, st.input_of(i, true), acts_.scratch_act, acts_.partial.data(), acts_.recompute_out.data(),
                      st.dropout);
    block_->backward_input(l, w, st.input_of(i, opt_.recompute), opt_.recompute ? acts_.scratch_act : st.act[i], g,
                           acts_.dx.data(), st.dropout);
  }
  //! Block l's weight gradients from g; sums the ones tensor-parallel ranks share.
  void block_backward_weight(Slot& st, int l, const typename Block::Grads& g) {
    const auto i = block_index(l);
    const ParamRange r = ix_.of_block(l);
    keep_shared(r);
    block_->backward_weight(block_params(grads_, l), st.input_of(i, opt_.recompute),
                            opt_.recompute ? acts_.scratch_act : st.act[i], g);
    sum_shared(r);
  }

  //! The loss's backward to the gradient of the last block's output (acts_.dx): cross-entropy, the tied output
  //! layer's input gradient, the final norm's input gradient; dlnf (this rank's rows x d) keeps the norm's output
  //! gradient for head_weight.
  void head_input(Slot& st, double scale, T* dlnf) {
    const int N = B_ * T_, d = S.d_model, rows = region_.rows();
    auto counted = tp_.counting(layers::Phase::other);
    ops_.fill(acts_.dloss.data(), std::size_t(N), static_cast<T>(scale / N));
    T* logits = st.logits.data();
    ce_->backward(logits, st.targets, st.row_max.data(), st.row_sumexp.data(), acts_.dloss.data(), logits);
    T* dlnf_full = sp_or(acts_.dlnf_full, dlnf);
    ops_.matmul(logits, param_ptr(ix_.wte), dlnf_full, N, d, slice_.count, false, false);
    region_.enter_backward(dlnf_full, dlnf);
    ops_.layernorm_backward_input(dlnf, st.out.data(), param_ptr(ix_.lnf_w), st.lnf_mean.data(), st.lnf_rstd.data(),
                                  acts_.dx.data(), rows, d);
  }
  //! The loss's weight gradients: the tied table (this rank's vocabulary rows) and the final norm.
  void head_weight(Slot& st, const T* dlnf) {
    const int N = B_ * T_, d = S.d_model, rows = region_.rows();
    auto counted = tp_.counting(layers::Phase::other);
    keep_shared({ix_.lnf_w, ix_.lnf_b + 1});
    ops_.matmul(st.logits.data(), sp_or(st.lnf_full, st.lnf.data()), grad_ptr(ix_.wte), slice_.count, d, N, true,
                false, 1.0f, 1.0f);
    ops_.layernorm_backward_weight(dlnf, st.out.data(), st.lnf_mean.data(), st.lnf_rstd.data(), grad_ptr(ix_.lnf_w),
                                   grad_ptr(ix_.lnf_b), rows, d);
    sum_shared({ix_.lnf_w, ix_.lnf_b + 1});
  }
  //! The embedding's weight gradients from dx, the gradient of its output (overwritten): dropout, tokens (a
  //! scatter-add into this rank's rows of the tied table), positions.
  void embedding_weight(Slot& st, T* dx) {
    auto counted = tp_.counting(layers::Phase::other);
    const int d = S.d_model;
    keep_shared({ix_.wte, ix_.wpe + 1});
    st.dropout.backward(ops_, dx, dx, std::size_t(region_.rows()) * d, 0, 0);
    emb_->backward(st.ids, dx, sp_or(acts_.emb_full, dx), grad_ptr(ix_.wte));
    for_positions([&](int i, int n, int t0) {
      ops_.positions_backward(dx + std::ptrdiff_t(i) * d, grad_ptr(ix_.wpe), 1, n, d, t0);
    });
    sum_shared({ix_.wte, ix_.wpe + 1});
  }

  void keep_shared(ParamRange r) {
    if constexpr (tp_size > 1) shared_.keep(grads_.data(), r.first, r.last);
  }
  void sum_shared(ParamRange r) {
    if constexpr (tp_size > 1) shared_.sum(tp_, grads_.data(), r.first, r.last);
  }

  //! f(i, n, t0) for each run of n of this rank's rows, from row i, that are consecutive positions from t0.
  template <class F>
  void for_positions(F&& f) const {
    const int rows = region_.rows(), first = region_.first_row();
    for (int i = 0; i < rows;) {
      const int t0 = (first + i) % T_, n = std::min(T_ - t0, rows - i);
      f(i, n, t0);
      i += n;
    }
  }

  GptActivationShape activation_shape() const {
    return {region_.rows(), std::int64_t{B_} * T_, S.d_model, slice_.count, ix_.last - ix_.first,
            embedding(),    head(),                opt_.recompute, sequence_parallel};
  }
  //! The layers and the activation storage for B sequences of T tokens; nothing when the shape is the same.
  void resize(int B, int T_new) {
    if (B == B_ && T_new == T_) return;
    B_ = B, T_ = T_new;
    const int N = B * T_new;
    region_ = layers::Region<T, Dev>{&tp_, sequence_parallel, N, S.d_model, ops_};
    block_.emplace(region_, B, T_new, S, opt_.ln_eps);
    emb_.emplace(layers::VocabParallelEmbedding<T, Dev>{region_, slice_});
    ce_.emplace(layers::VocabParallelCrossEntropy<T, Dev>{&tp_, N, slice_, ops_});
    acts_.allocate(slots(), activation_shape(), *block_);
  }

  GptOptions opt_;
  kernels::Ops<Dev> ops_{};
  layers::TpGroup<T> tp_;
  GptParamIndex ix_;
  std::vector<ParamSpec> specs_;
  SharedGradients<T> shared_;  //!< refers to specs_
  Buf params_, grads_;
  layers::VocabSlice slice_{0, S.vocab};
  int B_ = 0, T_ = 0;  //!< the batch shape the layers and the activation storage are made for
  layers::Region<T, Dev> region_{nullptr, false, 0, S.d_model};
  std::optional<Block> block_;
  std::optional<layers::VocabParallelEmbedding<T, Dev>> emb_;
  std::optional<layers::VocabParallelCrossEntropy<T, Dev>> ce_;
  GptActivations<T, Dev> acts_;
};

}  // namespace loom::models

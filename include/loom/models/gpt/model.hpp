// A decoder-only transformer of pre-norm blocks, on one rank or split over a tensor-parallel group (with or without
// sequence parallelism) as the layout type Cfg says, whole or as a pipeline part. Its parts are its shape's spec:
// GPT-2's (LayerNorm, learned positions, GELU MLP, biases, the tied embedding), Llama 3's (RMSNorm, rotary positions
// with Llama 3's frequency scaling, SwiGLU, no biases, an output layer of its own), Mixtral's (Llama's with a mixture
// of SwiGLU experts), or any mix of them, with grouped-query attention. Its parameters are laid out as GPT-2's names
// say (models/gpt/hf.hpp maps them to each family's Hugging Face names), each rank holding its part of each in one
// flat buffer. Forward keeps a micro-batch's activations in
// the slot its caller names, and every backward names the slot it reads: no call depends on which slot an earlier
// call used. The model computes on the device Dev (Host, or Cuda with <loom/kernels/cuda/device_ops.hpp>).
#pragma once

#include <loom/comm/any.hpp>
#include <loom/config.hpp>
#include <loom/kernels/ops.hpp>
#include <loom/layers/vocab.hpp>
#include <loom/models/gpt/activations.hpp>
#include <loom/models/gpt/block.hpp>
#include <loom/models/gpt/ends.hpp>
#include <loom/models/gpt/param_table.hpp>
#include <loom/models/gpt/shape.hpp>
#include <loom/models/gpt/weights.hpp>
#include <loom/tensor/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <string_view>
#include <vector>

namespace loom::models {

//! A GPT of any shape (a value, checked when the model is built) on one rank (Cfg = Parallel<>) or on the
//! tensor-parallel group of layout Cfg, computing on Dev: the code of every Gpt<S, T, Cfg, Dev>, compiled once for
//! all shapes. Other axes of Cfg (data parallelism, ...) replicate or feed the model; they do not change it.
template <class T = float, class Cfg = Parallel<>, class Dev = Host>
class GptModel : public GptWeights<T, Cfg, Dev> {
  using Weights = GptWeights<T, Cfg, Dev>;
  using Weights::ix_, Weights::ops_, Weights::tp_, Weights::params_, Weights::grads_, Weights::param_ptr,
      Weights::grad_ptr, Weights::keep_shared, Weights::sum_shared, Weights::specs_, Weights::on_host,
      Weights::shape_;
  static_assert(ParallelLayout<Cfg>, "loom: a model's layout must be a loom::Parallel<...>");

  using Tp = typename Weights::tensor_parallel;
  using Block = GptBlock<T, Dev, Tp>;
  using Slot = GptSlot<T, Dev, Tp>;
  using Buf = Tensor<T, Dev>;

 public:
  using value_type = T;
  using acc = loom::acc_t<T>;
  using config = Cfg;
  using device = Dev;
  using Options = GptOptions;
  using Shape = GptShape;
  using ParamRange = models::ParamRange;
  using Weights::no_param, Weights::tp_size, Weights::sequence_parallel, Weights::cp_size, Weights::cp_algorithm,
      Weights::embedding, Weights::head;

  //! The single-rank model of shape s, initialised from seed: element i of parameter p is a function of (seed, p,
  //! i) alone.
  GptModel(const GptShape& s, std::uint64_t seed, GptOptions opt = {})
    requires(tp_size == 1 && cp_size == 1)
      : GptModel(s, layers::TpGroup<T, Tp>{}, nullptr, nullptr, seed, opt, GptPart{}) {}
  //! This rank's part of the model over the tensor-parallel communicator tp (of tp_size ranks); the same seed
  //! gives the same whole model whatever the layout.
  template <class Comm>
  GptModel(const GptShape& s, std::uint64_t seed, Comm& tp, GptOptions opt = {})
    requires(cp_size == 1)
      : GptModel(s, group_of(tp), nullptr, nullptr, seed, opt, GptPart{}) {}
  //! Part `part` of the model (a pipeline stage's), on the tensor-parallel communicator tp.
  template <class Comm>
  GptModel(const GptShape& s, std::uint64_t seed, Comm& tp, GptPart part, GptOptions opt = {})
    requires(cp_size == 1)
      : GptModel(s, group_of(tp), nullptr, nullptr, seed, opt, part) {}
  //! Part `part` (GptPart{}: the whole model) on the tensor-parallel communicator tp and the context-parallel
  //! communicator cp (of cp_size ranks): this rank holds its zigzag share of every sequence.
  template <class Comm, class CpComm>
  GptModel(const GptShape& s, std::uint64_t seed, Comm& tp, CpComm& cp, GptPart part, GptOptions opt = {})
    requires(cp_size > 1)
      : GptModel(s, group_of(tp), context_of(cp), nullptr, seed, opt, part) {}
  //! Part `part` on the tensor-parallel communicator tp, the context-parallel communicator cp where the layout has
  //! it (null where its degree is 1), and the expert-parallel communicator ep (EP<n>'s group; null without expert
  //! parallelism): any layout. The experts split over ep's ranks.
  template <class Comm>
  GptModel(const GptShape& s, std::uint64_t seed, Comm& tp, std::type_identity_t<Comm>* cp,
           std::type_identity_t<Comm>* ep, GptPart part, GptOptions opt = {})
      : GptModel(s, group_of(tp), cp_size > 1 ? context_of(*checked_group(cp, "cp", cp_size)) : nullptr,
                 ep && ep->size() > 1 ? group_comm(*ep, ep->size(), "expert") : nullptr, seed, opt, part) {}

  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  const GptOptions& options() const { return opt_; }
  //! The whole model's training FLOPs per token (forward and backward) for sequences of `seq` tokens.
  double flops_per_token(int seq) const { return shape_.flops_per_token(seq); }

  //! One micro-batch through this part of the model (models::MicroBatch).
  using MicroBatch = models::MicroBatch;

  //! The micro-batches in flight: activation slots, each holding one forward's activations until its backward.
  void set_slots(int n) {
    LOOM_CHECK(n >= 1, "a model needs at least one activation slot, got ", n);
    if (B_ > 0) acts_.allocate(n, activation_shape(), *block_);
    else acts_.slots.resize(static_cast<std::size_t>(n));
  }
  int slots() const { return static_cast<int>(acts_.slots.size()); }

  //! Forward of micro-batch mb, keeping what its backward needs in activation slot `slot` (every slot has the same
  //! B and T). The part with the embedding reads mb.ids, the others `input` (this rank's rows x d_model in Dev's
  //! memory, the previous part's output). Returns the mean loss in the part with the loss (with context
  //! parallelism, over this rank's tokens: the mean over the cp group is the batch's); the others return 0 and
  //! leave their output in output(slot).
  double forward(int slot, const MicroBatch& mb, const T* input = nullptr) {
    forward_begin(slot, mb, input);
    double loss = 0;
    for (int u = 0; u < forward_units(); ++u) loss = forward_unit(slot, u);
    return loss;
  }

  //! Forward runs in units, so that ZeRO-3 can gather a unit's parameters while the one before computes: the
  //! embedding (in the part with it), each block, the output layer and loss (in the part with it).
  int forward_units() const { return (embedding() ? 1 : 0) + (ix_.last - ix_.first) + (head() ? 1 : 0); }
  //! The parameters forward unit u reads (the output layer reads the tied table as well).
  ParamRange forward_unit_reads(int u) const {
    check_unit(u);
    if (embedding() && u == 0) return ix_.of_embedding();
    const int l = ix_.first + u - (embedding() ? 1 : 0);
    if (l < ix_.last) return ix_.of_block(l);
    return ix_.of_head();
  }
  //! The groups of parameters that forward units and backward chunks read and write whole, in the order of the
  //! part's flat buffer: the tied table and the positions (or, in a part with the output layer alone, its copy of
  //! the tied table), each block, the final norm.
  std::vector<ParamRange> param_units() const {
    std::vector<ParamRange> u;
    if (ix_.block0 > 0) u.push_back({0, ix_.block0});
    for (int l = ix_.first; l < ix_.last; ++l) u.push_back(ix_.of_block(l));
    if (head()) u.push_back({ix_.lnf_w, ix_.end});
    return u;
  }
  //! Starts the forward of micro-batch mb in `slot` (see forward), whose units forward_unit(slot, u) then runs in
  //! order, u = 0 .. forward_units() - 1.
  void forward_begin(int slot, const MicroBatch& mb, const T* input) {
    const int B = mb.batch, T_ = mb.seq;
    LOOM_CHECK(T_ >= 1 && T_ <= shape_.max_seq, "sequence length ", T_, " is outside 1..", shape_.max_seq,
               " (the model's max_seq)");
    LOOM_CHECK(B >= 1, "batch of ", B, " sequences");
    if constexpr (cp_size > 1) layers::check_zigzag(T_, cp_size);
    const int local = T_ / cp_size;
    LOOM_CHECK(!sequence_parallel || local % tp_size == 0, "sequence parallelism splits each sequence",
               cp_size > 1 ? "'s share on a cp rank" : "", " over tp = ", tp_size, " ranks, but its length ", local,
               " is not a multiple of it");
    check_slot(slot);
    LOOM_CHECK(embedding() || input != nullptr, "a part without the embedding needs the previous part's output");
    for (std::int64_t i = 0; i < std::int64_t{B} * T_; ++i) {
      const bool bad_id = embedding() && (mb.ids[i] < 0 || mb.ids[i] >= shape_.vocab);
      LOOM_CHECK(!bad_id && !(head() && (mb.targets[i] < 0 || mb.targets[i] >= shape_.vocab)), "token ",
                 bad_id ? mb.ids[i] : mb.targets[i], " at position ", i, " is outside the vocabulary 0..",
                 shape_.vocab - 1);
    }
    resize(B, local);
    Slot& st = acts_.slots[static_cast<std::size_t>(slot)];
    st.ids = tokens_on_device(local_tokens(mb.ids, T_, st.local_ids), st.ids_on_device, embedding());
    st.targets = tokens_on_device(local_tokens(mb.targets, T_, st.local_targets), st.targets_on_device, head());
    st.dropout = {opt_.dropout, mb.step, mb.row0, place(), shape_.d_model};
    st.forwarded = true;
    st.backward_follows = mb.backward;
    if (!embedding()) ops_.copy(input, st.act[0].x.data(), std::size_t(region_.rows()) * shape_.d_model);
  }
  //! Forward unit u of the micro-batch forward_begin started in `slot`: the mean loss after the last unit of the part
  //! with the loss, else 0.
  double forward_unit(int slot, int u) {
    check_unit(u);
    check_slot(slot);
    Slot& st = acts_.slots[static_cast<std::size_t>(slot)];
    LOOM_CHECK(B_ > 0 && st.forwarded, "forward_unit() before forward_begin()");
    T* x0 = st.act[0].x.data();
    if (embedding() && u == 0) {
      emb_->forward(st.ids, param_ptr(ix_.wte), param_ptr(ix_.wpe), full_or(acts_.emb_full, x0), x0, st.dropout);
      return 0;
    }
    const int l = ix_.first + u - (embedding() ? 1 : 0);
    if (l < ix_.last) {
      auto counted = tp_.counting(layers::Phase::forward);
      const auto i = block_index(l);
      block_->forward(l, block_params(params_, l), st.input_of(i, full()), full() ? acts_.scratch_act : st.act[i],
                      acts_.partial.data(), st.output_of(i, full()), st.dropout, acts_.grads, &moe_stats_);
      return 0;
    }
    return head_->forward(st, param_ptr(ix_.output_table()), param_ptr(ix_.lnf_w), param_ptr(ix_.lnf_b));
  }

  //! The whole model (every part) on one micro-batch in slot 0: the mean cross-entropy of B sequences of T tokens
  //! (ids, targets: B*T each in host memory, the same on every tensor-parallel rank). step and row0 key dropout.
  double forward(const std::int32_t* ids, const std::int32_t* targets, int B, int T_, std::uint64_t step = 0,
                 std::int64_t row0 = 0) {
    LOOM_CHECK(embedding() && head(), "forward(ids, targets, ...) runs the whole model; this part holds blocks ",
               ix_.first, "..", ix_.last - 1, " of ", shape_.layers, ": use forward(slot, micro_batch, input)");
    return forward(0, MicroBatch{ids, targets, B, T_, step, row0});
  }

  //! The logits of the micro-batch in `slot`, in the part with the loss: all N = B x T rows (this rank's tokens) of
  //! this rank's vocabulary slice, logits_pitch() elements apart, in Dev's memory; valid from its forward until its
  //! backward, which turns them into their gradient (or its forward does: GptOptions::loss_gradient_in_forward).
  const T* logits(int slot) const {
    const auto& st = acts_.slots.at(static_cast<std::size_t>(slot));
    LOOM_CHECK(!st.logits_are_gradient, "logits(", slot, "): the loss's forward turned them into its gradient "
               "(GptOptions::loss_gradient_in_forward); build the model without it to read them");
    return st.logits.data();
  }
  //! Elements between the rows of logits(): the slice's width on the host, whole 128-byte lines on a device.
  std::ptrdiff_t logits_pitch() const {
    const auto& shape = acts_.slots.at(0).logits.shape();
    return shape.size() == 2 ? static_cast<std::ptrdiff_t>(shape[1]) : 0;  // 0: a part without the loss
  }
  //! This part's output of the micro-batch in `slot` (this rank's rows x d_model, in Dev's memory).
  const T* output(int slot) const { return acts_.slots.at(static_cast<std::size_t>(slot)).out.data(); }
  //! The gradient of this part's input from the backward (or backward_inputs) of the micro-batch in `slot` (this
  //! rank's rows x d_model, in Dev's memory), for the previous part; the slot's own, until its next forward.
  const T* input_grad(int slot) const { return acts_.slots.at(static_cast<std::size_t>(slot)).dx.data(); }

  //! Backward of the micro-batch in `slot`, accumulating into grads(): from its loss (scaled by `scale`) in the
  //! part with the loss, else from doutput (Dev's memory), the gradient of output(slot). Leaves input_grad(slot).
  void backward(int slot, double scale, const T* doutput = nullptr) {
    check_slot(slot);
    LOOM_CHECK(head() || doutput != nullptr, "a part without the loss needs the gradient of its output");
    LOOM_CHECK(B_ > 0 && acts_.slots[static_cast<std::size_t>(slot)].forwarded, "backward() before forward()");
    if (!head() && doutput != nullptr)
      ops_.copy(doutput, acts_.slots[static_cast<std::size_t>(slot)].dx.data(),
                std::size_t(region_.rows()) * shape_.d_model);
    for (int c = 0; c < backward_chunks(); ++c) backward_chunk(slot, c, scale);
  }
  //! The backward of the whole model's forward(ids, targets, ...), in slot 0, scaled by `scale` (1/m when m
  //! micro-batches make one step).
  void backward(double scale = 1.0) { backward(0, scale); }

  //! Backward runs in chunks, so that gradients can be reduced while the rest is computed: first the loss, the
  //! tied head and the final norm (in the part with the loss); then the blocks, last first; last the embedding (in
  //! the part with it). Before chunk 0 of a part without the loss, input_grad(slot) must hold d(output).
  int backward_chunks() const { return (head() ? 1 : 0) + (ix_.last - ix_.first) + (embedding() ? 1 : 0); }

  //! The parameters whose gradients backward chunk c writes (the loss's chunk writes the tied table's as well, which
  //! it completes only in a part without the embedding).
  ParamRange backward_chunk_writes(int c) const {
    c = chunk_step(c);
    if (c == 0) return ix_.of_head();
    if (c <= ix_.last - ix_.first) return ix_.of_block(ix_.last - c);
    return ix_.of_embedding();
  }

  //! The parameters backward chunk c reads: the output layer's chunk the final norm and the tied table, a block's
  //! its own; the embedding's none (its gradient is a sum of rows of the output's).
  ParamRange backward_chunk_reads(int c) const {
    c = chunk_step(c);
    if (c == 0) return ix_.of_head();
    if (c <= ix_.last - ix_.first) return ix_.of_block(ix_.last - c);
    return {0, 0};
  }

  //! Runs backward chunk c (in order 0, 1, ...) of the micro-batch in `slot` and returns the parameters whose
  //! gradients are now complete (summed over the tensor-parallel ranks that share them).
  ParamRange backward_chunk(int slot, int c, double scale = 1.0) {
    check_slot(slot);
    Slot& st = acts_.slots[static_cast<std::size_t>(slot)];
    LOOM_CHECK(B_ > 0 && st.forwarded, "backward() before forward()");
    c = chunk_step(c);
    if (c == 0) {  // loss, head, final norm; the tied table is complete here unless this part has the embedding
      head_input(st, scale, acts_.dlnf.data());
      head_weight(st, acts_.dlnf.data());
      const ParamRange h = ix_.of_head();
      return {h.first, h.last, embedding() ? no_param : h.also};
    }
    if (c <= ix_.last - ix_.first) {
      const int l = ix_.last - c;
      block_backward_input(st, l, acts_.grads, scale);
      block_backward_weight(st, l, acts_.grads);
      return ix_.of_block(l);
    }
    embedding_weight(st, st.dx.data());
    return ix_.of_embedding();
  }

  //! The backward of the micro-batch in `slot` split in two, as zero-bubble schedules run it. B: the gradient of
  //! this part's input (from the loss, scaled by `scale`, in the part with the loss, else from doutput), left in
  //! input_grad(slot); the branch gradients the weight gradients need are kept with the slot (under full recompute, W
  //! runs each block's forward once more).
  void backward_inputs(int slot, double scale, const T* doutput = nullptr) {
    check_slot(slot);
    LOOM_CHECK(head() || doutput != nullptr, "a part without the loss needs the gradient of its output");
    Slot& st = acts_.slots[static_cast<std::size_t>(slot)];
    auto& sp = acts_.split(slot, activation_shape(), *block_);
    if (head()) head_input(st, scale, sp.dlnf.data());
    else if (doutput != nullptr) ops_.copy(doutput, st.dx.data(), std::size_t(region_.rows()) * shape_.d_model);
    for (int l = ix_.last - 1; l >= ix_.first; --l) block_backward_input(st, l, sp.blocks[block_index(l)], scale);
  }
  //! W: the weight gradients of the micro-batch in `slot`, after backward_inputs(slot); accumulates into grads().
  void backward_weights(int slot) {
    check_slot(slot);
    Slot& st = acts_.slots[static_cast<std::size_t>(slot)];
    auto& sp = acts_.split(slot, activation_shape(), *block_);
    if (head()) head_weight(st, sp.dlnf.data());
    for (int l = ix_.last - 1; l >= ix_.first; --l) {
      if (full()) recompute(st, l, sp.blocks[block_index(l)]);
      block_backward_weight(st, l, sp.blocks[block_index(l)]);
    }
    if (embedding()) embedding_weight(st, st.dx.data());
  }

  //! Elements of an activation passed between parts for B sequences of T tokens: this rank's rows x d_model.
  std::size_t io_elements(int B, int T_) const {
    const int local = T_ / cp_size;
    return static_cast<std::size_t>(sequence_parallel ? B * local / tp_size : B * local) * shape_.d_model;
  }
  //! What code that computes with the parameters outside training reads (the decoder of models/gpt/generate.hpp):
  //! this rank's part of block l's parameters, as pointers into params(), in a part that holds block l ...
  using block_type = Block;
  typename Block::Params block_weights(int l) const {
    LOOM_CHECK(l >= ix_.first && l < ix_.last, "block ", l, " is outside this part's blocks ", ix_.first, "..",
               ix_.last - 1);
    return block_params(params_, l);
  }
  //! ... and the ends' (null where this part holds none, or the spec has none): the token table, the learned
  //! positions, the final norm, the output layer's table (the tied token table, or lm_head).
  struct EndWeights {
    const T *wte, *wpe, *lnf_w, *lnf_b, *output;
  };
  EndWeights end_weights() const {
    return {param_ptr(ix_.wte), param_ptr(ix_.wpe), param_ptr(ix_.lnf_w), param_ptr(ix_.lnf_b),
            head() ? param_ptr(ix_.output_table()) : nullptr};
  }

  //! The context-parallel communicator the attention runs over (null without context parallelism); its traffic()
  //! counts what the model sent over it.
  comm::AnyComm* cp() const { return cp_.get(); }

  //! Bytes of activations and gradient scratch held for the current batch shape.
  std::size_t activation_bytes() const { return acts_.bytes(); }

  //! What this part's mixture-of-experts layers routed since the last call (layers::MoeStats), and none after.
  layers::MoeStats take_moe_stats() { return std::exchange(moe_stats_, layers::MoeStats{}); }


 private:
  template <class Comm>
  static layers::TpGroup<T, Tp> group_of(Comm& tp) {
    LOOM_CHECK(tp.size() == tp_size, "the tensor-parallel communicator has ", tp.size(), " ranks but the layout ",
               Cfg::name(), " has tp = ", tp_size);
    return layers::TpGroup<T, Tp>(tp);
  }
  template <class CpComm>
  static std::unique_ptr<comm::AnyComm> context_of(CpComm& cp) {
    return group_comm(cp, cp_size, "context");
  }
  //! An AnyComm over c, a communicator of the layout's `what`-parallel group of n ranks.
  template <class C>
  static std::unique_ptr<comm::AnyComm> group_comm(C& c, int n, const char* what) {
    LOOM_CHECK(c.size() == n, "the ", what, "-parallel communicator has ", c.size(), " ranks but the layout ",
               Cfg::name(), " has ", n);
    if constexpr (std::is_same_v<C, comm::AnyComm>)
      return std::make_unique<comm::AnyComm>(comm::AnyComm::referring_to(c));
    else
      return std::make_unique<comm::AnyComm>(c);
  }
  template <class C>
  static C* checked_group(C* c, const char* axis, int n) {
    LOOM_CHECK(c != nullptr, "the layout ", Cfg::name(), " has ", axis, " = ", n, " but the model was given no ", axis,
               " communicator");
    return c;
  }
  GptModel(const GptShape& s, layers::TpGroup<T, Tp> tp, std::unique_ptr<comm::AnyComm> cp,
           std::unique_ptr<comm::AnyComm> ep, std::uint64_t seed, GptOptions opt, GptPart part)
      : Weights(s, std::move(tp), seed, part, opt.write_buffers, std::move(ep)), opt_(opt), cp_(std::move(cp)) {
    slice_ = layers::vocab_slice(shape_.vocab, tp_size, tp_.rank());
    region_ = layers::Region<T, Dev, Tp>{nullptr, 0, shape_.d_model};
    if (shape_.rope() && ix_.first < ix_.last) rope_.emplace(shape_.head_dim(), shape_.max_seq, rope_frequencies(shape_), ops_);
    acts_.slots.resize(1);
  }

  //! Backward chunk c of this part as a step of the whole model's backward: 0 the loss (absent in a part without
  //! it), 1..blocks the blocks from the last, then the embedding.
  int chunk_step(int c) const {
    LOOM_CHECK(c >= 0 && c < backward_chunks(), "backward chunk ", c, " is outside 0..", backward_chunks() - 1);
    return head() ? c : c + 1;
  }
  void check_unit(int u) const {
    LOOM_CHECK(u >= 0 && u < forward_units(), "forward unit ", u, " is outside 0..", forward_units() - 1);
  }
  void check_slot(int slot) const {
    LOOM_CHECK(slot >= 0 && slot < slots(), "activation slot ", slot, " is outside 0..", slots() - 1, " (set_slots)");
  }
  std::size_t block_index(int l) const { return static_cast<std::size_t>(l - ix_.first); }
  typename Block::Params block_params(const Buf& buf, int l) const {
    return Block::Params::in(buf.data(), specs_, ix_.block(l), shape_, l);
  }
  //! buf with sequence parallelism, else alt: where a full (N-row) tensor lives.
  T* full_or(const Buf& buf, T* alt) const { return sequence_parallel ? buf.data() : alt; }

  bool full() const { return opt_.recompute == Recompute::full; }
  //! Where this rank's rows sit in the batch's sequences.
  RowPlace place() const {
    return {region_.first_row(), region_.rows(), T_, cp_size, cp_ ? cp_->rank() : 0};
  }
  //! This rank's tokens of B_ sequences of Tg (in host memory): all of them, or with context parallelism its two
  //! zigzag chunks of each, copied to buf.
  const std::int32_t* local_tokens(const std::int32_t* all, int Tg, std::vector<std::int32_t>& buf) const {
    if (cp_size == 1 || all == nullptr) return all;
    const int r = cp_->rank(), c = T_ / 2;
    buf.resize(std::size_t(B_) * T_);
    for (int b = 0; b < B_; ++b)
      for (int t = 0; t < T_; ++t)
        buf[std::size_t(b) * T_ + t] = all[std::size_t(b) * Tg + layers::zigzag_position(t, r, cp_size, c)];
    return buf.data();
  }

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

  //! Block l's backward to the gradient of its input, in the slot's dx, keeping its branch gradients in g; recomputes
  //! its forward first with recompute. `scale` scales a mixture of experts' router losses as the loss is.
  void block_backward_input(Slot& st, int l, typename Block::Grads& g, double scale) {
    if (full()) recompute(st, l, g);
    auto counted = tp_.counting(layers::Phase::backward);
    const auto i = block_index(l);
    block_->backward_input(l, block_params(params_, l), st.input_of(i, full()), full() ? acts_.scratch_act : st.act[i],
                           g, st.dx.data(), st.dropout, scale, &moe_stats_);
  }
  //! Under full recompute: block l's forward again, from its kept input, into acts_.scratch_act.
  void recompute(Slot& st, int l, typename Block::Grads& g) {
    auto counted = tp_.counting(layers::Phase::backward);
    block_->forward(l, block_params(params_, l), st.input_of(block_index(l), true), acts_.scratch_act,
                    acts_.partial.data(), acts_.recompute_out.data(), st.dropout, g);
  }
  //! Block l's weight gradients from g; sums the ones tensor-parallel ranks share.
  void block_backward_weight(Slot& st, int l, const typename Block::Grads& g) {
    const auto i = block_index(l);
    const ParamRange r = ix_.of_block(l);
    keep_shared(r);
    block_->backward_weight(l, block_params(grads_, l), st.input_of(i, full()),
                            full() ? acts_.scratch_act : st.act[i], g);
    sum_shared(r);
  }

  //! The loss's backward to the slot's dx, the gradient of the last block's output; dlnf keeps the final norm's output
  //! gradient for head_weight.
  void head_input(Slot& st, double scale, T* dlnf) {
    auto counted = tp_.counting(layers::Phase::other);
    head_->backward_input(st, scale, param_ptr(ix_.output_table()), param_ptr(ix_.lnf_w), dlnf,
                          acts_.dlnf_full.data(), acts_.dloss.data(), st.dx.data());
  }
  //! The loss's weight gradients: the output table (this rank's vocabulary rows) and the final norm.
  void head_weight(Slot& st, const T* dlnf) {
    auto counted = tp_.counting(layers::Phase::other);
    const ParamRange h = ix_.of_head();
    keep_shared(h);
    head_->backward_weight(st, dlnf, grad_ptr(ix_.output_table()), grad_ptr(ix_.lnf_w), grad_ptr(ix_.lnf_b));
    sum_shared(h);
  }
  //! The embedding's weight gradients from dx, the gradient of its output (overwritten).
  void embedding_weight(Slot& st, T* dx) {
    auto counted = tp_.counting(layers::Phase::other);
    keep_shared(ix_.of_embedding());
    emb_->backward(st.ids, dx, full_or(acts_.emb_full, dx), grad_ptr(ix_.wte), grad_ptr(ix_.wpe), st.dropout);
    sum_shared(ix_.of_embedding());
  }

  GptActivationShape activation_shape() const {
    return {region_.rows(), std::int64_t{B_} * T_, shape_.d_model, slice_.count, ix_.last - ix_.first,
            embedding(),    head(),                opt_.recompute, ix_.first};
  }
  //! The layers and the activation storage for B sequences of T tokens on this rank (its share with context
  //! parallelism); nothing when the shape is the same.
  void resize(int B, int T_new) {
    if (B == B_ && T_new == T_) return;
    B_ = B, T_ = T_new;
    const int N = B * T_new;
    region_ = layers::Region<T, Dev, Tp>{&tp_, N, shape_.d_model, ops_};
    block_.emplace(region_, B, T_new, shape_, opt_.ln_eps, layers::CpGroup{cp_.get(), cp_algorithm}, opt_.moe,
                   layers::EpGroup{this->ep()}, rope_ ? &*rope_ : nullptr);
    emb_.emplace(region_, slice_, place());
    head_.emplace(region_, slice_, layers::Norm<T, Dev>{shape_.norm == NormKind::rms, opt_.ln_eps, ops_},
                  opt_.loss_gradient_in_forward);
    acts_.allocate(slots(), activation_shape(), *block_);
  }

  GptOptions opt_;
  layers::MoeStats moe_stats_;
  std::unique_ptr<comm::AnyComm> cp_;  //!< with context parallelism: the cp group's communicator
  layers::VocabSlice slice_{0, 0};
  int B_ = 0, T_ = 0;  //!< the batch shape the layers and the activation storage are made for (T_: local tokens)
  layers::Region<T, Dev, Tp> region_{nullptr, 0, 0};
  std::optional<layers::Rotary<T, Dev>> rope_;  //!< with rotary positions: the tables
  std::optional<Block> block_;
  std::optional<GptEmbedding<T, Dev, Tp>> emb_;
  std::optional<GptHead<T, Dev, Tp>> head_;
  GptActivations<T, Dev, Tp> acts_;
};

//! A GPT of shape S: GptModel<T, Cfg, Dev> with its shape and the rules it must meet on Cfg's tensor-parallel
//! group checked at compile time (a shape that cannot be split does not compile).
template <GptShape S, class T = float, class Cfg = Parallel<>, class Dev = Host>
class Gpt : public GptModel<T, Cfg, Dev> {
  using Model = GptModel<T, Cfg, Dev>;
  static_assert(S.layers >= 1 && S.heads >= 1 && S.kv_heads >= 1 && S.d_model >= 1 && S.vocab >= 1 && S.max_seq >= 1,
                "loom: every GPT dimension must be at least 1");
  static_assert(S.d_model % S.heads == 0, "loom: d_model must be divisible by heads");
  static_assert(S.heads % S.kv_heads == 0, "loom: heads must be divisible by kv_heads");
  static_assert(TensorParallelRules<S, Model::tp_size, Model::sequence_parallel>::ok);
  static_assert(ContextParallelRules<S, Model::tp_size, Model::cp_size, Model::cp_algorithm>::ok);
  static_assert(S.experts == 0 || (S.top_k >= 1 && S.top_k <= S.experts && S.moe_every >= 1),
                "loom: a mixture of experts needs 1 <= top_k <= experts and moe_every >= 1");
  static_assert(!S.rope() || S.head_dim() % 2 == 0,
                "loom: rotary positions need an even head_dim (each head's halves are the planes they turn)");

 public:
  static constexpr GptShape static_shape = S;
  //! What a trainer builds and steps (train::part_of_t): the shape-free model, one code for every shape; for this
  //! type only (part_type_for), not for a type derived from it, which is its own part.
  using part_type = Model;
  using part_type_for = Gpt;
  //! The same model on model layout L (what testing::ModelOn gives for a layout).
  template <class L>
  using with_layout = Gpt<S, T, L, Dev>;
  //! Whether the shape meets every rule of the whole layout L (LayoutRules: its failures are loom: assertions).
  template <class L>
  static constexpr bool fits_layout = LayoutRules<S, L, Dev>::ok;

  explicit Gpt(std::uint64_t seed, GptOptions opt = {})
    requires(Model::tp_size == 1 && Model::cp_size == 1)
      : Model(S, seed, opt) {}
  template <class Comm>
  Gpt(std::uint64_t seed, Comm& tp, GptOptions opt = {})
    requires(Model::cp_size == 1)
      : Model(S, seed, tp, opt) {}
  template <class Comm>
  Gpt(std::uint64_t seed, Comm& tp, GptPart part, GptOptions opt = {})
    requires(Model::cp_size == 1)
      : Model(S, seed, tp, part, opt) {}
  //! On the tensor- and context-parallel communicators tp and cp (GptModel).
  template <class Comm, class CpComm>
  Gpt(std::uint64_t seed, Comm& tp, CpComm& cp, GptPart part, GptOptions opt = {})
    requires(Model::cp_size > 1)
      : Model(S, seed, tp, cp, part, opt) {}
  //! On tp and, where the layout has them, cp and ep (null where its degree is 1): any layout (GptModel).
  template <class Comm>
  Gpt(std::uint64_t seed, Comm& tp, std::type_identity_t<Comm>* cp, std::type_identity_t<Comm>* ep, GptPart part,
      GptOptions opt = {})
      : Model(S, seed, tp, cp, ep, part, opt) {}

  //! The parameters of tensor-parallel rank tp_rank in part `part`; global: the whole model's.
  static std::vector<ParamSpec> param_specs(int tp_rank = 0, bool global = false, GptPart part = {}) {
    return Model::param_specs(S, tp_rank, global, part);
  }
};

}  // namespace loom::models

// A GPT-2-style decoder: pre-LayerNorm blocks, learned positions, tied input and output embedding, GELU MLP of
// width 4d, optional grouped-query attention, on one rank or split over a tensor-parallel group (with or without
// sequence parallelism) as the layout type Cfg says. Its shape is a compile-time value; its parameters are named
// and laid out as Hugging Face's GPT-2 (h.{i}.attn.c_attn.weight is [d, 3d], ...), each rank holding its part of
// each in one flat buffer. Each block has an explicit forward, backward_input and backward_weight; activations may
// be recomputed per layer. The model computes on the device Dev (Host, or Cuda with
// <loom/kernels/cuda/device_ops.cuh>): its parameters, gradients and activations live there.
#pragma once

#include <loom/config.hpp>
#include <loom/core/random.hpp>
#include <loom/core/trace.hpp>
#include <loom/kernels/ops.hpp>
#include <loom/layers/attention.hpp>
#include <loom/layers/mlp.hpp>
#include <loom/layers/param.hpp>
#include <loom/layers/vocab.hpp>
#include <loom/tensor/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom::models {

//! The shape of a GPT. vocab is the full vocabulary, max_seq the number of learned positions, d_ff the MLP's width
//! (0: 4 d_model, GPT-2's).
struct GptShape {
  int layers, heads, kv_heads, d_model, vocab, max_seq, d_ff = 0;

  constexpr int head_dim() const { return d_model / heads; }
  constexpr int qkv_width() const { return (heads + 2 * kv_heads) * head_dim(); }
  constexpr int ffn() const { return d_ff > 0 ? d_ff : 4 * d_model; }
  constexpr std::int64_t block_params() const {
    const std::int64_t d = d_model;
    return 2 * d + d * qkv_width() + qkv_width() + d * d + d + 2 * d + d * ffn() + ffn() + ffn() * d + d;
  }
  //! Parameters, counting the tied embedding once.
  constexpr std::int64_t params() const {
    return std::int64_t{vocab} * d_model + std::int64_t{max_seq} * d_model + layers * block_params() + 2 * d_model;
  }
};

//! The shapes train_gpt knows by name.
inline constexpr GptShape tiny{2, 4, 4, 64, 256, 128};
inline constexpr GptShape small{4, 8, 8, 256, 256, 256};
inline constexpr GptShape gpt2{12, 12, 12, 768, 50257, 1024};

using layers::ParamSpec;

//! The part of the model a pipeline stage holds: blocks [first, last) (last -1: to the end); the part with block 0
//! holds the embedding, the part with the last block the final norm, the tied output layer and the loss.
struct GptPart {
  int first = 0, last = -1;
};

struct GptOptions {
  bool recompute = false;  //!< keep only each block's input; recompute the rest during backward
  float dropout = 0.0f;    //!< on the embedding output and each residual branch
  float ln_eps = 1e-5f;
};

//! The first rule of TensorParallelRules that a shape breaks over tp ranks, or an empty view: for choosing among
//! layouts at compile time without tripping the rules.
constexpr std::string_view tensor_parallel_violation(GptShape s, int tp, bool sequence_parallel) {
  if (s.heads % tp != 0) return "heads must be divisible by TP";
  if (s.kv_heads % tp != 0 && tp % s.kv_heads != 0) return "kv_heads and TP must divide one another";
  if (s.ffn() % tp != 0) return "d_ff must be divisible by TP";
  if (s.vocab < tp) return "the vocabulary must have at least TP entries";
  if (sequence_parallel && s.max_seq % tp != 0) return "with sequence parallelism max_seq must be divisible by TP";
  return {};
}

//! The rules a shape must meet to be split over TP ranks, checked where a model is declared.
template <GptShape S, int TP, bool SequenceParallel>
struct TensorParallelRules {
  static_assert(S.heads % TP == 0, "loom: heads must be divisible by TP (attention is split by heads)");
  static_assert(S.kv_heads % TP == 0 || TP % S.kv_heads == 0,
                "loom: kv_heads and TP must divide one another (kv heads are split when kv_heads >= TP and "
                "replicated on TP / kv_heads ranks when kv_heads < TP)");
  static_assert(S.ffn() % TP == 0, "loom: d_ff must be divisible by TP (the MLP is split by features)");
  static_assert(S.vocab >= TP, "loom: the vocabulary must have at least TP entries (it is split by rows)");
  static_assert(!SequenceParallel || S.max_seq % TP == 0,
                "loom: with sequence parallelism max_seq must be divisible by TP (sequences are split over TP)");
  static constexpr bool ok = true;
};

//! The rules a layout must meet for a model on device Dev, checked where a model is declared.
//!
//! On a device only a tensor-parallel group of one, which issues no collective, is correct. The communicators take
//! device pointers (Nccl; Local with <loom/comm/local_cuda.cuh>, ranks sharing one GPU), but the model does not yet
//! wait for its stream before a tensor-parallel collective, and sync_grads packs the shared gradients in host
//! memory (std::vector). Those two lift the rule.
template <class Dev, class Cfg>
struct DeviceRules {
  static_assert(std::is_same_v<Dev, Host> || std::is_same_v<Dev, Cuda>, "loom: a model's device is Host or Cuda");
  static_assert(std::is_same_v<Dev, Host> || (Cfg::template size<Axis::tp> == 1 && !Cfg::sequence_parallel),
                "loom: a model on a CUDA device supports tp = 1 only, without sequence parallelism (the "
                "tensor-parallel collectives take host memory)");
  static constexpr bool ok = true;
};

//! What a layout may carry that no model or trainer reads yet. A layout that carries it does not compile, rather
//! than train as something other than what its type says; checked where a model or its layout is declared.
template <class Cfg>
struct ImplementedRules {
  static_assert(Cfg::zero_stage == 0,
                "loom: DP<n, ZeRO<k>> with k > 0 (sharded data parallelism) is not implemented yet");
  static_assert(Cfg::template size<Axis::cp> == 1,
                "loom: CP<n> with n > 1 (context parallelism) is not implemented yet");
  static_assert(!Cfg::cp_algorithm_given,
                "loom: CP<n, Ring> and CP<n, Ulysses> (context-parallel attention) are not implemented yet");
  static_assert(Cfg::template size<Axis::ep> == 1,
                "loom: EP<n> with n > 1 (expert parallelism) is not implemented yet");
  static constexpr bool ok = true;
};

namespace detail {
template <class Cfg>
struct ModelLayoutOf {
  static_assert(ImplementedRules<Cfg>::ok);
  static constexpr int tp = Cfg::template size<Axis::tp>;
  using type = std::conditional_t<tp == 1, Parallel<>,
                                  std::conditional_t<Cfg::sequence_parallel, Parallel<TP<tp, SequenceParallel>>,
                                                     Parallel<TP<tp>>>>;
};
}  // namespace detail

//! The part of a layout a model's type depends on: its tensor-parallel degree and sequence parallelism. Gpt<S, T,
//! ModelLayout<Cfg>> is one type for every layout that differs from Cfg only in its other axes.
template <class Cfg>
using ModelLayout = typename detail::ModelLayoutOf<Cfg>::type;

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

 public:
  using value_type = T;
  using acc = loom::acc_t<T>;
  using config = Cfg;
  using device = Dev;
  using Options = GptOptions;
  static constexpr GptShape shape = S;
  static constexpr int tp_size = Cfg::template size<Axis::tp>;
  static constexpr bool sequence_parallel = Cfg::sequence_parallel;
  static_assert(TensorParallelRules<S, tp_size, sequence_parallel>::ok);

  //! The parameters of tensor-parallel rank tp_rank in part `part`, in Hugging Face's GPT-2 order; each declared by
  //! its layer with its placement. tp_size 1 (or global = true) and the whole part give the whole model. The tied
  //! embedding is held by the parts with the embedding and with the output layer.
  static std::vector<ParamSpec> param_specs(int tp_rank = 0, bool global = false, GptPart part = {}) {
    layers::ParamTable t(global ? 1 : tp_size, global ? 0 : tp_rank);
    const int d = S.d_model, first = part.first, last = part.last < 0 ? S.layers : part.last;
    const double std_w = 0.02, std_proj = 0.02 / std::sqrt(2.0 * S.layers);
    t.skip(first != 0 && last != S.layers);
    layers::VocabParallelEmbedding<T>::declare(t, "wte", S.vocab, d, std_w);
    t.skip(first != 0);
    t.add<Replicate>("wpe.weight", {S.max_seq, d}, true, 0.01);
    for (int l = 0; l < S.layers; ++l) {
      t.skip(l < first || l >= last);
      const std::string h = "h." + std::to_string(l) + ".";
      t.add<Replicate>(h + "ln_1.weight", {d}, false, 0, 1);
      t.add<Replicate>(h + "ln_1.bias", {d}, false, 0);
      layers::ParallelAttention<T>::declare(t, h + "attn.", d, S.heads, S.kv_heads, std_w, std_proj);
      t.add<Replicate>(h + "ln_2.weight", {d}, false, 0, 1);
      t.add<Replicate>(h + "ln_2.bias", {d}, false, 0);
      layers::ParallelMlp<T>::declare(t, h + "mlp.", d, S.ffn(), std_w, std_proj);
    }
    t.skip(last != S.layers);
    t.add<Replicate>("ln_f.weight", {d}, false, 0, 1);
    t.add<Replicate>("ln_f.bias", {d}, false, 0);
    return t.take();
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
  const Tensor<T, Dev>& params() const { return params_; }
  const Tensor<T, Dev>& grads() const { return grads_; }
  const GptOptions& options() const { return opt_; }
  //! A view of this rank's part of one parameter (or its gradient) by its Hugging Face name.
  Tensor<T, Dev> param(std::string_view name) const { return view_of(params_, name); }
  Tensor<T, Dev> grad(std::string_view name) const { return view_of(grads_, name); }
  void zero_grad() { grads_.fill(T(0)); }
  //! The operations the model runs on its device (on CUDA: with the stream they are issued on).
  const kernels::Ops<Dev>& ops() const { return ops_; }
  int tp_rank() const { return tp_.rank(); }
  //! The tensor-parallel group, with the counts of the collectives the model has issued.
  layers::TpGroup<T>& tp() { return tp_; }
  const layers::TpGroup<T>& tp() const { return tp_; }

  //! Mean cross-entropy of B sequences of T tokens (ids, targets: B*T each in host memory, the same on every
  //! tensor-parallel rank), keeping what backward needs. step and row0 (the global index of this batch's first
  //! sequence) key dropout, so that its mask does not depend on how the batch is split. The whole model (every
  //! part).
  double forward(const std::int32_t* ids, const std::int32_t* targets, int B, int T_, std::uint64_t step = 0,
                 std::int64_t row0 = 0) {
    LOOM_CHECK(embedding() && head(), "forward(ids, targets, ...) runs the whole model; this part holds blocks ",
               first_, "..", last_ - 1, " of ", S.layers, ": use forward(slot, micro_batch, input)");
    return forward(0, MicroBatch{ids, targets, B, T_, step, row0});
  }

  //! One micro-batch through this part of the model.
  struct MicroBatch {
    const std::int32_t* ids;      //!< B*T in host memory, read by the part with the embedding
    const std::int32_t* targets;  //!< B*T in host memory, read by the part with the loss
    int batch, seq;               //!< B sequences of T tokens
    std::uint64_t step = 0;
    std::int64_t row0 = 0;
  };

  //! Forward of micro-batch mb, keeping what its backward needs in activation slot `slot` (a pipeline stage holds
  //! the micro-batches in flight, one slot each; every slot has the same B and T). The part with the embedding
  //! reads mb.ids, the others `input` (this rank's rows x d_model in Dev's memory, the previous part's output).
  //! Returns the mean
  //! loss in the part with the loss; the others return 0 and leave their output in output(slot).
  double forward(int slot, const MicroBatch& mb, const T* input = nullptr) {
    const int B = mb.batch, T_ = mb.seq;
    LOOM_CHECK(T_ >= 1 && T_ <= S.max_seq, "sequence length ", T_, " is outside 1..", S.max_seq,
               " (the model's max_seq)");
    LOOM_CHECK(B >= 1, "batch of ", B, " sequences");
    LOOM_CHECK(!sequence_parallel || T_ % tp_size == 0, "sequence parallelism splits each sequence over tp = ",
               tp_size, " ranks, but the sequence length ", T_, " is not a multiple of it");
    LOOM_CHECK(slot >= 0 && slot < static_cast<int>(slots_.size()), "activation slot ", slot, " is outside 0..",
               slots_.size() - 1, " (set_slots)");
    LOOM_CHECK(embedding() || input != nullptr, "a part without the embedding needs the previous part's output");
    for (std::int64_t i = 0; i < std::int64_t{B} * T_; ++i) {
      const bool bad = (embedding() && (mb.ids[i] < 0 || mb.ids[i] >= S.vocab)) ||
                       (head() && (mb.targets[i] < 0 || mb.targets[i] >= S.vocab));
      LOOM_CHECK(!bad, "token ", embedding() && (mb.ids[i] < 0 || mb.ids[i] >= S.vocab) ? mb.ids[i] : mb.targets[i],
                 " at position ", i, " is outside the vocabulary 0..", S.vocab - 1);
    }
    resize(B, T_);
    cur_ = slot;
    Slot& st = sl();
    st.ids = tokens_on_device(mb.ids, st.ids_on_device, embedding());
    st.targets = tokens_on_device(mb.targets, st.targets_on_device, head());
    st.step = mb.step, st.row0 = mb.row0, st.forwarded = true;
    const int N = B * T_, d = S.d_model, rows = region_.rows();
    T* x0 = st.act[0].x.data();
    if (embedding()) {
      emb_->forward(mb.ids, param_ptr(wte_), sp_or(emb_full_, x0), x0);
      add_positions(x0);
      drop(x0, x0, std::size_t(rows) * d, 0, 0);
    } else {
      ops_.copy(input, x0, std::size_t(rows) * d);
    }
    {
      auto counted = tp_.counting(layers::Phase::forward);
      for (int l = first_; l < last_; ++l) layer_forward(l, opt_.recompute ? scratch_act_ : act(l), next_input(l));
    }
    if (!head()) return 0;
    // Final norm on this rank's rows, logits of this rank's vocabulary against the tied embedding, loss.
    T* xl = next_input(last_ - 1);
    ops_.layernorm_forward(xl, param_ptr(lnf_w_), param_ptr(lnf_b_), st.lnf.data(), st.lnf_mean.data(),
                           st.lnf_rstd.data(), rows, d, opt_.ln_eps);
    const T* lnf_full = sp_or(st.lnf_full, st.lnf.data());
    region_.enter_forward(st.lnf.data(), const_cast<T*>(lnf_full));
    ops_.matmul(lnf_full, param_ptr(wte_), st.logits.data(), N, slice_.count, d, false, true);
    ce_->forward(st.logits.data(), st.targets, st.losses.data(), st.row_max.data(), st.row_sumexp.data());
    return ops_.sum(st.losses.data(), std::size_t(N)) / N;
  }

  //! This part's output of the micro-batch in `slot` (this rank's rows x d_model, in Dev's memory), for the next
  //! part.
  const T* output(int slot) const { return slots_.at(slot).out.data(); }
  //! The gradient of this part's input after its backward (this rank's rows x d_model, in Dev's memory), for the
  //! previous part.
  const T* input_grad() const { return dx_.data(); }
  //! The micro-batches in flight: activation slots, each holding one forward's activations until its backward.
  void set_slots(int n) {
    LOOM_CHECK(n >= 1, "a model needs at least one activation slot, got ", n);
    slots_.resize(static_cast<std::size_t>(n));
    if (B_ > 0) {
      const int B = B_, T_old = T_;
      B_ = 0, T_ = 0;
      resize(B, T_old);
    }
  }
  int slots() const { return static_cast<int>(slots_.size()); }

  //! Whether this part holds the embedding (block 0), the loss (the last block); its blocks [first, last).
  bool embedding() const { return first_ == 0; }
  bool head() const { return last_ == S.layers; }
  int first_layer() const { return first_; }
  int last_layer() const { return last_; }

  //! Backward of the micro-batch in `slot`, accumulating into grads(): from its loss (scaled by `scale`) in the
  //! part with the loss, else from doutput (Dev's memory), the gradient of output(slot). Leaves input_grad() for the
  //! previous part.
  void backward(int slot, double scale, const T* doutput = nullptr) {
    LOOM_CHECK(slot >= 0 && slot < static_cast<int>(slots_.size()), "activation slot ", slot, " is outside 0..",
               slots_.size() - 1);
    LOOM_CHECK(head() || doutput != nullptr, "a part without the loss needs the gradient of its output");
    cur_ = slot;
    if (!head() && doutput) ops_.copy(doutput, dx_.data(), std::size_t(region_.rows()) * S.d_model);
    for (int c = 0; c < backward_chunks(); ++c) backward_chunk(c, scale);
  }

  //! Accumulates the gradient of the mean loss of the last forward into grads(), scaled by `scale` (1/m when m
  //! micro-batches make one step).
  void backward(double scale = 1.0) { backward(0, scale); }

  //! Backward runs in chunks, so that gradients can be reduced while the rest is computed: first the loss, the
  //! tied head and the final norm (in the part with the loss); then the blocks, last first; last the embedding (in
  //! the part with it). Before chunk 0 of a part without the loss, input_grad() must hold d(output).
  int backward_chunks() const { return (head() ? 1 : 0) + (last_ - first_) + (embedding() ? 1 : 0); }

  static constexpr std::size_t no_param = static_cast<std::size_t>(-1);
  //! Parameters [first, last) of specs(), whose gradients a backward chunk completes, and `also` one more (the tied
  //! table, completed by the output layer in a part without the embedding).
  struct ParamRange {
    std::size_t first, last, also = no_param;
  };

  //! Runs backward chunk c (in order 0, 1, ...) and returns the parameters whose gradients are now complete
  //! (summed over the tensor-parallel ranks that share them).
  ParamRange backward_chunk(int c, double scale = 1.0) {
    Slot& st = sl();
    LOOM_CHECK(B_ > 0 && st.forwarded, "backward() before forward()");
    LOOM_CHECK(c >= 0 && c < backward_chunks(), "backward chunk ", c, " is outside 0..", backward_chunks() - 1);
    T* dx = dx_.data();
    if (!head()) ++c;  // no loss chunk
    if (c == 0) {  // loss, head, final norm
      head_input(scale, dlnf_.data());
      head_weight(dlnf_.data());
      // The tied table's gradient is complete here unless this part also holds the embedding.
      return {lnf_w_, lnf_b_ + 1, embedding() ? no_param : wte_};
    }
    if (c <= last_ - first_) {
      const int l = last_ - c;
      backward_input(l);
      backward_weight(l);
      const std::size_t p = block_param(l);
      return {p, p + 12};
    }
    embedding_weight(dx);
    return {wte_, wpe_ + 1};
  }

  //! The backward of the micro-batch in `slot` split in two, as zero-bubble schedules run it. B: the gradient of
  //! this part's input (from the loss, scaled by `scale`, in the part with the loss, else from doutput), left in
  //! input_grad(); what the weight gradients need is kept in the slot. Not with recompute.
  void backward_inputs(int slot, double scale, const T* doutput = nullptr) {
    LOOM_CHECK(!opt_.recompute, "the split backward (B, then W) keeps every block's branch gradients; it does not "
               "combine with recompute");
    LOOM_CHECK(slot >= 0 && slot < static_cast<int>(slots_.size()), "activation slot ", slot, " is outside 0..",
               slots_.size() - 1);
    LOOM_CHECK(head() || doutput != nullptr, "a part without the loss needs the gradient of its output");
    cur_ = slot;
    Split& sp = split(slot);
    if (head()) head_input(scale, sp.dlnf.data());
    else if (doutput) ops_.copy(doutput, dx_.data(), std::size_t(region_.rows()) * S.d_model);
    split_ = &sp;
    for (int l = last_ - 1; l >= first_; --l) backward_input(l);
    split_ = nullptr;
    if (embedding()) ops_.copy(dx_.data(), sp.dx.data(), static_cast<std::size_t>(sp.dx.numel()));
  }
  //! W: the weight gradients of the micro-batch in `slot`, after backward_inputs(slot); accumulates into grads().
  void backward_weights(int slot) {
    cur_ = slot;
    Split& sp = split(slot);
    if (head()) head_weight(sp.dlnf.data());
    split_ = &sp;
    for (int l = last_ - 1; l >= first_; --l) backward_weight(l);
    split_ = nullptr;
    if (embedding()) embedding_weight(sp.dx.data());
  }

  //! Block l's part of backward that produces the gradient of its input: on entry dx holds d(output of block l),
  //! on return d(input of block l). Keeps the branch gradients that backward_weight(l) needs.
  void backward_input(int l) {
    trace::Scope span("backward_input block", "compute");
    auto counted = tp_.counting(layers::Phase::backward);
    Act& a = opt_.recompute ? scratch_act_ : act(l);
    if (opt_.recompute) layer_forward(l, a, recompute_out_.data());
    const Block w = block(params_, l);
    const int d = S.d_model, rows = region_.rows();
    const std::size_t nd = std::size_t(rows) * d;
    T* dx = dx_.data();
    Grads& g = grads_of(l);
    // MLP branch: x3 = x2 + drop(mlp(ln2(x2)))
    drop_backward(dx, g.dfcp.data(), nd, l, 2);
    mlp_->backward_input(g.dfcp.data(), w.mlp, a.mlp, g.mlp, g.dln2.data());
    ops_.layernorm_backward_input(g.dln2.data(), a.x2.data(), w.ln2_w, a.mean2.data(), a.rstd2.data(),
                                  g.dtmp.data(), rows, d);
    ops_.accumulate(g.dtmp.data(), dx, nd);  // dx is now d(x2)
    // Attention branch: x2 = x + drop(attention(ln1(x)))
    drop_backward(dx, g.dattp.data(), nd, l, 1);
    attn_->backward_input(g.dattp.data(), w.attn, a.attn, g.attn, g.dln1.data());
    ops_.layernorm_backward_input(g.dln1.data(), input_of(l), w.ln1_w, a.mean1.data(), a.rstd1.data(),
                                  g.dtmp.data(), rows, d);
    ops_.accumulate(g.dtmp.data(), dx, nd);  // d(x)
  }

  //! Block l's weight gradients, from the branch gradients kept by backward_input(l); accumulates into grads() and
  //! sums the gradients that tensor-parallel ranks share.
  void backward_weight(int l) {
    trace::Scope span("backward_weight block", "compute");
    Act& a = opt_.recompute ? scratch_act_ : act(l);
    const Block gw = block(grads_, l);
    Grads& g = grads_of(l);
    const std::size_t p = block_param(l);
    keep_shared({p, p + 12});
    const int d = S.d_model, rows = region_.rows();
    mlp_->backward_weight(a.ln2.data(), g.dfcp.data(), a.mlp, g.mlp, gw.mlp);
    ops_.layernorm_backward_weight(g.dln2.data(), a.x2.data(), a.mean2.data(), a.rstd2.data(), gw.ln2_w, gw.ln2_b,
                                   rows, d);
    attn_->backward_weight(a.ln1.data(), g.dattp.data(), a.attn, g.attn, gw.attn);
    ops_.layernorm_backward_weight(g.dln1.data(), input_of(l), a.mean1.data(), a.rstd1.data(), gw.ln1_w, gw.ln1_b,
                                   rows, d);
    sync_grads({p, p + 12});
  }

  //! The global gradient norm: each element of the whole model counted once, whichever ranks hold it.
  double grad_norm() { return std::sqrt(grad_square()); }
  //! The sum of squares of this part's gradients over its tensor-parallel group, each element counted once;
  //! without the tied table when skip_tied (a pipeline counts it on one of the two stages that hold it).
  double grad_square(bool skip_tied = false) {
    double local = 0;
    for (std::size_t p = 0; p < specs_.size(); ++p) {
      if (skip_tied && p == wte_) continue;
      const auto& s = specs_[p];
      const T* g = grads_.data() + s.offset;
      s.layout.for_each_piece([&](std::int64_t lo, std::int64_t, std::int64_t n, int replicas) {
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
    if (wte_ == no_param) return {};
    return {grads_.data() + specs_[wte_].offset, static_cast<std::size_t>(numel_of(specs_[wte_].shape))};
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

  //! The whole model's parameters (or any buffer laid out as them, such as an optimizer's moments) in the
  //! single-rank layout: a collective over the tensor-parallel group; every rank receives the result (in host
  //! memory; local is in Dev's). A part of the model fills only its own parameters (the others are 0).
  template <class U>
  std::vector<U> gather(const U* local) {
    static_assert(std::is_same_v<U, T> || std::is_same_v<U, acc>, "loom: gather() takes parameters or moments");
    std::vector<U> staged;
    if constexpr (!on_host) {
      staged.resize(static_cast<std::size_t>(params_.numel()));
      ops_.to_host(local, staged.data(), staged.size());
      local = staged.data();
    }
    const auto global = param_specs(0, true);
    std::vector<U> out(static_cast<std::size_t>(S.params()));
    if (tp_size == 1 && specs_.size() == global.size()) {
      std::copy_n(local, out.size(), out.data());
      return out;
    }
    std::vector<std::int64_t> width(specs_.size()), at(specs_.size() + 1, 0);
    for (std::size_t p = 0; p < specs_.size(); ++p) {
      for (int r = 0; r < tp_size; ++r)
        width[p] = std::max(width[p], specs_[p].layout.for_rank(r).local_numel());
      at[p + 1] = at[p] + width[p];
    }
    std::vector<U> send(static_cast<std::size_t>(at.back()), U(0)), recv(send.size() * tp_size);
    for (std::size_t p = 0; p < specs_.size(); ++p)
      std::copy_n(local + specs_[p].offset, numel_of(specs_[p].shape), send.data() + at[p]);
    {
      auto counted = tp_.counting(layers::Phase::other);
      if constexpr (std::is_same_v<U, T>) tp_.all_gather(send.data(), recv.data(), send.size());
      else tp_.all_gather_acc(send.data(), recv.data(), send.size());
    }
    for (std::size_t p = 0; p < specs_.size(); ++p)
      for (int r = 0; r < tp_size; ++r)
        specs_[p].layout.for_rank(r).place(recv.data() + r * send.size() + at[p],
                                           out.data() + global[specs_[p].index].offset);
    return out;
  }
  //! Sets this rank's part (local, in Dev's memory) from a buffer in the single-rank layout in host memory (no
  //! communication).
  template <class U>
  void scatter(const U* global_buffer, U* local) const {
    if constexpr (!on_host) {  // every element of local is written: build it on the host, copy it over
      std::vector<U> staged(static_cast<std::size_t>(params_.numel()));
      Gpt::scatter_on_host(specs_, global_buffer, staged.data());
      ops_.from_host(staged.data(), local, staged.size());
    } else {
      scatter_on_host(specs_, global_buffer, local);
    }
  }

  //! Bytes of activations and gradient scratch held for the current batch shape.
  std::size_t activation_bytes() const { return held_bytes(); }

 private:
  //! Pointers to block l's parameters (or gradients) inside a flat buffer.
  struct Block {
    T *ln1_w, *ln1_b;
    typename layers::ParallelAttention<T, Dev>::Params attn;
    T *ln2_w, *ln2_b;
    typename layers::ParallelMlp<T, Dev>::Params mlp;
  };
  //! What one block keeps from forward for backward; x, ln1, x2 and ln2 hold this rank's rows.
  struct Act {
    Tensor<T, Dev> x, ln1, x2, ln2;
    Tensor<acc, Dev> mean1, rstd1, mean2, rstd2;
    typename layers::ParallelAttention<T, Dev>::Acts attn;
    typename layers::ParallelMlp<T, Dev>::Acts mlp;
  };
  struct Grads {
    Tensor<T, Dev> dfcp, dln2, dtmp, dattp, dln1;
    typename layers::ParallelAttention<T, Dev>::Grads attn;
    typename layers::ParallelMlp<T, Dev>::Grads mlp;
  };

  //! Block l's activations (l global).
  Act& act(int l) { return sl().act[static_cast<std::size_t>(l - first_)]; }

  //! What one micro-batch in flight keeps: its blocks' activations, its output (or final residual) and loss.
  struct Slot {
    std::vector<Act> act;
    std::vector<Tensor<T, Dev>> inputs;  //!< with recompute: each block's input
    Tensor<T, Dev> out, lnf, lnf_full, logits, losses;
    Tensor<acc, Dev> lnf_mean, lnf_rstd, row_max, row_sumexp;
    //! The tokens where the kernels read them: the caller's arrays on the host, the copies below on a device.
    const std::int32_t* ids = nullptr;
    const std::int32_t* targets = nullptr;
    Tensor<std::int32_t, Dev> ids_on_device, targets_on_device;
    std::uint64_t step = 0;
    std::int64_t row0 = 0;
    bool forwarded = false;
  };
  Slot& sl() { return slots_[static_cast<std::size_t>(cur_)]; }
  const Slot& sl() const { return slots_[static_cast<std::size_t>(cur_)]; }

  Gpt(layers::TpGroup<T> tp, std::uint64_t seed, GptOptions opt, GptPart part)
      : opt_(opt), tp_(std::move(tp)), first_(part.first), last_(part.last < 0 ? S.layers : part.last),
        specs_(param_specs(tp_.rank(), false, part)), slots_(1) {
    LOOM_CHECK(0 <= first_ && first_ < last_ && last_ <= S.layers, "a part of the model holds blocks [", part.first,
               ", ", part.last, "), which is not a non-empty range of 0..", S.layers);
    const bool tied = embedding() || head();
    wte_ = tied ? 0 : no_param;
    wpe_ = embedding() ? 1 : no_param;
    block0_ = (tied ? 1 : 0) + (embedding() ? 1 : 0);
    lnf_w_ = head() ? block0_ + 12 * static_cast<std::size_t>(last_ - first_) : no_param;
    lnf_b_ = lnf_w_ + 1;
    LOOM_CHECK(tp_.size() == tp_size, "the tensor-parallel communicator has ", tp_.size(), " ranks but the layout ",
               Cfg::name(), " has tp = ", tp_size);
    const std::int64_t n = specs_.empty() ? 0 : specs_.back().offset + numel_of(specs_.back().shape);
    params_ = Tensor<T, Dev>::zeros({n});
    grads_ = Tensor<T, Dev>::zeros({n});
    if constexpr (on_host) {
      layers::initialise(specs_, params_.data(), seed);
    } else {  // made on the host, element by element as there, then copied
      const auto init = Tensor<T>::zeros({n});
      layers::initialise(specs_, init.data(), seed);
      ops_.from_host(init.data(), params_.data(), static_cast<std::size_t>(n));
    }
    slice_ = layers::vocab_slice(S.vocab, tp_size, tp_.rank());
  }

  static constexpr bool on_host = kernels::is_host_v<Dev>;

  //! The single-rank layout's buffer into this rank's part, both in host memory.
  template <class U>
  static void scatter_on_host(const std::vector<ParamSpec>& specs, const U* global_buffer, U* local) {
    const auto global = param_specs(0, true);
    for (std::size_t p = 0; p < specs.size(); ++p)
      specs[p].layout.scatter(global_buffer + global[specs[p].index].offset, local + specs[p].offset);
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

  T* param_ptr(std::size_t p) const { return params_.data() + specs_[p].offset; }
  T* grad_ptr(std::size_t p) const { return grads_.data() + specs_[p].offset; }
  //! The index in specs() of block l's first parameter.
  std::size_t block_param(int l) const { return block0_ + 12 * static_cast<std::size_t>(l - first_); }
  Block block(const Tensor<T, Dev>& buf, int l) const {
    T* b = buf.data();
    const std::size_t p = block_param(l);
    auto at = [&](std::size_t i) { return b + specs_[p + i].offset; };
    return {at(0), at(1), {at(2), at(3), at(4), at(5)}, at(6), at(7), {at(8), at(9), at(10), at(11)}};
  }
  Tensor<T, Dev> view_of(const Tensor<T, Dev>& buf, std::string_view name) const {
    for (const auto& s : specs_)
      if (s.name == name) return buf.slice(0, s.offset, s.offset + numel_of(s.shape)).view(s.shape);
    throw Error(loom::detail::cat("loom: the model has no parameter named '", name, "'"));
  }
  //! buf with sequence parallelism, else alt: where a full (N-row) tensor lives.
  T* sp_or(const Tensor<T, Dev>& buf, T* alt) const { return sequence_parallel ? buf.data() : alt; }

  //! The loss's backward to the gradient of the last block's output (dx_): cross-entropy, the tied output layer's
  //! input gradient, the final norm's input gradient; dlnf (this rank's rows x d) keeps the norm's output gradient.
  void head_input(double scale, T* dlnf) {
    Slot& st = sl();
    const int N = B_ * T_, d = S.d_model, rows = region_.rows();
    auto counted = tp_.counting(layers::Phase::other);
    ops_.fill(dloss_.data(), std::size_t(N), static_cast<T>(scale / N));
    T* logits = st.logits.data();
    ce_->backward(logits, st.targets, st.row_max.data(), st.row_sumexp.data(), dloss_.data(), logits);
    T* dlnf_full = sp_or(dlnf_full_, dlnf);
    ops_.matmul(logits, param_ptr(wte_), dlnf_full, N, d, slice_.count, false, false);
    region_.enter_backward(dlnf_full, dlnf);
    ops_.layernorm_backward_input(dlnf, next_input(last_ - 1), param_ptr(lnf_w_), st.lnf_mean.data(),
                                  st.lnf_rstd.data(), dx_.data(), rows, d);
  }
  //! The loss's weight gradients: the tied table (this rank's vocabulary rows) and the final norm.
  void head_weight(const T* dlnf) {
    Slot& st = sl();
    const int N = B_ * T_, d = S.d_model, rows = region_.rows();
    auto counted = tp_.counting(layers::Phase::other);
    keep_shared({lnf_w_, lnf_b_ + 1});
    ops_.matmul(st.logits.data(), sp_or(st.lnf_full, st.lnf.data()), grad_ptr(wte_), slice_.count, d, N, true, false,
                1.0f, 1.0f);
    ops_.layernorm_backward_weight(dlnf, next_input(last_ - 1), st.lnf_mean.data(), st.lnf_rstd.data(),
                                   grad_ptr(lnf_w_), grad_ptr(lnf_b_), rows, d);
    sync_grads({lnf_w_, lnf_b_ + 1});
  }
  //! The embedding's weight gradients from dx, the gradient of its output (overwritten): dropout, tokens (a
  //! scatter-add into this rank's rows of the tied table), positions.
  void embedding_weight(T* dx) {
    auto counted = tp_.counting(layers::Phase::other);
    keep_shared({wte_, wpe_ + 1});
    drop_backward(dx, dx, std::size_t(region_.rows()) * S.d_model, 0, 0);
    emb_->backward(sl().ids, dx, sp_or(emb_full_, dx), grad_ptr(wte_));
    positions_backward(dx);
    sync_grads({wte_, wpe_ + 1});
  }

  //! What the split backward keeps per slot between B and W: each block's branch gradients, the final norm's
  //! output gradient, the embedding's output gradient.
  struct Split {
    std::vector<Grads> blocks;
    Tensor<T, Dev> dlnf, dx;
  };
  Split& split(int slot) {
    if (splits_.size() != slots_.size()) splits_.assign(slots_.size(), Split{});
    Split& sp = splits_[static_cast<std::size_t>(slot)];
    if (sp.blocks.empty()) {
      const std::int64_t rows = region_.rows(), d = S.d_model;
      for (int l = first_; l < last_; ++l) sp.blocks.push_back(make_grads());
      if (head()) sp.dlnf = Tensor<T, Dev>({rows, d});
      if (embedding()) sp.dx = Tensor<T, Dev>({rows, d});
    }
    return sp;
  }
  //! The branch gradients block l uses: its own in a split backward, else the shared ones.
  Grads& grads_of(int l) { return split_ ? split_->blocks[static_cast<std::size_t>(l - first_)] : g_; }
  Grads make_grads() const {
    const std::int64_t rows = region_.rows(), d = S.d_model;
    using Buf = Tensor<T, Dev>;
    return Grads{Buf({rows, d}), Buf({rows, d}), Buf({rows, d}), Buf({rows, d}), Buf({rows, d}), attn_->make_grads(),
                 mlp_->make_grads()};
  }

  //! Sums over the tensor-parallel group the gradients that several of its ranks hold, of parameters [first, last):
  //! with sequence parallelism the replicated ones (each rank saw its own tokens), and the key/value heads that
  //! ranks share when kv_heads < TP; one all-reduce for all of them. Only what this backward added since
  //! keep_shared(r) is summed, so that gradients accumulated over micro-batches are summed once.
  ParamRange sync_grads(ParamRange r) {
    if constexpr (tp_size == 1) {
      return r;
    } else {
      std::vector<T> buf;
      if (!pack_shared(r, buf)) return r;
      LOOM_CHECK(buf.size() == shared_before_.size(), "sync_grads without keep_shared");
      for (std::size_t i = 0; i < buf.size(); ++i) buf[i] -= shared_before_[i];
      {
        auto counted = tp_.counting(layers::Phase::grads);
        tp_.all_reduce(buf.data(), buf.size());
      }
      for (std::size_t i = 0; i < buf.size(); ++i) buf[i] += shared_before_[i];
      each_shared(r, buf, [](T* g, T* b, std::int64_t len) { std::copy_n(b, len, g); });
      return r;
    }
  }
  //! Remembers the shared gradients of parameters r before a backward adds to them.
  void keep_shared(ParamRange r) {
    if constexpr (tp_size > 1) pack_shared(r, shared_before_);
  }
  //! The shared gradients of r packed in one buffer laid out alike on every rank (zero where this rank holds
  //! nothing); false when r has none.
  bool pack_shared(ParamRange r, std::vector<T>& buf) const {
    std::int64_t n = 0;
    for (std::size_t p = r.first; p < r.last; ++p)
      if (needs_sync(specs_[p])) n += specs_[p].layout.shared_numel();
    buf.assign(static_cast<std::size_t>(n), T(0));
    if (n == 0) return false;
    each_shared(r, buf, [](T* g, T* b, std::int64_t len) { std::copy_n(g, len, b); });
    return true;
  }
  bool needs_sync(const ParamSpec& s) const {
    return s.layout.shared_numel() > 0 && (!s.replicated || sequence_parallel);
  }
  //! f(gradient piece, its place in the packed buffer, length) over the shared pieces of r.
  template <class F>
  void each_shared(ParamRange r, std::vector<T>& buf, F&& f) const {
    std::int64_t at = 0;
    for (std::size_t p = r.first; p < r.last; ++p) {
      const auto& s = specs_[p];
      if (!needs_sync(s)) continue;
      s.layout.for_each_shared_piece([&](std::int64_t lo, std::int64_t sh, std::int64_t len) {
        f(grads_.data() + s.offset + lo, buf.data() + at + sh, len);
      });
      at += s.layout.shared_numel();
    }
  }


  //! x (this rank's rows) += their positions' embeddings; or, backward, the positions' gradients += dx.
  void add_positions(T* x) const { for_positions([&](int i, int n, int t0) {
      ops_.add_positions(param_ptr(wpe_), x + std::ptrdiff_t(i) * S.d_model, 1, n, S.d_model, t0); }); }
  void positions_backward(const T* dx) const { for_positions([&](int i, int n, int t0) {
      ops_.positions_backward(dx + std::ptrdiff_t(i) * S.d_model, grad_ptr(wpe_), 1, n, S.d_model, t0); }); }
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

  //! Block l's input: block 0 reads the embedding output; block l > 0 the output of block l-1.
  T* input_of(int l) const {
    const auto& st = sl();
    const auto i = static_cast<std::size_t>(l - first_);
    return i == 0 || !opt_.recompute ? st.act[opt_.recompute ? 0 : i].x.data() : st.inputs[i].data();
  }
  //! Where block l writes its output: the next block's input, or the final residual.
  T* next_input(int l) const {
    const auto& st = sl();
    const auto i = static_cast<std::size_t>(l + 1 - first_);
    if (l + 1 < last_) return opt_.recompute ? st.inputs[i].data() : st.act[i].x.data();
    return st.out.data();
  }

  void layer_forward(int l, Act& a, T* out) {
    trace::Scope span("forward block", "compute");
    const Block w = block(params_, l);
    const int d = S.d_model, rows = region_.rows();
    const std::size_t nd = std::size_t(rows) * d;
    const T* x = input_of(l);
    ops_.layernorm_forward(x, w.ln1_w, w.ln1_b, a.ln1.data(), a.mean1.data(), a.rstd1.data(), rows, d, opt_.ln_eps);
    T* x2 = a.x2.data();
    attn_->forward(a.ln1.data(), w.attn, a.attn, partial_.data(), x2);
    drop(x2, x2, nd, l, 1);
    ops_.add(x, x2, x2, nd);
    ops_.layernorm_forward(x2, w.ln2_w, w.ln2_b, a.ln2.data(), a.mean2.data(), a.rstd2.data(), rows, d, opt_.ln_eps);
    mlp_->forward(a.ln2.data(), w.mlp, a.mlp, partial_.data(), out);
    drop(out, out, nd, l, 2);
    ops_.add(x2, out, out, nd);
  }

  // Dropout sites: (layer, site) with site 0 the embedding, 1 the attention branch, 2 the MLP branch; the mask of
  // an element is keyed by its global index, so it is the same whichever rank holds the element.
  std::uint64_t drop_key(int l, int site) const { return random::key(0x6c6f6f6d, sl().step, l, site); }
  std::uint64_t drop_index0() const {
    return (static_cast<std::uint64_t>(sl().row0) * T_ + static_cast<std::uint64_t>(region_.first_row())) *
           S.d_model;
  }
  void drop(const T* in, T* out, std::size_t n, int l, int site) {
    if (opt_.dropout <= 0) return;
    ops_.dropout_forward(in, out, n, opt_.dropout, drop_key(l, site), drop_index0());
  }
  void drop_backward(const T* din, T* dout, std::size_t n, int l, int site) {
    if (opt_.dropout <= 0) {
      ops_.copy(din, dout, n);
      return;
    }
    ops_.dropout_backward(din, dout, n, opt_.dropout, drop_key(l, site), drop_index0());
  }

  void make_act(Act& a, bool with_input) {
    const std::int64_t rows = region_.rows(), d = S.d_model;
    if (with_input) a.x = Tensor<T, Dev>({rows, d});
    a.ln1 = Tensor<T, Dev>({rows, d});
    a.x2 = Tensor<T, Dev>({rows, d});
    a.ln2 = Tensor<T, Dev>({rows, d});
    a.mean1 = Tensor<acc, Dev>({rows});
    a.rstd1 = Tensor<acc, Dev>({rows});
    a.mean2 = Tensor<acc, Dev>({rows});
    a.rstd2 = Tensor<acc, Dev>({rows});
    a.attn = attn_->make_acts();
    a.mlp = mlp_->make_acts();
  }

  void resize(int B, int T_new) {
    if (B == B_ && T_new == T_) return;
    B_ = B, T_ = T_new;
    const int N = B * T_new;
    const std::int64_t d = S.d_model;
    region_ = layers::Region<T, Dev>{&tp_, sequence_parallel, N, S.d_model, ops_};
    const std::int64_t rows = region_.rows(), n = N;
    attn_.emplace(region_, B, T_new, S.heads, S.kv_heads, S.head_dim());
    mlp_.emplace(region_, S.ffn());
    emb_.emplace(layers::VocabParallelEmbedding<T, Dev>{region_, slice_});
    ce_.emplace(layers::VocabParallelCrossEntropy<T, Dev>{&tp_, N, slice_, ops_});
    const int L = last_ - first_;
    for (auto& st : slots_) {
      st.act.assign(static_cast<std::size_t>(L), Act{});
      st.inputs.assign(static_cast<std::size_t>(L), Tensor<T, Dev>{});
      if (opt_.recompute) {
        st.act[0].x = Tensor<T, Dev>({rows, d});  // the part's input, its first block's
        for (int i = 1; i < L; ++i) st.inputs[static_cast<std::size_t>(i)] = Tensor<T, Dev>({rows, d});
      } else {
        for (auto& a : st.act) make_act(a, true);
      }
      st.out = Tensor<T, Dev>({rows, d});
      st.lnf = st.lnf_full = st.logits = st.losses = Tensor<T, Dev>();
      st.lnf_mean = st.lnf_rstd = st.row_max = st.row_sumexp = Tensor<acc, Dev>();
      if (head()) {
        st.lnf = Tensor<T, Dev>({rows, d});
        st.lnf_mean = Tensor<acc, Dev>({rows});
        st.lnf_rstd = Tensor<acc, Dev>({rows});
        if (sequence_parallel) st.lnf_full = Tensor<T, Dev>({n, d});
        st.logits = Tensor<T, Dev>({n, slice_.count});
        st.losses = Tensor<T, Dev>({n});
        st.row_max = Tensor<acc, Dev>({n});
        st.row_sumexp = Tensor<acc, Dev>({n});
      }
      st.ids = st.targets = nullptr;
      st.forwarded = false;
    }
    if (opt_.recompute) {
      make_act(scratch_act_, false);
      recompute_out_ = Tensor<T, Dev>({rows, d});
    }
    dlnf_ = Tensor<T, Dev>({rows, d});
    dx_ = Tensor<T, Dev>({rows, d});
    if (sequence_parallel) {
      partial_ = Tensor<T, Dev>({n, d});
      emb_full_ = Tensor<T, Dev>({n, d});
      dlnf_full_ = Tensor<T, Dev>({n, d});
    }
    dloss_ = Tensor<T, Dev>({n});
    g_ = make_grads();
    splits_.clear();
  }

  //! Bytes of every activation and scratch tensor this model holds (its own count: ranks that are threads of one
  //! process share the process's).
  std::size_t held_bytes() const {
    std::size_t n = 0;
    auto add = [&](const auto&... t) { ((n += t.defined() ? t.bytes() : 0), ...); };
    auto add_act = [&](const Act& a) {
      add(a.x, a.ln1, a.x2, a.ln2, a.mean1, a.rstd1, a.mean2, a.rstd2, a.attn.in_full, a.attn.qkv, a.attn.out,
          a.attn.lse, a.mlp.in_full, a.mlp.h, a.mlp.g);
    };
    for (const auto& st : slots_) {
      for (const auto& a : st.act) add_act(a);
      for (const auto& t : st.inputs) add(t);
      add(st.out, st.lnf, st.lnf_full, st.logits, st.losses, st.lnf_mean, st.lnf_rstd, st.row_max, st.row_sumexp);
    }
    add_act(scratch_act_);
    add(recompute_out_, dlnf_, dx_, partial_, emb_full_, dlnf_full_, dloss_);
    auto add_grads = [&](const Grads& g) {
      add(g.dfcp, g.dln2, g.dtmp, g.dattp, g.dln1, g.attn.dy_full, g.attn.dout, g.attn.dqkv, g.attn.dx_full,
          g.mlp.dy_full, g.mlp.dg, g.mlp.dx_full);
    };
    add_grads(g_);
    for (const auto& sp : splits_) {
      for (const auto& g : sp.blocks) add_grads(g);
      add(sp.dlnf, sp.dx);
    }
    return n;
  }

  GptOptions opt_;
  kernels::Ops<Dev> ops_{};
  layers::TpGroup<T> tp_;
  int first_, last_;
  std::vector<ParamSpec> specs_;
  Tensor<T, Dev> params_, grads_;
  layers::VocabSlice slice_{0, S.vocab};
  layers::Region<T, Dev> region_{nullptr, false, 0, S.d_model};
  std::optional<layers::ParallelAttention<T, Dev>> attn_;
  std::optional<layers::ParallelMlp<T, Dev>> mlp_;
  std::optional<layers::VocabParallelEmbedding<T, Dev>> emb_;
  std::optional<layers::VocabParallelCrossEntropy<T, Dev>> ce_;
  std::size_t wte_ = 0, wpe_ = 0, block0_ = 0, lnf_w_ = 0, lnf_b_ = 0;  //!< indices in specs_ (no_param: not held)
  int B_ = 0, T_ = 0;
  std::vector<Slot> slots_;
  int cur_ = 0;  //!< the slot forward and backward work on
  Act scratch_act_;
  Tensor<T, Dev> recompute_out_, dlnf_, dx_, partial_, emb_full_, dlnf_full_, dloss_;
  Grads g_;
  std::vector<Split> splits_;
  Split* split_ = nullptr;  //!< during a split backward: the slot's
  std::vector<T> shared_before_;
};

}  // namespace loom::models

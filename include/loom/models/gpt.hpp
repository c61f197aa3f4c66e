// A GPT-2-style decoder on one rank: pre-LayerNorm blocks, learned positions, tied input and output embedding, GELU
// MLP of width 4d, optional grouped-query attention. Its shape is a compile-time value; its parameters are named and
// laid out as Hugging Face's GPT-2 (h.{i}.attn.c_attn.weight is [d, 3d], ...), in one flat buffer. Each block has
// an explicit forward, backward_input and backward_weight; activations may be recomputed per layer.
#pragma once

#include <loom/core/random.hpp>
#include <loom/core/trace.hpp>
#include <loom/kernels/cpu/ops.hpp>
#include <loom/tensor/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom::models {

//! The shape of a GPT. vocab is the full vocabulary, max_seq the number of learned positions.
struct GptShape {
  int layers, heads, kv_heads, d_model, vocab, max_seq;

  constexpr int head_dim() const { return d_model / heads; }
  constexpr int qkv_width() const { return (heads + 2 * kv_heads) * head_dim(); }
  constexpr int ffn() const { return 4 * d_model; }
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
inline constexpr GptShape small{4, 4, 4, 256, 256, 256};
inline constexpr GptShape gpt2{12, 12, 12, 768, 50257, 1024};

//! One named parameter: where it lies in the flat buffer, its shape, and whether weight decay applies (matrices and
//! embeddings, not biases or LayerNorm parameters).
struct ParamSpec {
  std::string name;
  Shape shape;
  std::int64_t offset;
  bool decay;
  double init_std;  //!< 0: constant init_value
  double init_value;
};

struct GptOptions {
  bool recompute = false;  //!< keep only each block's input; recompute the rest during backward
  float dropout = 0.0f;    //!< on the embedding output and each residual branch
  float ln_eps = 1e-5f;
};

template <GptShape S, class T = float>
class Gpt {
  static_assert(S.layers >= 1 && S.heads >= 1 && S.kv_heads >= 1 && S.d_model >= 1 && S.vocab >= 1 && S.max_seq >= 1,
                "loom: every GPT dimension must be at least 1");
  static_assert(S.d_model % S.heads == 0, "loom: d_model must be divisible by heads");
  static_assert(S.heads % S.kv_heads == 0, "loom: heads must be divisible by kv_heads");

 public:
  using acc = kernels::cpu::acc_t<T>;
  static constexpr GptShape shape = S;

  //! Parameters in Hugging Face's GPT-2 order and layout.
  static std::vector<ParamSpec> param_specs() {
    std::vector<ParamSpec> v;
    std::int64_t at = 0;
    const std::int64_t d = S.d_model, q = S.qkv_width(), f = S.ffn();
    const double std_w = 0.02, std_proj = 0.02 / std::sqrt(2.0 * S.layers);
    auto add = [&](std::string name, Shape shape, bool decay, double init_std, double init_value = 0) {
      const auto n = numel_of(shape);
      v.push_back({std::move(name), std::move(shape), at, decay, init_std, init_value});
      at += n;
    };
    add("wte.weight", {S.vocab, d}, true, std_w);
    add("wpe.weight", {S.max_seq, d}, true, 0.01);
    for (int l = 0; l < S.layers; ++l) {
      const std::string h = "h." + std::to_string(l) + ".";
      add(h + "ln_1.weight", {d}, false, 0, 1);
      add(h + "ln_1.bias", {d}, false, 0);
      add(h + "attn.c_attn.weight", {d, q}, true, std_w);
      add(h + "attn.c_attn.bias", {q}, false, 0);
      add(h + "attn.c_proj.weight", {d, d}, true, std_proj);
      add(h + "attn.c_proj.bias", {d}, false, 0);
      add(h + "ln_2.weight", {d}, false, 0, 1);
      add(h + "ln_2.bias", {d}, false, 0);
      add(h + "mlp.c_fc.weight", {d, f}, true, std_w);
      add(h + "mlp.c_fc.bias", {f}, false, 0);
      add(h + "mlp.c_proj.weight", {f, d}, true, std_proj);
      add(h + "mlp.c_proj.bias", {d}, false, 0);
    }
    add("ln_f.weight", {d}, false, 0, 1);
    add("ln_f.bias", {d}, false, 0);
    return v;
  }

  //! Initialised from seed: element i of parameter p is a function of (seed, p, i) alone.
  explicit Gpt(std::uint64_t seed, GptOptions opt = {})
      : opt_(opt), specs_(param_specs()), params_(Tensor<T>::zeros({S.params()})),
        grads_(Tensor<T>::zeros({S.params()})) {
    for (std::size_t p = 0; p < specs_.size(); ++p) {
      const auto& s = specs_[p];
      T* w = params_.data() + s.offset;
      const auto n = numel_of(s.shape);
      const auto k = random::key(seed, p);
      for (std::int64_t i = 0; i < n; ++i)
        w[i] = static_cast<T>(s.init_std > 0 ? s.init_std * random::normal(k, static_cast<std::uint64_t>(i))
                                              : s.init_value);
    }
  }

  const std::vector<ParamSpec>& specs() const { return specs_; }
  const Tensor<T>& params() const { return params_; }
  const Tensor<T>& grads() const { return grads_; }
  const GptOptions& options() const { return opt_; }
  //! A view of one parameter (or its gradient) by its Hugging Face name.
  Tensor<T> param(std::string_view name) const { return view_of(params_, name); }
  Tensor<T> grad(std::string_view name) const { return view_of(grads_, name); }
  void zero_grad() { grads_.fill(T(0)); }

  //! Mean cross-entropy of B sequences of T tokens (ids, targets: B*T each), keeping what backward needs.
  //! step and row0 (the global index of this batch's first sequence) key dropout, so that its mask does not depend on
  //! how the batch is split.
  double forward(const std::int32_t* ids, const std::int32_t* targets, int B, int T_, std::uint64_t step = 0,
                 std::int64_t row0 = 0) {
    LOOM_CHECK(T_ >= 1 && T_ <= S.max_seq, "sequence length ", T_, " is outside 1..", S.max_seq,
               " (the model's max_seq)");
    LOOM_CHECK(B >= 1, "batch of ", B, " sequences");
    for (std::int64_t i = 0; i < std::int64_t{B} * T_; ++i)
      LOOM_CHECK(ids[i] >= 0 && ids[i] < S.vocab && targets[i] >= 0 && targets[i] < S.vocab, "token ",
                 ids[i] < 0 || ids[i] >= S.vocab ? ids[i] : targets[i], " at position ", i,
                 " is outside the vocabulary 0..", S.vocab - 1);
    resize(B, T_);
    ids_ = ids, targets_ = targets, step_ = step, row0_ = row0;
    namespace k = kernels::cpu;
    const int N = B * T_, d = S.d_model;
    T* x0 = act_[0].x.data();
    k::embedding_forward(ids, param_ptr(wte_), x0, N, d, 0, S.vocab);
    k::add_positions(param_ptr(wpe_), x0, B, T_, d);
    drop(x0, x0, std::size_t(N) * d, 0, 0);
    for (int l = 0; l < S.layers; ++l) layer_forward(l, opt_.recompute ? scratch_act_ : act_[l], next_input(l));
    // Final norm, logits against the tied embedding, loss.
    T* xl = next_input(S.layers - 1);
    k::layernorm_forward(xl, param_ptr(lnf_w_), param_ptr(lnf_b_), lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(),
                         N, d, opt_.ln_eps);
    k::matmul(lnf_.data(), param_ptr(wte_), logits_.data(), N, S.vocab, d, false, true);
    k::cross_entropy_forward(logits_.data(), targets, losses_.data(), row_max_.data(), row_sumexp_.data(), N, S.vocab);
    double sum = 0;
    for (int i = 0; i < N; ++i) sum += static_cast<double>(losses_.data()[i]);
    return sum / N;
  }

  //! Accumulates the gradient of the mean loss of the last forward into grads(), scaled by `scale` (1/m when m
  //! micro-batches make one step).
  void backward(double scale = 1.0) {
    for (int c = 0; c < backward_chunks(); ++c) backward_chunk(c, scale);
  }

  //! Backward runs in chunks, so that gradients can be reduced while the rest is computed: chunk 0 is the loss,
  //! the tied head and the final norm; chunk 1 + j is block L-1-j; the last chunk is the embedding.
  static constexpr int backward_chunks() { return S.layers + 2; }

  //! Parameters [first, last) of specs(), whose gradients a backward chunk completes.
  struct ParamRange {
    std::size_t first, last;
  };

  //! Runs backward chunk c (in order 0, 1, ...) and returns the parameters whose gradients are now complete.
  ParamRange backward_chunk(int c, double scale = 1.0) {
    LOOM_CHECK(ids_ != nullptr, "backward() before forward()");
    LOOM_CHECK(c >= 0 && c < backward_chunks(), "backward chunk ", c, " is outside 0..", backward_chunks() - 1);
    namespace k = kernels::cpu;
    const int N = B_ * T_, d = S.d_model;
    T* dx = dx_.data();
    if (c == 0) {  // loss, head, final norm
      for (int i = 0; i < N; ++i) dloss_.data()[i] = static_cast<T>(scale / N);
      k::ce_backward(logits_.data(), targets_, row_max_.data(), row_sumexp_.data(), dloss_.data(), logits_.data(), N,
                     S.vocab, 0);
      k::matmul(logits_.data(), param_ptr(wte_), dlnf_.data(), N, d, S.vocab, false, false);
      k::matmul(logits_.data(), lnf_.data(), grad_ptr(wte_), S.vocab, d, N, true, false, 1.0f, 1.0f);
      const T* xl = next_input(S.layers - 1);
      k::layernorm_backward_input(dlnf_.data(), xl, param_ptr(lnf_w_), lnf_mean_.data(), lnf_rstd_.data(), dx, N, d);
      k::layernorm_backward_weight(dlnf_.data(), xl, lnf_mean_.data(), lnf_rstd_.data(), grad_ptr(lnf_w_),
                                   grad_ptr(lnf_b_), N, d);
      return {lnf_w_, lnf_b_ + 1};
    }
    if (c <= S.layers) {
      const int l = S.layers - c;
      backward_input(l);
      backward_weight(l);
      return {2 + 12 * static_cast<std::size_t>(l), 2 + 12 * static_cast<std::size_t>(l) + 12};
    }
    // Embedding: dropout, tokens (scatter-add into the tied table), positions.
    drop_backward(dx, dx, std::size_t(N) * d, 0, 0);
    k::embedding_backward(ids_, dx, grad_ptr(wte_), N, d, 0, S.vocab);
    k::positions_backward(dx, grad_ptr(wpe_), B_, T_, d);
    return {wte_, wpe_ + 1};
  }

  //! Block l's part of backward that produces the gradient of its input: on entry dx holds d(output of block l),
  //! on return d(input of block l). Keeps the branch gradients that backward_weight(l) needs.
  void backward_input(int l) {
    trace::Scope span("backward_input block", "compute");
    namespace k = kernels::cpu;
    Act& a = opt_.recompute ? scratch_act_ : act_[l];
    if (opt_.recompute) layer_forward(l, a, recompute_out_.data());
    const Block w = block(params_, l);
    const int N = B_ * T_, d = S.d_model, f = S.ffn(), q = S.qkv_width();
    const std::size_t nd = std::size_t(N) * d;
    T* dx = dx_.data();
    // MLP branch: x3 = x2 + drop(fc_proj(gelu(fc(ln2(x2)))))
    drop_backward(dx, g_.dfcp.data(), nd, l, 2);
    k::matmul(g_.dfcp.data(), w.fcp_w, g_.dfch.data(), N, f, d, false, true);
    k::gelu_backward(a.fch.data(), g_.dfch.data(), g_.dfch.data(), std::size_t(N) * f);
    k::matmul(g_.dfch.data(), w.fc_w, g_.dln2.data(), N, d, f, false, true);
    k::layernorm_backward_input(g_.dln2.data(), a.x2.data(), w.ln2_w, a.mean2.data(), a.rstd2.data(),
                                g_.dtmp.data(), N, d);
    k::accumulate(g_.dtmp.data(), dx, nd);  // dx is now d(x2)
    // Attention branch: x2 = x + drop(proj(attention(qkv(ln1(x)))))
    drop_backward(dx, g_.dattp.data(), nd, l, 1);
    k::matmul(g_.dattp.data(), w.proj_w, g_.datty.data(), N, d, d, false, true);
    const auto sh = attention_shape();
    const T* qkv = a.qkv.data();
    T* dqkv = g_.dqkv.data();
    k::attention_backward(g_.datty.data(), qkv, qkv + S.heads * S.head_dim(),
                          qkv + (S.heads + S.kv_heads) * S.head_dim(), a.atty.data(), a.lse.data(), dqkv,
                          dqkv + S.heads * S.head_dim(), dqkv + (S.heads + S.kv_heads) * S.head_dim(), sh);
    k::matmul(dqkv, w.qkv_w, g_.dln1.data(), N, d, q, false, true);
    k::layernorm_backward_input(g_.dln1.data(), input_of(l), w.ln1_w, a.mean1.data(), a.rstd1.data(),
                                g_.dtmp.data(), N, d);
    k::accumulate(g_.dtmp.data(), dx, nd);  // d(x)
  }

  //! Block l's weight gradients, from the branch gradients kept by backward_input(l); accumulates into grads().
  void backward_weight(int l) {
    trace::Scope span("backward_weight block", "compute");
    namespace k = kernels::cpu;
    Act& a = opt_.recompute ? scratch_act_ : act_[l];
    const Block gw = block(grads_, l);
    const int N = B_ * T_, d = S.d_model, f = S.ffn(), q = S.qkv_width();
    k::matmul(a.fchg.data(), g_.dfcp.data(), gw.fcp_w, f, d, N, true, false, 1.0f, 1.0f);
    k::bias_backward(g_.dfcp.data(), gw.fcp_b, N, d);
    k::matmul(a.ln2.data(), g_.dfch.data(), gw.fc_w, d, f, N, true, false, 1.0f, 1.0f);
    k::bias_backward(g_.dfch.data(), gw.fc_b, N, f);
    k::layernorm_backward_weight(g_.dln2.data(), a.x2.data(), a.mean2.data(), a.rstd2.data(), gw.ln2_w, gw.ln2_b, N,
                                 d);
    k::matmul(a.atty.data(), g_.dattp.data(), gw.proj_w, d, d, N, true, false, 1.0f, 1.0f);
    k::bias_backward(g_.dattp.data(), gw.proj_b, N, d);
    k::matmul(a.ln1.data(), g_.dqkv.data(), gw.qkv_w, d, q, N, true, false, 1.0f, 1.0f);
    k::bias_backward(g_.dqkv.data(), gw.qkv_b, N, q);
    k::layernorm_backward_weight(g_.dln1.data(), input_of(l), a.mean1.data(), a.rstd1.data(), gw.ln1_w, gw.ln1_b, N,
                                 d);
  }

  //! Bytes of activations and gradient scratch held for the current batch shape.
  std::size_t activation_bytes() const { return act_bytes_; }

 private:
  //! Pointers to block l's parameters (or gradients) inside a flat buffer.
  struct Block {
    T *ln1_w, *ln1_b, *qkv_w, *qkv_b, *proj_w, *proj_b, *ln2_w, *ln2_b, *fc_w, *fc_b, *fcp_w, *fcp_b;
  };
  //! What one block keeps from forward for backward.
  struct Act {
    Tensor<T> x, ln1, qkv, atty, x2, ln2, fch, fchg;
    Tensor<acc> mean1, rstd1, lse, mean2, rstd2;
  };
  struct Grads {
    Tensor<T> dfcp, dfch, dln2, dtmp, dattp, datty, dqkv, dln1;
  };

  static constexpr std::size_t wte_ = 0, wpe_ = 1, lnf_w_ = 2 + 12 * S.layers, lnf_b_ = lnf_w_ + 1;

  T* param_ptr(std::size_t p) const { return params_.data() + specs_[p].offset; }
  T* grad_ptr(std::size_t p) const { return grads_.data() + specs_[p].offset; }
  Block block(const Tensor<T>& buf, int l) const {
    T* b = buf.data();
    const std::size_t p = 2 + 12 * static_cast<std::size_t>(l);
    auto at = [&](std::size_t i) { return b + specs_[p + i].offset; };
    return {at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7), at(8), at(9), at(10), at(11)};
  }
  Tensor<T> view_of(const Tensor<T>& buf, std::string_view name) const {
    for (const auto& s : specs_)
      if (s.name == name) return buf.slice(0, s.offset, s.offset + numel_of(s.shape)).view(s.shape);
    throw Error(loom::detail::cat("loom: the model has no parameter named '", name, "'"));
  }

  kernels::cpu::AttentionShape attention_shape() const {
    const std::ptrdiff_t q = S.qkv_width();
    return {B_, T_, S.heads, S.kv_heads, S.head_dim(), q, q, S.d_model,
            1.0 / std::sqrt(static_cast<double>(S.head_dim()))};
  }

  //! Block l's input: block 0 reads the embedding output; block l > 0 the output of block l-1.
  T* input_of(int l) const { return l == 0 || !opt_.recompute ? act_[opt_.recompute ? 0 : l].x.data() : inputs_[l].data(); }
  //! Where block l writes its output: the next block's input, or the final residual.
  T* next_input(int l) const {
    if (l + 1 < S.layers) return opt_.recompute ? inputs_[l + 1].data() : act_[l + 1].x.data();
    return final_.data();
  }

  void layer_forward(int l, Act& a, T* out) {
    trace::Scope span("forward block", "compute");
    namespace k = kernels::cpu;
    const Block w = block(params_, l);
    const int N = B_ * T_, d = S.d_model, f = S.ffn(), q = S.qkv_width();
    const std::size_t nd = std::size_t(N) * d;
    const T* x = input_of(l);
    k::layernorm_forward(x, w.ln1_w, w.ln1_b, a.ln1.data(), a.mean1.data(), a.rstd1.data(), N, d, opt_.ln_eps);
    k::matmul(a.ln1.data(), w.qkv_w, a.qkv.data(), N, q, d, false, false);
    k::bias_add(a.qkv.data(), w.qkv_b, a.qkv.data(), N, q);
    const T* qkv = a.qkv.data();
    k::attention_forward(qkv, qkv + S.heads * S.head_dim(), qkv + (S.heads + S.kv_heads) * S.head_dim(),
                         a.atty.data(), a.lse.data(), attention_shape());
    T* x2 = a.x2.data();
    k::matmul(a.atty.data(), w.proj_w, x2, N, d, d, false, false);
    k::bias_add(x2, w.proj_b, x2, N, d);
    drop(x2, x2, nd, l, 1);
    k::add(x, x2, x2, nd);
    k::layernorm_forward(x2, w.ln2_w, w.ln2_b, a.ln2.data(), a.mean2.data(), a.rstd2.data(), N, d, opt_.ln_eps);
    k::matmul(a.ln2.data(), w.fc_w, a.fch.data(), N, f, d, false, false);
    k::bias_add(a.fch.data(), w.fc_b, a.fch.data(), N, f);
    k::gelu_forward(a.fch.data(), a.fchg.data(), std::size_t(N) * f);
    k::matmul(a.fchg.data(), w.fcp_w, out, N, d, f, false, false);
    k::bias_add(out, w.fcp_b, out, N, d);
    drop(out, out, nd, l, 2);
    k::add(x2, out, out, nd);
  }

  // Dropout sites: (layer, site) with site 0 the embedding, 1 the attention branch, 2 the MLP branch.
  std::uint64_t drop_key(int l, int site) const { return random::key(0x6c6f6f6d, step_, l, site); }
  void drop(const T* in, T* out, std::size_t n, int l, int site) {
    if (opt_.dropout <= 0) return;
    kernels::cpu::dropout_forward(in, out, n, opt_.dropout, drop_key(l, site),
                                  static_cast<std::uint64_t>(row0_) * T_ * S.d_model);
  }
  void drop_backward(const T* din, T* dout, std::size_t n, int l, int site) {
    if (opt_.dropout <= 0) {
      if (din != dout) std::copy_n(din, n, dout);
      return;
    }
    kernels::cpu::dropout_backward(din, dout, n, opt_.dropout, drop_key(l, site),
                                   static_cast<std::uint64_t>(row0_) * T_ * S.d_model);
  }

  void make_act(Act& a, bool with_input) {
    const std::int64_t N = std::int64_t{B_} * T_, d = S.d_model;
    if (with_input) a.x = Tensor<T>({N, d});
    a.ln1 = Tensor<T>({N, d});
    a.qkv = Tensor<T>({N, S.qkv_width()});
    a.atty = Tensor<T>({N, d});
    a.x2 = Tensor<T>({N, d});
    a.ln2 = Tensor<T>({N, d});
    a.fch = Tensor<T>({N, S.ffn()});
    a.fchg = Tensor<T>({N, S.ffn()});
    a.mean1 = Tensor<acc>({N});
    a.rstd1 = Tensor<acc>({N});
    a.mean2 = Tensor<acc>({N});
    a.rstd2 = Tensor<acc>({N});
    a.lse = Tensor<acc>({std::int64_t{B_} * S.heads * T_});
  }

  void resize(int B, int T_new) {
    if (B == B_ && T_new == T_) return;
    const std::size_t before = host_memory().in_use();
    B_ = B, T_ = T_new;
    const std::int64_t N = std::int64_t{B} * T_new, d = S.d_model;
    act_.assign(S.layers, Act{});
    inputs_.assign(S.layers, Tensor<T>{});
    if (opt_.recompute) {
      act_[0].x = Tensor<T>({N, d});  // the embedding output, block 0's input
      make_act(scratch_act_, false);
      for (int l = 1; l < S.layers; ++l) inputs_[l] = Tensor<T>({N, d});
      recompute_out_ = Tensor<T>({N, d});
    } else {
      for (int l = 0; l < S.layers; ++l) make_act(act_[l], true);
    }
    final_ = Tensor<T>({N, d});
    lnf_ = Tensor<T>({N, d});
    dlnf_ = Tensor<T>({N, d});
    dx_ = Tensor<T>({N, d});
    lnf_mean_ = Tensor<acc>({N});
    lnf_rstd_ = Tensor<acc>({N});
    logits_ = Tensor<T>({N, S.vocab});
    losses_ = Tensor<T>({N});
    dloss_ = Tensor<T>({N});
    row_max_ = Tensor<acc>({N});
    row_sumexp_ = Tensor<acc>({N});
    g_ = Grads{Tensor<T>({N, d}),          Tensor<T>({N, S.ffn()}), Tensor<T>({N, d}),
               Tensor<T>({N, d}),          Tensor<T>({N, d}),       Tensor<T>({N, d}),
               Tensor<T>({N, S.qkv_width()}), Tensor<T>({N, d})};
    act_bytes_ = host_memory().in_use() - std::min(before, host_memory().in_use());
  }

  GptOptions opt_;
  std::vector<ParamSpec> specs_;
  Tensor<T> params_, grads_;
  int B_ = 0, T_ = 0;
  std::uint64_t step_ = 0;
  std::int64_t row0_ = 0;
  const std::int32_t* ids_ = nullptr;
  const std::int32_t* targets_ = nullptr;
  std::vector<Act> act_;
  Act scratch_act_;
  std::vector<Tensor<T>> inputs_;
  Tensor<T> recompute_out_, final_, lnf_, dlnf_, dx_, logits_, losses_, dloss_;
  Tensor<acc> lnf_mean_, lnf_rstd_, row_max_, row_sumexp_;
  Grads g_;
  std::size_t act_bytes_ = 0;
};

}  // namespace loom::models

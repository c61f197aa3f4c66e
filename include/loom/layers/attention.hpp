// Causal self-attention split by heads over the tensor-parallel group: a column-parallel q|k|v projection (each of
// q, k and v split by heads), attention over the local heads, and a row-parallel output projection. With grouped
// or multi-query attention the key/value heads are split as the query heads when there are at least as many as
// ranks, and otherwise each is held by t / kv_heads ranks, which then sum its gradient. With context parallelism
// each rank holds its zigzag share of every sequence, and the attention core runs over the cp group, by ring
// attention or by Ulysses' all-to-all (ring_attention.hpp, ulysses_attention.hpp). With rotary positions
// (rotary.hpp) the local query and key heads are rotated by each token's position in its whole sequence after the
// projection, and their gradients rotated back before its backward. The projections' biases are optional.
#pragma once

#include <loom/comm/any.hpp>
#include <loom/config.hpp>
#include <loom/layers/linear.hpp>
#include <loom/layers/ring_attention.hpp>
#include <loom/layers/rotary.hpp>
#include <loom/layers/ulysses_attention.hpp>
#include <loom/tensor/tensor.hpp>

#include <cmath>

namespace loom::layers {

//! The context-parallel group as attention sees it: its communicator (null: no context parallelism) and the
//! algorithm the layout names.
struct CpGroup {
  comm::AnyComm* comm = nullptr;
  CpAlgorithm algorithm = CpAlgorithm::ring;
};

template <class T, class Dev = Host, class Tp = TensorParallel<1>>
struct ParallelAttention {
  using acc = typename kernels::Ops<Dev>::template acc_t<T>;
  using Tensor = loom::Tensor<T, Dev>;
  using AccTensor = loom::Tensor<acc, Dev>;
  struct Params {
    T *qkv_w, *qkv_b, *proj_w, *proj_b;
  };
  //! The attention core's result: its output and row log-sum-exp.
  struct Core {
    Tensor out;
    AccTensor lse;
    bool held() const { return out.data() != nullptr; }
  };
  //! Kept from forward for backward: the gathered input (sequence parallelism only), q|k|v, and the core's result
  //! unless selective recompute recomputes it.
  struct Acts {
    Tensor in_full, qkv;
    Core core;
  };
  //! Gradient scratch, shared by the blocks (or one per block in a split backward); with selective recompute it
  //! holds the recomputed core from backward_input to backward_weight.
  struct Grads {
    Tensor dy_full, dout, dqkv, dx_full;
    Core core;
  };

  //! c_attn [d, (heads + 2 kv_heads) * hd] and c_proj [heads * hd, d] under prefix, with their biases when `bias`.
  static void declare(ParamTable& t, const std::string& prefix, int d, int heads, int kv_heads, double std_w,
                      double std_proj, bool bias = true) {
    const std::int64_t hd = d / heads;
    ColumnParallelLinear<T>::declare(t, prefix + "c_attn", d, {{heads, hd}, {kv_heads, hd}, {kv_heads, hd}}, std_w,
                                     bias);
    RowParallelLinear<T>::declare(t, prefix + "c_proj", {{heads, hd}}, d, std_proj, bias);
  }
  //! The parameters of one attention: 2 without biases, 4 with.
  static std::size_t param_count(bool bias) { return bias ? 4 : 2; }
  //! Params from the attention's first parameter specs[p] in the flat buffer `flat`.
  static Params in(T* flat, const std::vector<ParamSpec>& specs, std::size_t p, bool bias) {
    auto at = [&](std::size_t i) { return flat + specs[p + i].offset; };
    return bias ? Params{at(0), at(1), at(2), at(3)} : Params{at(0), nullptr, at(1), nullptr};
  }

  //! B sequences of T_ tokens on this rank (with context parallelism its two zigzag chunks of each sequence);
  //! rope: the rotary tables, or null for none.
  ParallelAttention(Region<T, Dev, Tp> r, int B, int T_, int heads, int kv_heads, int head_dim, CpGroup cp = {},
                    const Rotary<T, Dev>* rope = nullptr)
      : B_(B), T_(T_), hq_(heads / Tp::size), hkv_(static_cast<int>(units_of(kv_heads, Tp::size, 0).count)),
        hd_(head_dim), cp_(cp), rope_(rope), qkv_{r, (hq_ + 2 * hkv_) * head_dim}, proj_{r, hq_ * head_dim} {}

  int local_heads() const { return hq_; }
  int local_kv_heads() const { return hkv_; }

  //! A core's storage (the result of one attention over the batch).
  Core make_core() const {
    return {Tensor({std::int64_t{qkv_.region.N}, proj_.in}), AccTensor({std::int64_t{B_} * hq_ * T_})};
  }
  //! What forward keeps; keep_core: false under selective recompute.
  Acts make_acts(bool keep_core = true) const {
    const std::int64_t N = qkv_.region.N;
    Acts a{Tensor(), Tensor({N, qkv_.out}), keep_core ? make_core() : Core{}};
    if constexpr (sp) a.in_full = Tensor({N, qkv_.region.C});
    return a;
  }
  //! Backward's scratch; recompute_core: room for the core that selective recompute recomputes.
  Grads make_grads(bool recompute_core = false) const {
    const std::int64_t N = qkv_.region.N, d = qkv_.region.C;
    Grads g{Tensor(), Tensor({N, proj_.in}), Tensor({N, qkv_.out}), Tensor(), recompute_core ? make_core() : Core{}};
    if constexpr (sp) g.dy_full = Tensor({N, d}), g.dx_full = Tensor({N, d});
    return g;
  }

  //! The input every rank uses: gathered with sequence parallelism, else x itself.
  const T* input_full(const T* x, const Acts& a) const { return sp ? a.in_full.data() : x; }

  //! y (this rank's rows x d) from x (this rank's rows x d); partial is N x d scratch (may be y without sequence
  //! parallelism), plus `residual` (x's rows, not y) where given. The core's result goes to a.core, or when forward
  //! does not keep it (selective recompute) to `scratch`.
  void forward(const T* x, const Params& w, Acts& a, T* partial, T* y, Core& scratch,
               const T* residual = nullptr) const {
    qkv_.forward(x, sp ? a.in_full.data() : const_cast<T*>(x), w.qkv_w, w.qkv_b, a.qkv.data());
    rotate(a.qkv.data(), false);
    Core& c = a.core.held() ? a.core : scratch;
    core_forward(a.qkv.data(), c);
    proj_.forward(c.out.data(), w.proj_w, w.proj_b, sp ? partial : y, y, residual);
  }
  //! dx (this rank's rows x d) from dy; keeps what backward_weight needs in g (under selective recompute the core,
  //! recomputed here).
  void backward_input(const T* dy, const Params& w, const Acts& a, Grads& g, T* dx) const {
    if (!a.core.held()) core_forward(a.qkv.data(), g.core);
    const Core& c = core_of(a, g);
    T* dy_full = sp ? g.dy_full.data() : const_cast<T*>(dy);
    proj_.backward_input(dy, dy_full, w.proj_w, g.dout.data());
    core_backward(g.dout.data(), a.qkv.data(), c, g.dqkv.data());
    rotate(g.dqkv.data(), true);
    qkv_.backward_input(g.dqkv.data(), w.qkv_w, sp ? g.dx_full.data() : dx, dx);
  }
  //! Accumulates the weight gradients; x is the block's input to this layer, dy the gradient of its output.
  void backward_weight(const T* x, const T* dy, const Acts& a, const Grads& g, const Params& dw) const {
    proj_.backward_weight(core_of(a, g).out.data(), sp ? g.dy_full.data() : dy, dy, dw.proj_w, dw.proj_b);
    qkv_.backward_weight(input_full(x, a), g.dqkv.data(), dw.qkv_w, dw.qkv_b);
  }

 private:
  static constexpr bool sp = Tp::sequence_parallel;
  kernels::AttentionShape shape() const {
    return {B_, T_, hq_, hkv_, hd_, qkv_.out, qkv_.out, proj_.in, 1.0 / std::sqrt(static_cast<double>(hd_))};
  }
  static const Core& core_of(const Acts& a, const Grads& g) { return a.core.held() ? a.core : g.core; }
  //! With rotary positions: the query and key heads of every row of a q|k|v buffer (N rows) turned by the row's
  //! position in its whole sequence (inverse: back, for their gradients); nothing without.
  void rotate(T* qkv, bool inverse) const {
    if (!rope_) return;
    const int cp = cp_.comm ? cp_.comm->size() : 1, q = cp_.comm ? cp_.comm->rank() : 0;
    const int run = cp > 1 ? T_ / 2 : T_, ld = qkv_.out;
    for (int b = 0; b < B_; ++b)
      for (int t = 0; t < T_; t += run)
        rope_->rotate(qkv + (std::ptrdiff_t(b) * T_ + t) * ld, run, ld, hq_ + hkv_,
                      cp > 1 ? zigzag_position(t, q, cp, run) : t, inverse);
  }
  //! The attention core from q|k|v: on this rank alone, or over the cp group.
  void core_forward(const T* qkv, Core& c) const {
    const T *q = qkv, *k = q + hq_ * hd_, *v = q + (hq_ + hkv_) * hd_;
    if (cp_.comm && cp_.algorithm == CpAlgorithm::ring)
      return ring_attention_forward(*cp_.comm, qkv_.region.ops, q, k, v, c.out.data(), c.lse.data(), shape());
    if (cp_.comm)
      return ulysses_attention_forward(*cp_.comm, qkv_.region.ops, q, k, v, c.out.data(), c.lse.data(), shape());
    qkv_.region.ops.attention_forward(q, k, v, c.out.data(), c.lse.data(), shape());
  }
  //! dq|dk|dv from the gradient of the core's output, q|k|v and the core's result, as core_forward computed it.
  void core_backward(const T* dout, const T* qkv, const Core& c, T* dqkv) const {
    const T *q = qkv, *k = q + hq_ * hd_, *v = q + (hq_ + hkv_) * hd_;
    T *dq = dqkv, *dk = dq + hq_ * hd_, *dv = dq + (hq_ + hkv_) * hd_;
    if (cp_.comm && cp_.algorithm == CpAlgorithm::ring)
      return ring_attention_backward(*cp_.comm, qkv_.region.ops, dout, q, k, v, c.out.data(), c.lse.data(), dq, dk,
                                     dv, shape());
    if (cp_.comm)
      return ulysses_attention_backward(*cp_.comm, qkv_.region.ops, dout, q, k, v, c.out.data(), c.lse.data(), dq, dk,
                                        dv, shape());
    qkv_.region.ops.attention_backward(dout, q, k, v, c.out.data(), c.lse.data(), dq, dk, dv, shape());
  }

  int B_, T_, hq_, hkv_, hd_;
  CpGroup cp_;
  const Rotary<T, Dev>* rope_;
  ColumnParallelLinear<T, Dev, Tp> qkv_;
  RowParallelLinear<T, Dev, Tp> proj_;
};

}  // namespace loom::layers

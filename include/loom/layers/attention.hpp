// Causal self-attention split by heads over the tensor-parallel group: a column-parallel q|k|v projection (each of
// q, k and v split by heads), attention over the local heads, and a row-parallel output projection. With grouped
// or multi-query attention the key/value heads are split as the query heads when there are at least as many as
// ranks, and otherwise each is held by t / kv_heads ranks, which then sum its gradient.
#pragma once

#include <loom/layers/linear.hpp>
#include <loom/tensor/tensor.hpp>

#include <cmath>

namespace loom::layers {

template <class T, class Dev = Host, class Tp = TensorParallel<1>>
struct ParallelAttention {
  using acc = typename kernels::Ops<Dev>::template acc_t<T>;
  using Tensor = loom::Tensor<T, Dev>;
  using AccTensor = loom::Tensor<acc, Dev>;
  struct Params {
    T *qkv_w, *qkv_b, *proj_w, *proj_b;
  };
  //! Kept from forward for backward: the gathered input (sequence parallelism only), q|k|v, the attention output
  //! and its row log-sum-exp.
  struct Acts {
    Tensor in_full, qkv, out;
    AccTensor lse;
  };
  //! Gradient scratch, shared by the blocks.
  struct Grads {
    Tensor dy_full, dout, dqkv, dx_full;
  };

  //! c_attn [d, (heads + 2 kv_heads) * hd] and c_proj [heads * hd, d] under prefix.
  static void declare(ParamTable& t, const std::string& prefix, int d, int heads, int kv_heads, double std_w,
                      double std_proj) {
    const std::int64_t hd = d / heads;
    ColumnParallelLinear<T>::declare(t, prefix + "c_attn", d, {{heads, hd}, {kv_heads, hd}, {kv_heads, hd}}, std_w);
    RowParallelLinear<T>::declare(t, prefix + "c_proj", {{heads, hd}}, d, std_proj);
  }

  ParallelAttention(Region<T, Dev, Tp> r, int B, int T_, int heads, int kv_heads, int head_dim)
      : B_(B), T_(T_), hq_(heads / Tp::size), hkv_(static_cast<int>(units_of(kv_heads, Tp::size, 0).count)),
        hd_(head_dim), qkv_{r, (hq_ + 2 * hkv_) * head_dim}, proj_{r, hq_ * head_dim} {}

  int local_heads() const { return hq_; }
  int local_kv_heads() const { return hkv_; }

  Acts make_acts() const {
    const std::int64_t N = qkv_.region.N;
    Acts a{Tensor(), Tensor({N, qkv_.out}), Tensor({N, proj_.in}), AccTensor({std::int64_t{B_} * hq_ * T_})};
    if constexpr (sp) a.in_full = Tensor({N, qkv_.region.C});
    return a;
  }
  Grads make_grads() const {
    const std::int64_t N = qkv_.region.N, d = qkv_.region.C;
    Grads g{Tensor(), Tensor({N, proj_.in}), Tensor({N, qkv_.out}), Tensor()};
    if constexpr (sp) g.dy_full = Tensor({N, d}), g.dx_full = Tensor({N, d});
    return g;
  }

  //! The input every rank uses: gathered with sequence parallelism, else x itself.
  const T* input_full(const T* x, const Acts& a) const { return sp ? a.in_full.data() : x; }

  //! y (this rank's rows x d) from x (this rank's rows x d); partial is N x d scratch (may be y without sequence
  //! parallelism).
  void forward(const T* x, const Params& w, Acts& a, T* partial, T* y) const {
    qkv_.forward(x, sp ? a.in_full.data() : const_cast<T*>(x), w.qkv_w, w.qkv_b, a.qkv.data());
    const T* q = a.qkv.data();
    qkv_.region.ops.attention_forward(q, q + hq_ * hd_, q + (hq_ + hkv_) * hd_, a.out.data(), a.lse.data(), shape());
    proj_.forward(a.out.data(), w.proj_w, w.proj_b, sp ? partial : y, y);
  }
  //! dx (this rank's rows x d) from dy; keeps what backward_weight needs in g.
  void backward_input(const T* dy, const Params& w, const Acts& a, Grads& g, T* dx) const {
    T* dy_full = sp ? g.dy_full.data() : const_cast<T*>(dy);
    proj_.backward_input(dy, dy_full, w.proj_w, g.dout.data());
    const T* q = a.qkv.data();
    T* dq = g.dqkv.data();
    qkv_.region.ops.attention_backward(g.dout.data(), q, q + hq_ * hd_, q + (hq_ + hkv_) * hd_, a.out.data(),
                                       a.lse.data(), dq, dq + hq_ * hd_, dq + (hq_ + hkv_) * hd_, shape());
    qkv_.backward_input(dq, w.qkv_w, sp ? g.dx_full.data() : dx, dx);
  }
  //! Accumulates the weight gradients; x is the block's input to this layer, dy the gradient of its output.
  void backward_weight(const T* x, const T* dy, const Acts& a, const Grads& g, const Params& dw) const {
    proj_.backward_weight(a.out.data(), sp ? g.dy_full.data() : dy, dy, dw.proj_w, dw.proj_b);
    qkv_.backward_weight(input_full(x, a), g.dqkv.data(), dw.qkv_w, dw.qkv_b);
  }

 private:
  static constexpr bool sp = Tp::sequence_parallel;
  kernels::AttentionShape shape() const {
    return {B_, T_, hq_, hkv_, hd_, qkv_.out, qkv_.out, proj_.in, 1.0 / std::sqrt(static_cast<double>(hd_))};
  }

  int B_, T_, hq_, hkv_, hd_;
  ColumnParallelLinear<T, Dev, Tp> qkv_;
  RowParallelLinear<T, Dev, Tp> proj_;
};

}  // namespace loom::layers

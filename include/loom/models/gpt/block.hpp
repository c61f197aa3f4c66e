// One pre-norm transformer block on this rank's rows: x2 = x + drop(attention(norm1(x))), y = x2 +
// drop(mlp(norm2(x2))), the attention and the MLP split over the tensor-parallel group; in a mixture-of-experts block
// the MLP is a layers::MoeLayer, its experts split over the expert-parallel group. The parts are the shape's spec:
// LayerNorm or RMSNorm (layers::Norm), rotary positions in attention or none (layers::Rotary), a GELU or SwiGLU MLP
// and experts, with biases or without. Every call names the storage it uses: the block's
// parameters, the activations one micro-batch keeps, the branch gradients, the dropout of that micro-batch.
#pragma once

#include <loom/core/random.hpp>
#include <loom/core/trace.hpp>
#include <loom/layers/attention.hpp>
#include <loom/layers/ring_attention.hpp>
#include <loom/layers/mlp.hpp>
#include <loom/layers/moe.hpp>
#include <loom/layers/norm.hpp>
#include <loom/layers/param.hpp>
#include <loom/layers/rotary.hpp>
#include <loom/models/gpt/shape.hpp>
#include <loom/tensor/tensor.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace loom::models {

//! Where this rank's rows sit in the micro-batch: rows `first` .. first + rows - 1 of the B x seq tokens this rank's
//! part of the batch holds (all of them, or with sequence parallelism its share), where each sequence's seq local
//! tokens are, with context parallelism over cp ranks, its two zigzag chunks (layers::zigzag_position).
struct RowPlace {
  int first = 0, rows = 0, seq = 1;
  int cp = 1, cp_rank = 0;

  //! Tokens per whole sequence.
  int global_seq() const { return seq * cp; }
  //! How many whole sequences, positions 0 to seq - 1 each, the rows are (one call of a kernel over them all), or 0
  //! where they are not (context parallelism's zigzag chunks, a sequence-parallel share that cuts one).
  int whole_sequences() const { return cp == 1 && first % seq == 0 && rows % seq == 0 ? rows / seq : 0; }
  //! f(i, n, b, t0) for each run of n rows from row i (counted from `first`) that are consecutive positions t0,
  //! t0 + 1, ... of sequence b of the micro-batch.
  template <class F>
  void each_run(F&& f) const {
    const int run = cp > 1 ? seq / 2 : seq;
    for (int i = 0; i < rows;) {
      const int row = first + i, b = row / seq, t = row % seq, n = std::min(run - t % run, rows - i);
      f(i, n, b, cp > 1 ? layers::zigzag_position(t, cp_rank, cp, run) : t);
      i += n;
    }
  }
};

//! The dropout of one micro-batch: the mask of an element is keyed by (step, layer, site) and its global index,
//! so it is the same whichever rank holds the element. Sites: 0 the embedding, 1 the attention branch, 2 the MLP
//! branch.
struct Dropout {
  float p;              //!< 0: none
  std::uint64_t step;   //!< the optimizer step
  std::int64_t row0;    //!< the global index of the micro-batch's first sequence
  RowPlace place;       //!< this rank's rows in it
  int d;                //!< elements per row

  std::uint64_t key(int l, int site) const { return random::key(0x6c6f6f6d, step, l, site); }
  //! The global index of the first element of sequence b's position t.
  std::uint64_t index(int b, int t) const {
    return (static_cast<std::uint64_t>(row0 + b) * place.global_seq() + static_cast<std::uint64_t>(t)) * d;
  }
  //! out = dropout(in) on this rank's rows (may be in place).
  template <class Ops, class T>
  void forward(const Ops& ops, const T* in, T* out, int l, int site) const {
    if (p > 0)
      place.each_run([&](int i, int n, int b, int t0) {
        const std::ptrdiff_t at = std::ptrdiff_t(i) * d;
        ops.dropout_forward(in + at, out + at, std::size_t(n) * d, p, key(l, site), index(b, t0));
      });
  }
  template <class Ops, class T>
  void backward(const Ops& ops, const T* din, T* dout, int l, int site) const {
    if (p == 0) return ops.copy(din, dout, std::size_t(place.rows) * d);
    place.each_run([&](int i, int n, int b, int t0) {
      const std::ptrdiff_t at = std::ptrdiff_t(i) * d;
      ops.dropout_backward(din + at, dout + at, std::size_t(n) * d, p, key(l, site), index(b, t0));
    });
  }
};

//! The block's computation for one batch shape (B sequences of T tokens), on the rows of the region, for the
//! tensor-parallel group Tp (a layers::TensorParallel).
template <class T, class Dev, class Tp>
class GptBlock {
 public:
  using acc = loom::acc_t<T>;
  using Attention = layers::ParallelAttention<T, Dev, Tp>;
  using Mlp = layers::ParallelMlp<T, Dev, Tp>;
  using Moe = layers::MoeLayer<T, Dev, Tp>;
  using Buf = Tensor<T, Dev>;
  using AccBuf = Tensor<acc, Dev>;

  //! Pointers to a block's parameters (or gradients) inside a flat buffer.
  struct Params {
    T *ln1_w, *ln1_b;
    typename Attention::Params attn;
    T *ln2_w, *ln2_b;
    typename Mlp::Params mlp;  //!< a dense block's
    typename Moe::Params moe;  //!< a mixture-of-experts block's

    //! Block l of shape s, whose first parameter is specs[p], in the flat buffer `flat` laid out by specs (in the
    //! order gpt_param_specs declares them).
    static Params in(T* flat, const std::vector<layers::ParamSpec>& specs, std::size_t p, const GptShape& s, int l) {
      const bool rms = s.norm == NormKind::rms;
      Params w{};
      auto next = [&] { return flat + specs[p++].offset; };
      w.ln1_w = next();
      if (!rms) w.ln1_b = next();
      w.attn = Attention::in(flat, specs, p, s.bias);
      p += Attention::param_count(s.bias);
      w.ln2_w = next();
      if (!rms) w.ln2_b = next();
      if (s.moe_block(l)) w.moe = Moe::in(flat, specs, p, s.shared_experts, s.bias);
      else w.mlp = Mlp::in(flat, specs, p, s.bias);
      return w;
    }
  };
  //! What one block keeps from forward for backward, on this rank's rows: its input (unless the caller keeps it),
  //! the norms' outputs and statistics, the residual after attention, and the layers' own.
  struct Acts {
    Buf x, ln1, x2, ln2;
    AccBuf mean1, rstd1, mean2, rstd2;
    typename Attention::Acts attn;
    typename Mlp::Acts mlp;
    typename Moe::Acts moe;
  };
  //! The branch gradients that backward_input leaves for backward_weight.
  struct Grads {
    Buf dfcp, dln2, dattp, dln1;
    typename Attention::Grads attn;
    typename Mlp::Grads mlp;
    typename Moe::Grads moe;
  };

  //! B sequences of T_ tokens on this rank (its zigzag share of each with context parallelism over cp); a
  //! mixture-of-experts block routes as moe says, over the expert-parallel group ep. rope: the rotary tables where
  //! the spec has rotary positions (else null).
  GptBlock(layers::Region<T, Dev, Tp> region, int B, int T_, const GptShape& s, double ln_eps, layers::CpGroup cp = {},
           const MoeOptions& moe = {}, layers::EpGroup ep = {}, const layers::Rotary<T, Dev>* rope = nullptr)
      : region_(region), shape_(s), attn_(region, B, T_, s.heads, s.kv_heads, s.head_dim(), cp, rope),
        mlp_(region, s.ffn(), s.gated()), norm_{s.norm == NormKind::rms, ln_eps, region.ops} {
    if (s.experts > 0)
      moe_.emplace(region, B, T_, s.d_model, s.experts, s.expert_width(), s.shared_experts,
                   layers::RouterConfig{s.experts, s.top_k, moe.sigmoid, s.renormalize, moe.capacity_factor,
                                        moe.aux_loss_coeff, moe.z_loss_coeff},
                   ep, cp.comm, s.gated(), s.bias);
  }

  //! Whether block l's MLP is a mixture of experts.
  bool moe_block(int l) const { return shape_.moe_block(l); }

  int rows() const { return region_.rows(); }
  int width() const { return region_.C; }

  //! What forward keeps for block l (-1: for any block, as scratch shared by all): with the block's input or
  //! without (the caller keeps it), with the attention core's result or without (selective recompute).
  Acts make_acts(bool with_input, bool keep_core = true, int l = -1) const {
    const std::int64_t r = rows(), d = width();
    Acts a{with_input ? Buf({r, d}) : Buf(), Buf({r, d}), Buf({r, d}), Buf({r, d}), AccBuf({r}), AccBuf({r}),
           AccBuf({r}), AccBuf({r}), attn_.make_acts(keep_core), {}, {}};
    if (dense_mlp(l)) a.mlp = mlp_.make_acts();
    if (moe_ && (l < 0 || moe_block(l))) a.moe = moe_->make_acts();
    return a;
  }
  //! Backward's scratch for block l (-1: any); recompute_core: with room for the attention core selective
  //! recompute recomputes (which forward, not keeping it, also writes there).
  Grads make_grads(bool recompute_core = false, int l = -1) const {
    const std::int64_t r = rows(), d = width();
    Grads g{Buf({r, d}), Buf({r, d}), Buf({r, d}), Buf({r, d}), attn_.make_grads(recompute_core), {}, {}};
    if (dense_mlp(l)) g.mlp = mlp_.make_grads();
    if (moe_ && (l < 0 || moe_block(l))) g.moe = moe_->make_grads();
    return g;
  }

  //! Block l: out from x, keeping what backward needs in a; partial is N x d scratch (sequence parallelism); the
  //! attention core's result goes to a, or where a does not keep it (selective recompute) to g's.
  //! A mixture-of-experts block adds what it routed to stats, when given.
  void forward(int l, const Params& w, const T* x, Acts& a, T* partial, T* out, const Dropout& drop, Grads& g,
               layers::MoeStats* stats = nullptr) const {
    trace::Scope span("forward block", "compute");
    const auto& ops = region_.ops;
    const int d = width(), r = rows();
    const std::size_t nd = std::size_t(r) * d;
    norm_.forward(x, w.ln1_w, w.ln1_b, a.ln1.data(), a.mean1.data(), a.rstd1.data(), r, d);
    T* x2 = a.x2.data();
    // Without dropout each branch's last product adds the residual as it stores its result (one pass fewer).
    const bool fold = drop.p == 0;
    attn_.forward(a.ln1.data(), w.attn, a.attn, partial, x2, g.attn.core, fold ? x : nullptr);
    if (!fold) {
      drop.forward(ops, x2, x2, l, 1);
      ops.add(x, x2, x2, nd);
    }
    norm_.forward(x2, w.ln2_w, w.ln2_b, a.ln2.data(), a.mean2.data(), a.rstd2.data(), r, d);
    if (moe_block(l)) {
      moe_->forward(a.ln2.data(), w.moe, a.moe, partial, out, stats);
    } else {
      mlp_.forward(a.ln2.data(), w.mlp, a.mlp, partial, out, fold ? x2 : nullptr);
    }
    if (!fold || moe_block(l)) {
      drop.forward(ops, out, out, l, 2);
      ops.add(x2, out, out, nd);
    }
  }

  //! Block l's part of backward that gives the gradient of its input: on entry dx holds d(output), on return
  //! d(x). Leaves in g what backward_weight needs. `scale` scales a mixture of experts' router losses as the loss is.
  //! `stats`, when given, gains the time of a mixture of experts' all-to-alls.
  void backward_input(int l, const Params& w, const T* x, const Acts& a, Grads& g, T* dx, const Dropout& drop,
                      double scale = 1.0, layers::MoeStats* stats = nullptr) const {
    trace::Scope span("backward_input block", "compute");
    const auto& ops = region_.ops;
    const int d = width(), r = rows();
    // MLP branch: y = x2 + drop(mlp(ln2(x2)))
    drop.backward(ops, dx, g.dfcp.data(), l, 2);
    if (moe_block(l)) {
      moe_->backward_input(g.dfcp.data(), w.moe, a.moe, g.moe, g.dln2.data(), scale, stats);
    } else {
      mlp_.backward_input(g.dfcp.data(), w.mlp, a.mlp, g.mlp, g.dln2.data());
    }
    // d(x2) = d(output) + the norm's gradient, in the norm's pass: into dx, or without dropout straight into the
    // attention branch's gradient (dropout's backward would copy it there).
    T* dx2 = drop.p == 0 ? g.dattp.data() : dx;
    norm_.backward_input(g.dln2.data(), a.x2.data(), w.ln2_w, a.mean2.data(), a.rstd2.data(), dx2, r, d, dx);
    // Attention branch: x2 = x + drop(attention(ln1(x)))
    if (drop.p != 0) drop.backward(ops, dx, g.dattp.data(), l, 1);
    attn_.backward_input(g.dattp.data(), w.attn, a.attn, g.attn, g.dln1.data());
    norm_.backward_input(g.dln1.data(), x, w.ln1_w, a.mean1.data(), a.rstd1.data(), dx, r, d, dx2);  // d(x)
  }

  //! Block l's weight gradients (accumulated into dw) from the branch gradients in g.
  void backward_weight(int l, const Params& dw, const T* x, const Acts& a, const Grads& g) const {
    trace::Scope span("backward_weight block", "compute");
    const int d = width(), r = rows();
    if (moe_block(l)) {
      moe_->backward_weight(a.ln2.data(), g.dfcp.data(), a.moe, g.moe, dw.moe);
    } else {
      mlp_.backward_weight(a.ln2.data(), g.dfcp.data(), a.mlp, g.mlp, dw.mlp);
    }
    norm_.backward_weight(g.dln2.data(), a.x2.data(), a.mean2.data(), a.rstd2.data(), dw.ln2_w, dw.ln2_b, r, d);
    attn_.backward_weight(a.ln1.data(), g.dattp.data(), a.attn, g.attn, dw.attn);
    norm_.backward_weight(g.dln1.data(), x, a.mean1.data(), a.rstd1.data(), dw.ln1_w, dw.ln1_b, r, d);
  }

  //! Bytes held by one block's activations and by one set of branch gradients.
  static std::size_t bytes(const Acts& a) {
    return held(a.x, a.ln1, a.x2, a.ln2, a.mean1, a.rstd1, a.mean2, a.rstd2, a.attn.in_full, a.attn.qkv,
                a.attn.core.out, a.attn.core.lse, a.mlp.in_full, a.mlp.h, a.mlp.g) +
           Moe::bytes(a.moe);
  }
  static std::size_t bytes(const Grads& g) {
    return held(g.dfcp, g.dln2, g.dattp, g.dln1, g.attn.dy_full, g.attn.dout, g.attn.dqkv, g.attn.dx_full,
                g.attn.core.out, g.attn.core.lse, g.mlp.dy_full, g.mlp.dg, g.mlp.dx_full, g.mlp.dh) +
           Moe::bytes(g.moe);
  }
  //! The bytes of the tensors given that hold storage.
  template <class... U>
  static std::size_t held(const U&... t) {
    return ((t.defined() ? t.bytes() : std::size_t{0}) + ... + std::size_t{0});
  }

 private:
  //! Whether block l (-1: any block of the shape) has a dense MLP.
  bool dense_mlp(int l) const {
    if (l >= 0) return !moe_block(l);
    for (int i = 0; i < shape_.layers; ++i)
      if (!moe_block(i)) return true;
    return false;
  }

  layers::Region<T, Dev, Tp> region_;
  GptShape shape_;
  Attention attn_;
  Mlp mlp_;
  std::optional<Moe> moe_;
  layers::Norm<T, Dev> norm_;
};

}  // namespace loom::models

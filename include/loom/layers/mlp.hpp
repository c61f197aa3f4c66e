// The transformer MLP over the tensor-parallel group: a column-parallel expansion to d_ff features (split over
// the ranks), GELU on the local features, and a row-parallel projection back to d. Gated (SwiGLU, Llama's), the
// expansion is to the gate's and the up projection's d_ff features each, both split alike over the ranks (two
// segments of one weight), and the local features are silu(gate) * up.
#pragma once

#include <loom/layers/linear.hpp>
#include <loom/tensor/tensor.hpp>

namespace loom::layers {

template <class T, class Dev = Host, class Tp = TensorParallel<1>>
struct ParallelMlp {
  using Tensor = loom::Tensor<T, Dev>;
  struct Params {
    T *fc_w, *fc_b, *proj_w, *proj_b;
  };
  struct Acts {
    Tensor in_full, h, g;  //!< gathered input (sequence parallelism only), pre- and post-activation
  };
  struct Grads {
    Tensor dy_full, dg, dx_full;
    Tensor dh;  //!< gated: the gradient of the activation's output (dg holds that of the gate and up projections)
  };

  //! c_fc [d, d_ff] (gated: [d, 2 d_ff], the gate's features then the up projection's) and c_proj [d_ff, d] under
  //! prefix, with their biases when `bias`.
  static void declare(ParamTable& t, const std::string& prefix, int d, int d_ff, double std_w, double std_proj,
                      bool gated = false, bool bias = true) {
    ColumnParallelLinear<T>::declare(t, prefix + "c_fc", d,
                                     gated ? std::vector<Segment>{{d_ff, 1}, {d_ff, 1}} : std::vector<Segment>{{d_ff, 1}},
                                     std_w, bias);
    RowParallelLinear<T>::declare(t, prefix + "c_proj", {{d_ff, 1}}, d, std_proj, bias);
  }
  //! The parameters of one MLP: 2 without biases, 4 with.
  static std::size_t param_count(bool bias) { return bias ? 4 : 2; }
  //! Params from the MLP's first parameter specs[p] in the flat buffer `flat`.
  static Params in(T* flat, const std::vector<ParamSpec>& specs, std::size_t p, bool bias) {
    auto at = [&](std::size_t i) { return flat + specs[p + i].offset; };
    return bias ? Params{at(0), at(1), at(2), at(3)} : Params{at(0), nullptr, at(1), nullptr};
  }

  ParallelMlp(Region<T, Dev, Tp> r, int d_ff, bool gated = false)
      : fc_{r, (gated ? 2 : 1) * d_ff / Tp::size}, proj_{r, d_ff / Tp::size}, gated_(gated) {}

  Acts make_acts() const {
    const std::int64_t N = fc_.region.N;
    Acts a{Tensor(), Tensor({N, fc_.out}), Tensor({N, proj_.in})};
    if constexpr (sp) a.in_full = Tensor({N, fc_.region.C});
    return a;
  }
  Grads make_grads() const {
    const std::int64_t N = fc_.region.N, d = fc_.region.C;
    Grads g{Tensor(), Tensor({N, fc_.out}), Tensor(), gated_ ? Tensor({N, proj_.in}) : Tensor()};
    if constexpr (sp) g.dy_full = Tensor({N, d}), g.dx_full = Tensor({N, d});
    return g;
  }

  const T* input_full(const T* x, const Acts& a) const { return sp ? a.in_full.data() : x; }

  //! y = the MLP of x, plus `residual` (x's rows, not y) where given.
  void forward(const T* x, const Params& w, Acts& a, T* partial, T* y, const T* residual = nullptr) const {
    T* x_full = sp ? a.in_full.data() : const_cast<T*>(x);
    if (gated_) {
      fc_.forward(x, x_full, w.fc_w, w.fc_b, a.h.data());
      fc_.region.ops.swiglu_forward(a.h.data(), a.g.data(), fc_.region.N, proj_.in);
    } else {
      fc_.forward_gelu(x, x_full, w.fc_w, w.fc_b, a.h.data(), a.g.data());  // h: the GELU's input, for backward
    }
    proj_.forward(a.g.data(), w.proj_w, w.proj_b, sp ? partial : y, y, residual);
  }
  void backward_input(const T* dy, const Params& w, const Acts& a, Grads& g, T* dx) const {
    T* dh = g.dg.data();
    if (gated_) {  // d(silu(gate) up) into dh, from d(out) in the first half of the gradient of the products
      T* dg = g.dh.data();
      proj_.backward_input(dy, sp ? g.dy_full.data() : const_cast<T*>(dy), w.proj_w, dg);
      fc_.region.ops.swiglu_backward(a.h.data(), dg, dh, fc_.region.N, proj_.in);
    } else {
      proj_.backward_input(dy, sp ? g.dy_full.data() : const_cast<T*>(dy), w.proj_w, dh, a.h.data());
    }
    fc_.backward_input(dh, w.fc_w, sp ? g.dx_full.data() : dx, dx);
  }
  void backward_weight(const T* x, const T* dy, const Acts& a, const Grads& g, const Params& dw) const {
    proj_.backward_weight(a.g.data(), sp ? g.dy_full.data() : dy, dy, dw.proj_w, dw.proj_b);
    fc_.backward_weight(input_full(x, a), g.dg.data(), dw.fc_w, dw.fc_b);
  }

 private:
  static constexpr bool sp = Tp::sequence_parallel;
  ColumnParallelLinear<T, Dev, Tp> fc_;
  RowParallelLinear<T, Dev, Tp> proj_;
  bool gated_;
};

}  // namespace loom::layers

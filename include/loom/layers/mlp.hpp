// The transformer MLP over the tensor-parallel group: a column-parallel expansion to d_ff features (split over
// the ranks), GELU on the local features, and a row-parallel projection back to d.
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
    Tensor in_full, h, g;  //!< gathered input (sequence parallelism only), pre- and post-GELU
  };
  struct Grads {
    Tensor dy_full, dg, dx_full;
  };

  //! c_fc [d, d_ff] and c_proj [d_ff, d] under prefix.
  static void declare(ParamTable& t, const std::string& prefix, int d, int d_ff, double std_w, double std_proj) {
    ColumnParallelLinear<T>::declare(t, prefix + "c_fc", d, {{d_ff, 1}}, std_w);
    RowParallelLinear<T>::declare(t, prefix + "c_proj", {{d_ff, 1}}, d, std_proj);
  }

  ParallelMlp(Region<T, Dev, Tp> r, int d_ff) : fc_{r, d_ff / Tp::size}, proj_{r, d_ff / Tp::size} {}

  Acts make_acts() const {
    const std::int64_t N = fc_.region.N;
    Acts a{Tensor(), Tensor({N, fc_.out}), Tensor({N, fc_.out})};
    if constexpr (sp) a.in_full = Tensor({N, fc_.region.C});
    return a;
  }
  Grads make_grads() const {
    const std::int64_t N = fc_.region.N, d = fc_.region.C;
    Grads g{Tensor(), Tensor({N, fc_.out}), Tensor()};
    if constexpr (sp) g.dy_full = Tensor({N, d}), g.dx_full = Tensor({N, d});
    return g;
  }

  const T* input_full(const T* x, const Acts& a) const { return sp ? a.in_full.data() : x; }

  void forward(const T* x, const Params& w, Acts& a, T* partial, T* y) const {
    fc_.forward(x, sp ? a.in_full.data() : const_cast<T*>(x), w.fc_w, w.fc_b, a.h.data());
    fc_.region.ops.gelu_forward(a.h.data(), a.g.data(), a.h.numel());
    proj_.forward(a.g.data(), w.proj_w, w.proj_b, sp ? partial : y, y);
  }
  void backward_input(const T* dy, const Params& w, const Acts& a, Grads& g, T* dx) const {
    proj_.backward_input(dy, sp ? g.dy_full.data() : const_cast<T*>(dy), w.proj_w, g.dg.data());
    fc_.region.ops.gelu_backward(a.h.data(), g.dg.data(), g.dg.data(), a.h.numel());
    fc_.backward_input(g.dg.data(), w.fc_w, sp ? g.dx_full.data() : dx, dx);
  }
  void backward_weight(const T* x, const T* dy, const Acts& a, const Grads& g, const Params& dw) const {
    proj_.backward_weight(a.g.data(), sp ? g.dy_full.data() : dy, dy, dw.proj_w, dw.proj_b);
    fc_.backward_weight(input_full(x, a), g.dg.data(), dw.fc_w, dw.fc_b);
  }

 private:
  static constexpr bool sp = Tp::sequence_parallel;
  ColumnParallelLinear<T, Dev, Tp> fc_;
  RowParallelLinear<T, Dev, Tp> proj_;
};

}  // namespace loom::layers

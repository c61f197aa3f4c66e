// Column- and row-parallel linear layers (y = x W + b, W stored in x out as Hugging Face's Conv1D; b optional: a
// layer declared without it takes a null bias and skips it). A column-parallel
// layer splits W along its outputs: its input enters a tensor-parallel region (identity forward, all-reduce
// backward; all-gather / reduce-scatter with sequence parallelism) and its output stays split. A row-parallel
// layer splits W along its inputs, takes a split input and leaves the region: its partial products are summed
// (all-reduce forward, identity backward; reduce-scatter / all-gather with sequence parallelism), then the bias,
// which is replicated, is added once.
#pragma once

#include <loom/layers/param.hpp>
#include <loom/layers/tp.hpp>

namespace loom::layers {

//! The sum of a list of segments, in elements.
inline std::int64_t extent_of(const std::vector<Segment>& segments) {
  std::int64_t n = 0;
  for (const auto& s : segments) n += s.units * s.unit;
  return n;
}

template <class T, class Dev = Host, class Tp = TensorParallel<1>>
struct ColumnParallelLinear {
  using weight_placement = Shard<1>;
  using bias_placement = Shard<0>;

  //! name.weight [in, out] and (with bias) name.bias [out], the out dimension made of `out` segments.
  static void declare(ParamTable& t, const std::string& name, std::int64_t in, const std::vector<Segment>& out,
                      double init_std, bool bias = true) {
    t.add<weight_placement>(name + ".weight", {in, extent_of(out)}, true, init_std, 0, out);
    if (bias) t.add<bias_placement>(name + ".bias", {extent_of(out)}, false, 0, 0, out);
  }

  Region<T, Dev, Tp> region;  //!< N tokens of `in` features
  int out;           //!< local output features

  //! y (N x out) = x_full W + b, where x_full (N x in) is gathered from this rank's rows of x (or is x).
  void forward(const T* x, T* x_full, const T* w, const T* b, T* y) const {
    region.enter_forward(x, x_full);
    if (b) region.ops.matmul_bias(x_full, w, b, y, region.N, out, region.C, false, false);
    else region.ops.matmul(x_full, w, y, region.N, out, region.C, false, false);
  }
  //! y (N x out) = GELU(pre), pre = x_full W + b (kept for backward): an MLP's first layer.
  void forward_gelu(const T* x, T* x_full, const T* w, const T* b, T* pre, T* y) const {
    region.enter_forward(x, x_full);
    region.ops.matmul_bias_gelu(x_full, w, b, pre, y, region.N, out, region.C, false, false);
  }
  //! dx (this rank's rows) from dy (N x out), through dx_full (N x in, may be dx without sequence parallelism).
  void backward_input(const T* dy, const T* w, T* dx_full, T* dx) const {
    region.ops.matmul(dy, w, dx_full, region.N, region.C, out, false, true);
    region.enter_backward(dx_full, dx);
  }
  //! dW += x_full^T dy, db += the column sums of dy (in the same product on a device).
  void backward_weight(const T* x_full, const T* dy, T* dw, T* db) const {
    if (db) region.ops.matmul_bgrad(x_full, dy, dw, db, region.C, out, region.N, true, 1.0f, 1.0f);
    else region.ops.matmul(x_full, dy, dw, region.C, out, region.N, true, false, 1.0f, 1.0f);
  }
};

template <class T, class Dev = Host, class Tp = TensorParallel<1>>
struct RowParallelLinear {
  using weight_placement = Shard<0>;
  using bias_placement = Replicate;

  //! name.weight [in, out], the in dimension made of `in` segments, and (with bias) name.bias [out].
  static void declare(ParamTable& t, const std::string& name, const std::vector<Segment>& in, std::int64_t out,
                      double init_std, bool bias = true) {
    t.add<weight_placement>(name + ".weight", {extent_of(in), out}, true, init_std, 0, in);
    if (bias) t.add<bias_placement>(name + ".bias", {out}, false, 0);
  }

  Region<T, Dev, Tp> region;  //!< N tokens of `out` features
  int in;            //!< local input features

  //! y (this rank's rows x out) = the sum over ranks of x W (partial: N x out, may be y without sequence
  //! parallelism), plus b, plus `residual` (this rank's rows x out, not y) where given: a residual branch's end.
  void forward(const T* x, const T* w, const T* b, T* partial, T* y, const T* residual = nullptr) const {
    if constexpr (Tp::size == 1) {  // no partial sums: the bias and the residual join the product
      if (residual) region.ops.matmul_residual(x, w, b, residual, partial, region.N, region.C, in, false, false);
      else if (b) region.ops.matmul_bias(x, w, b, partial, region.N, region.C, in, false, false);
      else region.ops.matmul(x, w, partial, region.N, region.C, in, false, false);
      region.exit_forward(partial, y);
      return;
    }
    region.ops.matmul(x, w, partial, region.N, region.C, in, false, false);
    region.exit_forward(partial, y);
    if (b) region.ops.bias_add(y, b, y, region.rows(), region.C);
    if (residual) region.ops.add(residual, y, y, std::size_t(region.rows()) * std::size_t(region.C));
  }
  //! dx (N x in) from dy (this rank's rows), through dy_full (N x out, may be dy without sequence parallelism);
  //! times GELU'(gelu_in) where the input was GELU(gelu_in) (N x in), the gradient of the GELU's input.
  void backward_input(const T* dy, T* dy_full, const T* w, T* dx, const T* gelu_in = nullptr) const {
    region.exit_backward(dy, dy_full);
    if (gelu_in) region.ops.matmul_dgelu(dy_full, w, gelu_in, dx, region.N, in, region.C, false, true);
    else region.ops.matmul(dy_full, w, dx, region.N, in, region.C, false, true);
  }
  //! dW += x^T dy_full; db += the column sums of this rank's rows of dy (a partial sum with sequence parallelism;
  //! without it, dy_full's rows are dy's, and the product sums them on a device).
  void backward_weight(const T* x, const T* dy_full, const T* dy, T* dw, T* db) const {
    if (db && region.rows() == region.N) {
      region.ops.matmul_bgrad(x, dy_full, dw, db, in, region.C, region.N, true, 1.0f, 1.0f);
      return;
    }
    region.ops.matmul(x, dy_full, dw, in, region.C, region.N, true, false, 1.0f, 1.0f);
    if (db) region.ops.bias_backward(dy, db, region.rows(), region.C);
  }
};

}  // namespace loom::layers

// The norm a transformer block applies before attention and the MLP, and before the output layer: LayerNorm (weight
// and bias, GPT-2's) or RMSNorm (a weight, Llama's), over the last dimension of this rank's rows. Every rank of a
// tensor-parallel group holds the whole weight (Replicate).
#pragma once

#include <loom/kernels/ops.hpp>
#include <loom/layers/param.hpp>

#include <string>

namespace loom::layers {

template <class T, class Dev = Host>
struct Norm {
  using acc = loom::acc_t<T>;

  bool rms;     //!< RMSNorm, else LayerNorm
  double eps;
  kernels::Ops<Dev> ops{};

  //! prefix.weight [d] (ones) and, for LayerNorm, prefix.bias [d] (zeros).
  static void declare(ParamTable& t, const std::string& prefix, int d, bool rms) {
    t.add<Replicate>(prefix + ".weight", {d}, false, 0, 1);
    if (!rms) t.add<Replicate>(prefix + ".bias", {d}, false, 0);
  }
  //! The parameters of one norm.
  static std::size_t param_count(bool rms) { return rms ? 1 : 2; }

  //! out from R rows of x, C each; mean (LayerNorm only) and rstd kept for backward. b is null for RMSNorm.
  void forward(const T* x, const T* w, const T* b, T* out, acc* mean, acc* rstd, int R, int C) const {
    if (rms) ops.rmsnorm_forward(x, w, out, rstd, R, C, eps);
    else ops.layernorm_forward(x, w, b, out, mean, rstd, R, C, eps);
  }
  //! dx (written) from dout; with dres, dx = dres + the norm's gradient (the residual's gradient to the same input,
  //! added in the same pass; dres may be dx).
  void backward_input(const T* dout, const T* x, const T* w, const acc* mean, const acc* rstd, T* dx, int R, int C,
                      const T* dres = nullptr) const {
    if (rms) ops.rmsnorm_backward_input(dout, x, w, rstd, dx, R, C, dres);
    else ops.layernorm_backward_input(dout, x, w, mean, rstd, dx, R, C, dres);
  }
  //! dw (and LayerNorm's db) += their gradients from dout.
  void backward_weight(const T* dout, const T* x, const acc* mean, const acc* rstd, T* dw, T* db, int R,
                       int C) const {
    if (rms) ops.rmsnorm_backward_weight(dout, x, rstd, dw, R, C);
    else ops.layernorm_backward_weight(dout, x, mean, rstd, dw, db, R, C);
  }
};

}  // namespace loom::layers

// Ops<Device>: the operations of <loom/kernels/cpu/ops.hpp> on a device's memory, with what a model needs besides
// the kernels (copies, fills, transfers to and from the host, sums), so that layers, models and optimizers are
// written once for every device. Ops<Host> forwards to kernels::cpu; Ops<Cuda> to kernels::cuda on a stream, in
// <loom/kernels/cuda/device_ops.hpp> (include it before using a model on Cuda; link loom::cuda_kernels, or include
// <loom/kernels/cuda/device_ops.cuh> from a file nvcc compiles).
//
// An Ops value is what a layer holds to reach its device: empty on the host, a stream on CUDA. Pointers given to it
// are in its device's memory unless the name says host. Sums come back to the host as double.
#pragma once

#include <loom/kernels/cpu/ops.hpp>
#include <loom/kernels/shape.hpp>
#include <loom/tensor/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace loom::kernels {

template <class Device>
struct Ops;

//! The CPU kernels, as they are: every call forwards unchanged (a model on the host computes bit for bit as one
//! that calls kernels::cpu itself).
template <>
struct Ops<Host> {
  using device = Host;
  template <class T>
  using acc_t = loom::acc_t<T>;
  //! Temporary memory of n elements, with data().
  template <class U>
  using Scratch = std::vector<U>;
  template <class U>
  Scratch<U> scratch(std::size_t n) const {
    return Scratch<U>(n);
  }

  template <class T>
  void matmul(const T* A, const T* B, T* C, int M, int N, int K, bool trans_a, bool trans_b, float alpha = 1.0f,
              float beta = 0.0f) const {
    cpu::matmul(A, B, C, M, N, K, trans_a, trans_b, alpha, beta);
  }
  //! C = op(A) op(B) + bias (N values, added to every row), one product (a device fuses the bias into it).
  template <class T>
  void matmul_bias(const T* A, const T* B, const T* bias, T* C, int M, int N, int K, bool trans_a,
                   bool trans_b) const {
    cpu::matmul(A, B, C, M, N, K, trans_a, trans_b);
    cpu::bias_add(C, bias, C, M, N);
  }
  //! C = op(A) op(B) + bias (may be null) + R, R an M x N residual other than C (a device reads R as the product's
  //! C); the same values as the product, the bias and then add(R, C, C).
  template <class T>
  void matmul_residual(const T* A, const T* B, const T* bias, const T* R, T* C, int M, int N, int K, bool trans_a,
                       bool trans_b) const {
    LOOM_CHECK(R != C, "matmul_residual: the residual must not be the output (M=", M, ", N=", N, ")");
    cpu::matmul(A, B, C, M, N, K, trans_a, trans_b);
    if (bias) cpu::bias_add(C, bias, C, M, N);
    cpu::add(R, C, C, std::size_t(M) * std::size_t(N));
  }
  //! pre = op(A) op(B) + bias (bias may be null), C = GELU(pre), tanh form (a device fuses both into the product).
  template <class T>
  void matmul_bias_gelu(const T* A, const T* B, const T* bias, T* pre, T* C, int M, int N, int K, bool trans_a,
                        bool trans_b) const {
    cpu::matmul(A, B, pre, M, N, K, trans_a, trans_b);
    if (bias) cpu::bias_add(pre, bias, pre, M, N);
    cpu::gelu_forward(pre, C, std::size_t(M) * std::size_t(N));
  }
  //! C = (op(A) op(B)) GELU'(pre), element by element (a device fuses the derivative into the product).
  template <class T>
  void matmul_dgelu(const T* A, const T* B, const T* pre, T* C, int M, int N, int K, bool trans_a,
                    bool trans_b) const {
    cpu::matmul(A, B, C, M, N, K, trans_a, trans_b);
    cpu::gelu_backward(pre, C, C, std::size_t(M) * std::size_t(N));
  }
  //! One product whose stored rows lie lda, ldb and ldc elements apart.
  template <class T>
  void matmul_ld(const T* A, std::ptrdiff_t lda, const T* B, std::ptrdiff_t ldb, T* C, std::ptrdiff_t ldc, int M,
                 int N, int K, bool trans_a, bool trans_b, float alpha = 1.0f, float beta = 0.0f) const {
    cpu::matmul_ld(A, lda, B, ldb, C, ldc, M, N, K, trans_a, trans_b, alpha, beta);
  }
  //! C = alpha op(A) B + beta C and dbias += the column sums of B (K x N as stored): a layer's weight gradient and
  //! its bias's from the output's gradient B (a device sums the bias's in the product's epilogue).
  template <class T>
  void matmul_bgrad(const T* A, const T* B, T* C, T* dbias, int M, int N, int K, bool trans_a, float alpha = 1.0f,
                    float beta = 0.0f) const {
    cpu::matmul(A, B, C, M, N, K, trans_a, false, alpha, beta);
    cpu::bias_backward(B, dbias, K, N);
  }
  //! count products of sizes of their own, alike in transposes, alpha and beta (a device runs them as one grouped
  //! product, perhaps at the same time, so their outputs must not overlap; here one after another, each as matmul
  //! computes it).
  template <class T>
  void matmul_group(const Product<T>* ps, std::size_t count, bool trans_a, bool trans_b, float alpha = 1.0f,
                    float beta = 0.0f) const {
    check_group(ps, count);
    for (std::size_t i = 0; i < count; ++i)
      cpu::matmul(ps[i].a, ps[i].b, ps[i].c, ps[i].m, ps[i].n, ps[i].k, trans_a, trans_b, alpha, beta);
  }
  //! The row stride, in elements, of a wide matrix of `cols` columns of T that products and the loss read (the
  //! logits): on the host the columns themselves.
  template <class T>
  static constexpr std::ptrdiff_t row_pitch(std::ptrdiff_t cols) {
    return cols;
  }
  template <class T>
  void bias_add(const T* x, const T* bias, T* out, int R, int C) const {
    cpu::bias_add(x, bias, out, R, C);
  }
  template <class T>
  void bias_backward(const T* dout, T* dbias, int R, int C) const {
    cpu::bias_backward(dout, dbias, R, C);
  }
  template <class T>
  void add(const T* a, const T* b, T* out, std::size_t n) const {
    cpu::add(a, b, out, n);
  }
  template <class T>
  void accumulate(const T* x, T* y, std::size_t n) const {
    cpu::accumulate(x, y, n);
  }
  template <class T>
  void gelu_forward(const T* x, T* out, std::size_t n) const {
    cpu::gelu_forward(x, out, n);
  }
  template <class T>
  void gelu_backward(const T* x, const T* dout, T* dx, std::size_t n) const {
    cpu::gelu_backward(x, dout, dx, n);
  }

  template <class T>
  void swiglu_forward(const T* h, T* out, int R, int F) const {
    cpu::swiglu_forward(h, out, R, F);
  }
  template <class T>
  void swiglu_backward(const T* h, const T* dout, T* dh, int R, int F) const {
    cpu::swiglu_backward(h, dout, dh, R, F);
  }

  template <class T>
  void layernorm_forward(const T* x, const T* w, const T* b, T* out, acc_t<T>* mean, acc_t<T>* rstd, int R, int C,
                         double eps) const {
    cpu::layernorm_forward(x, w, b, out, mean, rstd, R, C, eps);
  }
  //! dx = the input's gradient, or with dres dres + it (dres may be dx: a residual's gradient, added in place).
  template <class T>
  void layernorm_backward_input(const T* dout, const T* x, const T* w, const acc_t<T>* mean, const acc_t<T>* rstd,
                                T* dx, int R, int C, const T* dres = nullptr) const {
    cpu::layernorm_backward_input(dout, x, w, mean, rstd, dx, R, C, dres);
  }
  template <class T>
  void layernorm_backward_weight(const T* dout, const T* x, const acc_t<T>* mean, const acc_t<T>* rstd, T* dw, T* db,
                                 int R, int C) const {
    cpu::layernorm_backward_weight(dout, x, mean, rstd, dw, db, R, C);
  }

  template <class T>
  void rmsnorm_forward(const T* x, const T* w, T* out, acc_t<T>* rstd, int R, int C, double eps) const {
    cpu::rmsnorm_forward(x, w, out, rstd, R, C, eps);
  }
  template <class T>
  void rmsnorm_backward_input(const T* dout, const T* x, const T* w, const acc_t<T>* rstd, T* dx, int R, int C,
                              const T* dres = nullptr) const {
    cpu::rmsnorm_backward_input(dout, x, w, rstd, dx, R, C, dres);
  }
  template <class T>
  void rmsnorm_backward_weight(const T* dout, const T* x, const acc_t<T>* rstd, T* dw, int R, int C) const {
    cpu::rmsnorm_backward_weight(dout, x, rstd, dw, R, C);
  }
  template <class T>
  void rope_rotate(T* x, const acc_t<T>* cos, const acc_t<T>* sin, int n, int ld, int heads, int hd, int t0,
                   bool inverse) const {
    cpu::rope_rotate(x, cos, sin, n, ld, heads, hd, t0, inverse);
  }

  template <class T>
  void ce_partials(const T* logits, acc_t<T>* row_max, acc_t<T>* row_sumexp, int R, int V_local,
                   std::ptrdiff_t ld = 0) const {
    cpu::ce_partials(logits, row_max, row_sumexp, R, V_local, ld);
  }
  template <class T>
  void ce_rescale(const acc_t<T>* local_max, const acc_t<T>* global_max, acc_t<T>* sumexp, int R) const {
    cpu::ce_rescale<T>(local_max, global_max, sumexp, R);
  }
  template <class T>
  void ce_target_logit(const T* logits, const std::int32_t* targets, acc_t<T>* target_logit, int R, int V_local,
                       int v0, std::ptrdiff_t ld = 0) const {
    cpu::ce_target_logit(logits, targets, target_logit, R, V_local, v0, ld);
  }
  template <class T>
  void ce_losses(const acc_t<T>* row_max, const acc_t<T>* row_sumexp, const acc_t<T>* target_logit, T* losses,
                 int R) const {
    cpu::ce_losses<T>(row_max, row_sumexp, target_logit, losses, R);
  }
  template <class T>
  void ce_backward(const T* logits, const std::int32_t* targets, const acc_t<T>* row_max, const acc_t<T>* row_sumexp,
                   const T* dloss, T* dlogits, int R, int V_local, int v0, std::ptrdiff_t ld = 0) const {
    cpu::ce_backward(logits, targets, row_max, row_sumexp, dloss, dlogits, R, V_local, v0, ld);
  }
  //! The cross-entropy of R rows over the whole vocabulary (V) and its gradient at once: losses, the rows' max and
  //! sum of exp, and each logit replaced by d(losses[r]) / d(logit) = softmax - [v == targets[r]], unscaled (a device
  //! does it in one pass over the logits): the loss's forward and, with a row's loss gradient of one, its backward.
  template <class T>
  void ce_loss_grad(T* logits, const std::int32_t* targets, acc_t<T>* row_max, acc_t<T>* row_sumexp, T* losses, int R,
                    int V, std::ptrdiff_t ld = 0) const {
    if (R <= 0) return;
    std::vector<acc_t<T>> target(static_cast<std::size_t>(R));
    const std::vector<T> ones(static_cast<std::size_t>(R), T(1));
    cpu::ce_partials(logits, row_max, row_sumexp, R, V, ld);
    cpu::ce_target_logit(logits, targets, target.data(), R, V, 0, ld);
    cpu::ce_losses<T>(row_max, row_sumexp, target.data(), losses, R);
    cpu::ce_backward(logits, targets, row_max, row_sumexp, ones.data(), logits, R, V, 0, ld);
  }

  template <class T>
  void embedding_forward(const std::int32_t* ids, const T* table, T* out, int n, int C, int v0, int V_local) const {
    cpu::embedding_forward(ids, table, out, n, C, v0, V_local);
  }
  template <class T>
  void embedding_backward(const std::int32_t* ids, const T* dout, T* dtable, int n, int C, int v0,
                          int V_local) const {
    cpu::embedding_backward(ids, dout, dtable, n, C, v0, V_local);
  }
  template <class T>
  void add_positions(const T* wpe, T* out, int B, int T_, int C, int t0) const {
    cpu::add_positions(wpe, out, B, T_, C, t0);
  }
  template <class T>
  void positions_backward(const T* dout, T* dwpe, int B, int T_, int C, int t0) const {
    cpu::positions_backward(dout, dwpe, B, T_, C, t0);
  }

  template <class T>
  void dropout_forward(const T* x, T* out, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0) const {
    cpu::dropout_forward(x, out, n, p, seed, index0);
  }
  template <class T>
  void dropout_backward(const T* dout, T* dx, std::size_t n, float p, std::uint64_t seed,
                        std::uint64_t index0) const {
    cpu::dropout_backward(dout, dx, n, p, seed, index0);
  }

  template <class T>
  void attention_forward(const T* q, const T* k, const T* v, T* out, acc_t<T>* lse,
                         const AttentionShape& s) const {
    cpu::attention_forward(q, k, v, out, lse, s);
  }
  template <class T>
  void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const acc_t<T>* lse, T* dq,
                          T* dk, T* dv, const AttentionShape& s) const {
    cpu::attention_backward(dout, q, k, v, out, lse, dq, dk, dv, s);
  }

  //! The optimizers' updates; with `master`, on fp32 master weights of bf16 parameters (cpu::adamw_step).
  template <class T>
  void adamw_step(T* param, const T* grad, acc_t<T>* m, acc_t<T>* v, std::size_t n, double lr, double beta1,
                  double beta2, double eps, double weight_decay, int t, acc_t<T>* master = nullptr) const {
    cpu::adamw_step(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, t, master);
  }
  //! adamw_step over count runs of the flat buffers (param and grad at run.param, m, v and master at run.at;
  //! weight_decay where run.decay), one after the other (a device updates them all in one launch). master: null, or
  //! the fp32 master weights.
  template <class T>
  void adamw_runs(T* param, const T* grad, acc_t<T>* m, acc_t<T>* v, acc_t<T>* master, const UpdateRun* runs,
                  std::size_t count, double lr, double beta1, double beta2, double eps, double weight_decay,
                  int t) const {
    for (std::size_t i = 0; i < count; ++i) {
      const UpdateRun& r = runs[i];
      cpu::adamw_step(param + r.param, grad + r.param, m + r.at, v + r.at, static_cast<std::size_t>(r.n), lr, beta1,
                      beta2, eps, r.decay ? weight_decay : 0.0, t, master ? master + r.at : nullptr);
    }
  }
  template <class T>
  void sgd_step(T* param, const T* grad, acc_t<T>* buf, std::size_t n, double lr, double momentum,
                double weight_decay, bool first, acc_t<T>* master = nullptr) const {
    cpu::sgd_step(param, grad, buf, n, lr, momentum, weight_decay, first, master);
  }

  //! dst = src, n elements on this device (the ranges may be the same, not otherwise overlap).
  template <class T>
  void copy(const T* src, T* dst, std::size_t n) const {
    if (src != dst && n > 0) std::copy_n(src, n, dst);
  }
  //! n elements = value.
  template <class T>
  void fill(T* x, std::size_t n, T value) const {
    std::fill_n(x, n, value);
  }
  //! x *= s, computed in acc_t<T> (gradient clipping).
  template <class T>
  void scale(T* x, std::size_t n, acc_t<T> s) const {
    for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<T>(static_cast<acc_t<T>>(x[i]) * s);
  }
  //! dst = src in acc_t<T> (a widened copy that gradients are reduced in), and back, rounded.
  template <class T>
  void widen(const T* src, acc_t<T>* dst, std::size_t n) const {
    std::transform(src, src + n, dst, [](T x) { return static_cast<acc_t<T>>(x); });
  }
  template <class T>
  void narrow(const acc_t<T>* src, T* dst, std::size_t n) const {
    std::transform(src, src + n, dst, [](acc_t<T> x) { return static_cast<T>(x); });
  }
  //! y += x, widened to acc_t<T> (sums of a block's gradients kept wider than the blocks).
  template <class T>
  void accumulate_wide(const T* x, acc_t<T>* y, std::size_t n) const {
    for (std::size_t i = 0; i < n; ++i) y[i] += static_cast<acc_t<T>>(x[i]);
  }
  //! dst[r * ldd + e] = src[r * lds + e], converted, for r < rows and e < w: a block of rows from one layout to
  //! another (S and D: the same type, or acc_t<D> rounded to D).
  template <class S, class D>
  void copy_rows(const S* src, std::ptrdiff_t lds, D* dst, std::ptrdiff_t ldd, int rows, int w) const {
    for (int r = 0; r < rows; ++r)
      for (int e = 0; e < w; ++e) dst[r * ldd + e] = static_cast<D>(src[r * lds + e]);
  }
  //! Merges a block's attention result into a running one by their log-sum-exp (ring attention), for each row (b, t)
  //! and head h: l = log(exp(L) + exp(Lb)), O = O exp(L - l) + Ob exp(Lb - l), L = l. O and Ob: B x c rows of ld
  //! elements, head h at h * D; L and Lb: B x H x c.
  template <class T>
  void lse_merge(acc_t<T>* O, acc_t<T>* L, const T* Ob, const acc_t<T>* Lb, int B, int H, int c, int D,
                 std::ptrdiff_t ld) const {
    using A = acc_t<T>;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < c; ++t) {
          const std::size_t li = (std::size_t(b) * H + h) * c + t;
          const A la = L[li], lb = Lb[li], m = std::max(la, lb);
          const A l = m + std::log(std::exp(la - m) + std::exp(lb - m));
          const A wa = std::exp(la - l), wb = std::exp(lb - l);
          A* o = O + (std::ptrdiff_t(b) * c + t) * ld + std::ptrdiff_t(h) * D;
          const T* ob = Ob + (std::ptrdiff_t(b) * c + t) * ld + std::ptrdiff_t(h) * D;
          for (int d = 0; d < D; ++d) o[d] = o[d] * wa + static_cast<A>(ob[d]) * wb;
          L[li] = l;
        }
  }
  //! `batches` matrices of rows x cols, each transposed: dst[b][c][r] = src[b][r][c] (Ulysses' log-sum-exp between
  //! B x H x T and B x T x H).
  template <class U>
  void transpose(const U* src, U* dst, int batches, int rows, int cols) const {
    for (std::ptrdiff_t b = 0; b < batches; ++b)
      for (std::ptrdiff_t r = 0; r < rows; ++r)
        for (std::ptrdiff_t c = 0; c < cols; ++c)
          dst[(b * cols + c) * rows + r] = src[(b * rows + r) * cols + c];
  }
  //! Rows of d elements by index (a mixture of experts' dispatch): dst[i] = src[rows[i]], times weights[i] where
  //! weights is given (in T), for i < n.
  template <class T>
  void gather_rows(const T* src, const std::int32_t* rows, const T* weights, T* dst, std::size_t n, int d) const {
    for (std::size_t i = 0; i < n; ++i) {
      const T* a = src + std::size_t(rows[i]) * d;
      T* b = dst + i * d;
      if (weights)
        for (int c = 0; c < d; ++c) b[c] = weights[i] * a[c];
      else
        for (int c = 0; c < d; ++c) b[c] = a[c];
    }
  }
  //! dst[rows[i]] = src[i], rows of d elements, for i < n (rows distinct).
  template <class T>
  void scatter_rows(const T* src, const std::int32_t* rows, T* dst, std::size_t n, int d) const {
    for (std::size_t i = 0; i < n; ++i) std::copy_n(src + i * d, d, dst + std::size_t(rows[i]) * d);
  }
  //! For each of `tokens` rows of dst, in order, dst[t] += weights[s] src[s] (or src[s] without weights) for s =
  //! slots[t k + m], m < k, up to the first negative slot: a mixture of experts' combine, each token's expert outputs
  //! added in the order of its slots.
  template <class T>
  void combine_rows(const T* src, const std::int32_t* slots, int k, const T* weights, T* dst, std::size_t tokens,
                    int d) const {
    for (std::size_t t = 0; t < tokens; ++t) {
      T* y = dst + t * d;
      for (int m = 0; m < k; ++m) {
        const std::int32_t s = slots[t * k + m];
        if (s < 0) break;
        const T* x = src + std::size_t(s) * d;
        if (weights)
          for (int c = 0; c < d; ++c) y[c] += weights[s] * x[c];
        else
          for (int c = 0; c < d; ++c) y[c] += x[c];
      }
    }
  }
  //! out[i] = the dot product of rows a[rows[i]] and b[i] (d elements each), in double.
  template <class T>
  void row_dots(const T* a, const std::int32_t* rows, const T* b, double* out, std::size_t n, int d) const {
    for (std::size_t i = 0; i < n; ++i) {
      const T* x = a + std::size_t(rows[i]) * d;
      const T* y = b + i * d;
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += double(x[c]) * double(y[c]);
      out[i] = dot;
    }
  }
  //! Host memory from this device's, and back; on the host, copies.
  template <class T>
  void to_host(const T* src, T* host_dst, std::size_t n) const {
    copy(src, host_dst, n);
  }
  template <class T>
  void from_host(const T* host_src, T* dst, std::size_t n) const {
    copy(host_src, dst, n);
  }
  //! The sum of x[i]^2 in double, in order.
  template <class T>
  double sum_squares(const T* x, std::size_t n) const {
    double s = 0;
    for (std::size_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    return s;
  }
  //! Each piece's sum of squares, out[i] = sum_squares(x + at[i], n[i]) (at, n and out in host memory); a device
  //! waits once for them all.
  template <class T>
  void sums_of_squares(const T* x, const std::int64_t* at, const std::int64_t* n, std::size_t count,
                       double* out) const {
    for (std::size_t i = 0; i < count; ++i) out[i] = sum_squares(x + at[i], static_cast<std::size_t>(n[i]));
  }
  //! The sum of x[i] in double, in order.
  template <class T>
  double sum(const T* x, std::size_t n) const {
    double s = 0;
    for (std::size_t i = 0; i < n; ++i) s += static_cast<double>(x[i]);
    return s;
  }
  //! Waits for the work issued so far (nothing to wait for on the host).
  void synchronize() const {}
  //! The point the work issued so far has reached, for another thread to wait on (an exec::Completion): on the
  //! host that work is already done.
  struct Mark {
    void wait() const {}
  };
  Mark mark() const { return {}; }
};

//! What layers, models and optimizers call on a device's Ops, for storage type T (acc_t<T> for statistics, moments
//! and losses' partials): each Ops<Device> states that it provides every operation with these signatures, so that
//! the devices cannot drift apart.
template <class O, class T>
concept DeviceOpsFor = requires(const O& o, const T* c, T* p, acc_t<T>* a, const acc_t<T>* ca,
                                const std::int32_t* ids, std::size_t n, int i, float f, double d, bool b,
                                std::uint64_t u, const AttentionShape& s, std::ptrdiff_t ld, double* dd,
                                const std::int64_t* ii) {
  typename O::device;
  { o.template scratch<T>(n).data() } -> std::convertible_to<T*>;
  o.matmul(c, c, p, i, i, i, b, b, f, f);
  o.matmul_ld(c, ld, c, ld, p, ld, i, i, i, b, b, f, f);
  o.matmul_bias(c, c, c, p, i, i, i, b, b);
  o.matmul_residual(c, c, c, c, p, i, i, i, b, b);
  o.matmul_bias_gelu(c, c, c, p, p, i, i, i, b, b);
  o.matmul_dgelu(c, c, c, p, i, i, i, b, b);
  o.matmul_group(static_cast<const Product<T>*>(nullptr), n, b, b, f, f);
  o.matmul_bgrad(c, c, p, p, i, i, i, b, f, f);
  { O::template row_pitch<T>(ld) } -> std::convertible_to<std::ptrdiff_t>;
  o.bias_add(c, c, p, i, i);
  o.bias_backward(c, p, i, i);
  o.add(c, c, p, n);
  o.accumulate(c, p, n);
  o.gelu_forward(c, p, n);
  o.gelu_backward(c, c, p, n);
  o.swiglu_forward(c, p, i, i);
  o.swiglu_backward(c, c, p, i, i);
  o.layernorm_forward(c, c, c, p, a, a, i, i, f);
  o.layernorm_backward_input(c, c, c, ca, ca, p, i, i, c);
  o.layernorm_backward_weight(c, c, ca, ca, p, p, i, i);
  o.rmsnorm_forward(c, c, p, a, i, i, d);
  o.rmsnorm_backward_input(c, c, c, ca, p, i, i, c);
  o.rmsnorm_backward_weight(c, c, ca, p, i, i);
  o.rope_rotate(p, ca, ca, i, i, i, i, i, b);
  o.ce_partials(c, a, a, i, i, ld);
  o.template ce_rescale<T>(ca, ca, a, i);
  o.ce_target_logit(c, ids, a, i, i, i, ld);
  o.template ce_losses<T>(ca, ca, ca, p, i);
  o.ce_backward(c, ids, ca, ca, c, p, i, i, i, ld);
  o.ce_loss_grad(p, ids, a, a, p, i, i, ld);
  o.embedding_forward(ids, c, p, i, i, i, i);
  o.embedding_backward(ids, c, p, i, i, i, i);
  o.add_positions(c, p, i, i, i, i);
  o.positions_backward(c, p, i, i, i, i);
  o.dropout_forward(c, p, n, f, u, u);
  o.dropout_backward(c, p, n, f, u, u);
  o.attention_forward(c, c, c, p, a, s);
  o.attention_backward(c, c, c, c, c, ca, p, p, p, s);
  o.adamw_step(p, c, a, a, n, d, d, d, d, d, i);
  o.adamw_step(p, c, a, a, n, d, d, d, d, d, i, a);
  o.adamw_runs(p, c, a, a, a, static_cast<const UpdateRun*>(nullptr), n, d, d, d, d, d, i);
  o.sgd_step(p, c, a, n, d, d, d, b);
  o.sgd_step(p, c, a, n, d, d, d, b, a);
  o.copy(c, p, n);
  o.fill(p, n, T{});
  o.scale(p, n, acc_t<T>{});
  o.widen(c, a, n);
  o.narrow(ca, p, n);
  o.accumulate_wide(c, a, n);
  o.copy_rows(c, ld, p, ld, i, i);
  o.copy_rows(ca, ld, p, ld, i, i);
  o.copy_rows(ca, ld, a, ld, i, i);
  o.lse_merge(a, a, c, ca, i, i, i, i, ld);
  o.transpose(ca, a, i, i, i);
  o.gather_rows(c, ids, c, p, n, i);
  o.scatter_rows(c, ids, p, n, i);
  o.combine_rows(c, ids, i, c, p, n, i);
  o.row_dots(c, ids, c, dd, n, i);
  o.to_host(c, p, n);
  o.from_host(c, p, n);
  { o.sum_squares(c, n) } -> std::convertible_to<double>;
  o.sums_of_squares(c, ii, ii, n, dd);
  { o.sum(c, n) } -> std::convertible_to<double>;
  o.synchronize();
  o.mark().wait();
};

//! DeviceOpsFor every floating storage type a device computes with.
template <class O>
concept DeviceOps = DeviceOpsFor<O, float> && DeviceOpsFor<O, double>;

static_assert(DeviceOps<Ops<Host>>, "loom: Ops<Host> must provide every operation of DeviceOps");

//! Whether the device's memory is the host's (host pointers may be read directly).
template <class Device>
inline constexpr bool is_host_v = std::is_same_v<Device, Host>;

//! Operations on a stream apart from the model's, for the copies a collective reads (gradients widened or padded for
//! their reduction): they run as soon as the gradients they copy are written, not after every kernel queued on the
//! model's stream since. On the host there is no stream: the model's operations run them, at once. Ops<Cuda>'s
//! specialisation makes a stream of its own.
template <class Device>
class SideStream {
 public:
  template <class O>
  const O& ops(const O& model) {
    return model;
  }
};

//! The stream a device's operations run on, as communicators order on it (comm::Frontend::on_stream): a
//! cudaStream_t for Ops<Cuda>; none (the host's order) for the host.
template <class O>
std::optional<void*> stream_of([[maybe_unused]] const O& ops) {
  if constexpr (requires { ops.stream; }) return static_cast<void*>(ops.stream);
  else return std::nullopt;
}

}  // namespace loom::kernels

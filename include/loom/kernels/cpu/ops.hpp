// The operations of a transformer (GPT-2's and Llama's) on the CPU, forward and backward, on raw row-major memory with explicit local shapes.
// Every later layout shards these: the cross-entropy works on a slice of the vocabulary through per-row max and
// sum-exp partials, the embedding on a slice of the table, dropout is keyed by global element indices.
// Backward is split where a layer's input and weight gradients are needed at different times (zero-bubble
// pipelines, early gradient reduction): *_backward_input and *_backward_weight. Weight gradients accumulate (+=);
// input gradients are written (=) unless the name says accumulate.
// T is float or double; bf16 and fp16 storage compute in float (acc_t<T>).
#pragma once

#include <loom/core/half.hpp>
#include <loom/kernels/shape.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace loom::kernels::cpu {

using loom::acc_t;

// --- matrix products ------------------------------------------------------------------------------------------
//! C = alpha * op(A) * op(B) + beta * C, for `batch` independent products; op(A) is M x K (A stored M x K, or K x M
//! when trans_a), op(B) is K x N (B stored K x N, or N x K when trans_b), C is M x N; all row-major and contiguous;
//! batch i uses A + i*stride_a, B + i*stride_b, C + i*stride_c. bf16/fp16 accumulate in float.
template <class T>
void matmul(const T* A, const T* B, T* C, int M, int N, int K, bool trans_a, bool trans_b, float alpha = 1.0f,
            float beta = 0.0f, int batch = 1, std::ptrdiff_t stride_a = 0, std::ptrdiff_t stride_b = 0,
            std::ptrdiff_t stride_c = 0);

//! One product C = alpha * op(A) * op(B) + beta * C whose stored rows lie lda, ldb and ldc elements apart (at least
//! their widths: K or M for A, N or K for B, N for C).
template <class T>
void matmul_ld(const T* A, std::ptrdiff_t lda, const T* B, std::ptrdiff_t ldb, T* C, std::ptrdiff_t ldc, int M, int N,
               int K, bool trans_a, bool trans_b, float alpha = 1.0f, float beta = 0.0f);

// --- element-wise ---------------------------------------------------------------------------------------------
//! out[r, c] = x[r, c] + bias[c] for R rows of C columns; out may be x.
template <class T>
void bias_add(const T* x, const T* bias, T* out, int R, int C);
//! dbias[c] += sum over r of dout[r, c].
template <class T>
void bias_backward(const T* dout, T* dbias, int R, int C);
//! out = a + b over n elements; out may be a or b.
template <class T>
void add(const T* a, const T* b, T* out, std::size_t n);
//! y += x over n elements (gradient accumulation, residual backward).
template <class T>
void accumulate(const T* x, T* y, std::size_t n);
//! out = GELU(x), tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <class T>
void gelu_forward(const T* x, T* out, std::size_t n);
//! dx = dout * GELU'(x).
template <class T>
void gelu_backward(const T* x, const T* dout, T* dx, std::size_t n);

//! out[r, c] = silu(h[r, c]) h[r, F + c] for R rows of [gate | up] (2F columns): Llama's SwiGLU, silu(g) =
//! g sigmoid(g). out is R x F.
template <class T>
void swiglu_forward(const T* h, T* out, int R, int F);
//! dh (R x 2F, written: the gate's and the up projection's gradients) from dout (R x F).
template <class T>
void swiglu_backward(const T* h, const T* dout, T* dh, int R, int F);

// --- layer norm -----------------------------------------------------------------------------------------------
//! out[r] = (x[r] - mean) * rstd * w + b over C columns; mean[r] and rstd[r] are kept for backward. eps is
//! double as torch's (a float model rounds it to float).
template <class T>
void layernorm_forward(const T* x, const T* w, const T* b, T* out, acc_t<T>* mean, acc_t<T>* rstd, int R, int C,
                       double eps = 1e-5);
//! dx = gradient of the input (written); with dres, dx = dres + that gradient (rounded to T first, as a separate
//! accumulate would add it): a residual path's gradient to the same input. dres may be dx.
template <class T>
void layernorm_backward_input(const T* dout, const T* x, const T* w, const acc_t<T>* mean, const acc_t<T>* rstd,
                              T* dx, int R, int C, const T* dres = nullptr);
//! dw += sum_r dout * xhat, db += sum_r dout.
template <class T>
void layernorm_backward_weight(const T* dout, const T* x, const acc_t<T>* mean, const acc_t<T>* rstd, T* dw, T* db,
                               int R, int C);

// --- RMS norm (Llama) -----------------------------------------------------------------------------------------
//! out[r] = x[r] * rstd * w over C columns, rstd = (mean of x[r]^2 + eps)^-1/2, kept for backward.
template <class T>
void rmsnorm_forward(const T* x, const T* w, T* out, acc_t<T>* rstd, int R, int C, double eps = 1e-6);
//! dx = gradient of the input (written); with dres, dx = dres + that gradient, as layernorm_backward_input.
template <class T>
void rmsnorm_backward_input(const T* dout, const T* x, const T* w, const acc_t<T>* rstd, T* dx, int R, int C,
                            const T* dres = nullptr);
//! dw += sum_r dout * x * rstd.
template <class T>
void rmsnorm_backward_weight(const T* dout, const T* x, const acc_t<T>* rstd, T* dw, int R, int C);

// --- rotary positions (RoPE) ----------------------------------------------------------------------------------
//! Rotates in place `heads` heads of hd elements in each of n rows (row i at x + i ld, its heads consecutive) by
//! the angles of position t0 + i: for j < hd/2 the pair (x_j, x_{j + hd/2}) becomes (x_j cos - x_{j + hd/2} sin,
//! x_{j + hd/2} cos + x_j sin), with cos and sin of plane j at that position from the tables cos, sin
//! ([positions, hd/2], row-major). inverse: by the opposite angle, which is the rotation's backward.
template <class T>
void rope_rotate(T* x, const acc_t<T>* cos, const acc_t<T>* sin, int n, int ld, int heads, int hd, int t0,
                 bool inverse);

// --- cross-entropy over a slice of the vocabulary -------------------------------------------------------------
// logits is R x V_local, holding vocabulary entries [v0, v0 + V_local) of V. Single rank: v0 = 0, V_local = V.
// With the vocabulary sharded, the caller combines the partials across shards: max = all_reduce(max);
// sumexp = all_reduce(sum of sumexp_local * exp(max_local - max)); target logit = all_reduce(sum).
// The logits' rows lie ld elements apart (0: V_local, dense); a device pads them to whole cache lines.
//! Per row: max over the slice, and sum of exp(logit - max) over the slice.
template <class T>
void ce_partials(const T* logits, acc_t<T>* row_max, acc_t<T>* row_sumexp, int R, int V_local, std::ptrdiff_t ld = 0);
//! Rescales local partials to a new (global) max: sumexp *= exp(local_max - global_max).
template <class T>
void ce_rescale(const acc_t<T>* local_max, const acc_t<T>* global_max, acc_t<T>* sumexp, int R);
//! Per row: the logit of targets[r] when it lies in this slice, else 0.
template <class T>
void ce_target_logit(const T* logits, const std::int32_t* targets, acc_t<T>* target_logit, int R, int V_local,
                     int v0, std::ptrdiff_t ld = 0);
//! losses[r] = log(sumexp[r]) + max[r] - target_logit[r], from global partials.
template <class T>
void ce_losses(const acc_t<T>* row_max, const acc_t<T>* row_sumexp, const acc_t<T>* target_logit, T* losses, int R);
//! dlogits[r, v] = dloss[r] * (exp(logit - max[r]) / sumexp[r] - [v0 + v == targets[r]]), with global partials;
//! may write over logits (dlogits == logits).
template <class T>
void ce_backward(const T* logits, const std::int32_t* targets, const acc_t<T>* row_max, const acc_t<T>* row_sumexp,
                 const T* dloss, T* dlogits, int R, int V_local, int v0, std::ptrdiff_t ld = 0);
//! The whole single-slice cross-entropy: losses[r] and the partials (R each) for ce_backward.
template <class T>
void cross_entropy_forward(const T* logits, const std::int32_t* targets, T* losses, acc_t<T>* row_max,
                           acc_t<T>* row_sumexp, int R, int V);

// --- embeddings -----------------------------------------------------------------------------------------------
//! out[i] = table[ids[i] - v0] for n ids when the id lies in [v0, v0 + V_local), else 0; rows of C.
template <class T>
void embedding_forward(const std::int32_t* ids, const T* table, T* out, int n, int C, int v0, int V_local);
//! dtable[ids[i] - v0] += dout[i] for ids in the slice (a scatter-add).
template <class T>
void embedding_backward(const std::int32_t* ids, const T* dout, T* dtable, int n, int C, int v0, int V_local);
//! out[b, t] += wpe[t0 + t] for B sequences of T positions starting at position t0, rows of C.
template <class T>
void add_positions(const T* wpe, T* out, int B, int T_, int C, int t0 = 0);
//! dwpe[t0 + t] += sum over b of dout[b, t].
template <class T>
void positions_backward(const T* dout, T* dwpe, int B, int T_, int C, int t0 = 0);

// --- dropout --------------------------------------------------------------------------------------------------
//! A uniform number in [0, 1) from (seed, global element index): the same however a tensor is split.
inline float dropout_uniform(std::uint64_t seed, std::uint64_t index);
//! out[i] = x[i] / (1 - p) when dropout_uniform(seed, index0 + i) >= p, else 0; p = 0 copies.
template <class T>
void dropout_forward(const T* x, T* out, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0);
//! dx[i] from dout[i] with the same mask.
template <class T>
void dropout_backward(const T* dout, T* dx, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0);

// --- attention ------------------------------------------------------------------------------------------------
//! Causal self-attention in tiles with an online softmax; the T x T matrix is never materialised (shapes and
//! strides: kernels::AttentionShape).
using kernels::AttentionShape;
template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, acc_t<T>* lse, const AttentionShape& s);
//! dq, dk, dv (written; strides as q, k, v) from dout (stride ldo), using out and lse from forward.
template <class T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const acc_t<T>* lse, T* dq,
                        T* dk, T* dv, const AttentionShape& s);

// --- optimizers -----------------------------------------------------------------------------------------------
//! torch.optim.AdamW's update for step t (1-based): p -= lr*wd*p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//! p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps). m and v in acc_t<T>.
//! The hyperparameters are double, as torch's Python scalars: it computes the bias corrections and step size in
//! double and casts them to the parameters' type. With `master` (n elements of acc_t<T>, for bf16/fp16 parameters;
//! null otherwise) the update is made on these fp32 master weights, taken from param at t = 1, and param is set to
//! them rounded.
template <class T>
void adamw_step(T* param, const T* grad, acc_t<T>* m, acc_t<T>* v, std::size_t n, double lr, double beta1,
                double beta2, double eps, double weight_decay, int t, acc_t<T>* master = nullptr);
//! torch.optim.SGD with momentum (dampening 0, no Nesterov): g += wd*p; buf = first ? g : momentum*buf + g;
//! p -= lr*buf. With momentum 0 torch keeps no buffer: buf may be null, and is otherwise set to g. `master` as for
//! adamw_step, taken from param on the first step.
template <class T>
void sgd_step(T* param, const T* grad, acc_t<T>* buf, std::size_t n, double lr, double momentum, double weight_decay,
              bool first, acc_t<T>* master = nullptr);

}  // namespace loom::kernels::cpu

// With LOOM_EXTERN_KERNELS the kernels are instantiated once elsewhere (loom::cpu_kernels), not in every file that
// calls them: Eigen's products are most of the time a model's translation unit takes to compile.
#ifdef LOOM_EXTERN_KERNELS
#include <loom/kernels/cpu/instantiate.hpp>
namespace loom::kernels::cpu {
LOOM_CPU_KERNELS(extern)
}  // namespace loom::kernels::cpu
#endif

// The definitions.
#define LOOM_KERNELS_CPU_OPS_INCLUDED
#include <loom/kernels/cpu/detail/matmul.hpp>
#include <loom/kernels/cpu/detail/elementwise.hpp>
#include <loom/kernels/cpu/detail/layernorm.hpp>
#include <loom/kernels/cpu/detail/rmsnorm.hpp>
#include <loom/kernels/cpu/detail/rope.hpp>
#include <loom/kernels/cpu/detail/cross_entropy.hpp>
#include <loom/kernels/cpu/detail/embedding.hpp>
#include <loom/kernels/cpu/detail/dropout.hpp>
#include <loom/kernels/cpu/detail/attention.hpp>
#include <loom/kernels/cpu/detail/optim.hpp>

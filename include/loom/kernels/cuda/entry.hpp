// The CUDA kernels as any C++ compiler sees them: one declaration per operation that Ops<Cuda> runs, on device
// pointers and a stream, with the explicit instantiations for float, double, bf16 and fp16 listed once
// (LOOM_CUDA_KERNELS). nvcc compiles their definitions (<loom/kernels/cuda/entry.cuh>) once, into
// loom::cuda_kernels (src/cuda_kernels_*.cu); a program that links it builds its own sources with g++ and
// includes <loom/kernels/cuda/device_ops.hpp>, never a kernel. A source nvcc compiles without linking the library
// gets the definitions from <loom/kernels/cuda/device_ops.cuh> instead (header-only).
#pragma once

#include <loom/core/dtype.hpp>
#include <loom/kernels/shape.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace loom::kernels::cuda::entry {

//! The type arithmetic is done in: double for double, float otherwise (loom::acc_t).
template <class T>
using acc = ::loom::acc_t<T>;

template <class T>
void matmul(const T* A, const T* B, T* C, int M, int N, int K, bool trans_a, bool trans_b, float alpha, float beta,
            cudaStream_t stream);
template <class T>
void matmul_bias(const T* A, const T* B, const T* bias, T* C, int M, int N, int K, bool trans_a, bool trans_b,
                 cudaStream_t stream);
template <class T>
void matmul_residual(const T* A, const T* B, const T* bias, const T* R, T* C, int M, int N, int K, bool trans_a,
                     bool trans_b, cudaStream_t stream);
template <class T>
void matmul_bias_gelu(const T* A, const T* B, const T* bias, T* pre, T* C, int M, int N, int K, bool trans_a,
                      bool trans_b, cudaStream_t stream);
template <class T>
void matmul_dgelu(const T* A, const T* B, const T* pre, T* C, int M, int N, int K, bool trans_a, bool trans_b,
                  cudaStream_t stream);
template <class T>
void matmul_ld(const T* A, std::ptrdiff_t lda, const T* B, std::ptrdiff_t ldb, T* C, std::ptrdiff_t ldc, int M, int N,
               int K, bool trans_a, bool trans_b, float alpha, float beta, cudaStream_t stream);
template <class T>
void matmul_bgrad(const T* A, const T* B, T* C, T* dbias, int M, int N, int K, bool trans_a, float alpha, float beta,
                  cudaStream_t stream);
template <class T>
void matmul_group(const Product<T>* ps, std::size_t count, bool trans_a, bool trans_b, float alpha, float beta,
                  cudaStream_t stream);
template <class T>
void bias_add(const T* x, const T* bias, T* out, int R, int C, cudaStream_t stream);
template <class T>
void bias_backward(const T* dout, T* dbias, int R, int C, cudaStream_t stream);
template <class T>
void add(const T* a, const T* b, T* out, std::size_t n, cudaStream_t stream);
template <class T>
void accumulate(const T* x, T* y, std::size_t n, cudaStream_t stream);
template <class T>
void gelu_forward(const T* x, T* out, std::size_t n, cudaStream_t stream);
template <class T>
void gelu_backward(const T* x, const T* dout, T* dx, std::size_t n, cudaStream_t stream);
template <class T>
void swiglu_forward(const T* h, T* out, int R, int F, cudaStream_t stream);
template <class T>
void swiglu_backward(const T* h, const T* dout, T* dh, int R, int F, cudaStream_t stream);
template <class T>
void rmsnorm_forward(const T* x, const T* w, T* out, acc<T>* rstd, int R, int C, double eps, cudaStream_t stream);
template <class T>
void rmsnorm_backward_input(const T* dout, const T* x, const T* w, const acc<T>* rstd, T* dx, int R, int C,
                            const T* dres, cudaStream_t stream);
template <class T>
void rmsnorm_backward_weight(const T* dout, const T* x, const acc<T>* rstd, T* dw, int R, int C,
                             cudaStream_t stream);
template <class T>
void rope_rotate(T* x, const acc<T>* cos, const acc<T>* sin, int n, int ld, int heads, int hd, int t0,
                 bool inverse, cudaStream_t stream);
template <class T>
void layernorm_forward(const T* x, const T* w, const T* b, T* out, acc<T>* mean, acc<T>* rstd, int R, int C,
                       double eps, cudaStream_t stream);
template <class T>
void layernorm_backward_input(const T* dout, const T* x, const T* w, const acc<T>* mean, const acc<T>* rstd,
                              T* dx, int R, int C, const T* dres, cudaStream_t stream);
template <class T>
void layernorm_backward_weight(const T* dout, const T* x, const acc<T>* mean, const acc<T>* rstd, T* dw, T* db,
                               int R, int C, cudaStream_t stream);
template <class T>
void ce_partials(const T* logits, acc<T>* row_max, acc<T>* row_sumexp, int R, int V_local, std::ptrdiff_t ld,
                 cudaStream_t stream);
template <class T>
void ce_rescale(const acc<T>* local_max, const acc<T>* global_max, acc<T>* sumexp, int R, cudaStream_t stream);
template <class T>
void ce_target_logit(const T* logits, const std::int32_t* targets, acc<T>* target_logit, int R, int V_local, int v0,
                     std::ptrdiff_t ld, cudaStream_t stream);
template <class T>
void ce_losses(const acc<T>* row_max, const acc<T>* row_sumexp, const acc<T>* target_logit, T* losses, int R,
               cudaStream_t stream);
template <class T>
void ce_backward(const T* logits, const std::int32_t* targets, const acc<T>* row_max, const acc<T>* row_sumexp,
                 const T* dloss, T* dlogits, int R, int V_local, int v0, std::ptrdiff_t ld, cudaStream_t stream);
template <class T>
void ce_loss_grad(T* logits, const std::int32_t* targets, acc<T>* row_max, acc<T>* row_sumexp, T* losses, int R,
                  int V, std::ptrdiff_t ld, cudaStream_t stream);
template <class T>
void embedding_forward(const std::int32_t* ids, const T* table, T* out, int n, int C, int v0, int V_local,
                       cudaStream_t stream);
template <class T>
void embedding_backward(const std::int32_t* ids, const T* dout, T* dtable, int n, int C, int v0, int V_local,
                        cudaStream_t stream);
template <class T>
void add_positions(const T* wpe, T* out, int B, int T_, int C, int t0, cudaStream_t stream);
template <class T>
void positions_backward(const T* dout, T* dwpe, int B, int T_, int C, int t0, cudaStream_t stream);
template <class T>
void dropout_forward(const T* x, T* out, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0,
                     cudaStream_t stream);
template <class T>
void dropout_backward(const T* dout, T* dx, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0,
                      cudaStream_t stream);
template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, acc<T>* lse, const AttentionShape& s,
                       cudaStream_t stream);
template <class T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const acc<T>* lse, T* dq,
                        T* dk, T* dv, const AttentionShape& s, cudaStream_t stream);
template <class T>
void adamw_step(T* param, const T* grad, acc<T>* m, acc<T>* v, std::size_t n, double lr, double beta1,
                double beta2, double eps, double weight_decay, int t, acc<T>* master, cudaStream_t stream);
template <class T>
void adamw_runs(T* param, const T* grad, acc<T>* m, acc<T>* v, acc<T>* master, const UpdateRun* runs, std::size_t count,
                double lr, double beta1, double beta2, double eps, double weight_decay, int t, cudaStream_t stream);
template <class T>
void sgd_step(T* param, const T* grad, acc<T>* buf, std::size_t n, double lr, double momentum, double weight_decay,
              bool first, acc<T>* master, cudaStream_t stream);
//! x[i] = value (value passed as its bytes, so that this header needs no 16-bit arithmetic).
template <class T>
void fill(T* x, std::size_t n, const T* value, cudaStream_t stream);
//! x[i] *= s.
template <class T>
void scale(T* x, std::size_t n, acc<T> s, cudaStream_t stream);
//! dst[i] = src[i] in acc<T>, and back (rounded to nearest).
template <class T>
void widen(const T* src, acc<T>* dst, std::size_t n, cudaStream_t stream);
template <class T>
void narrow(const acc<T>* src, T* dst, std::size_t n, cudaStream_t stream);
//! y[i] += x[i] widened to acc<T>.
template <class T>
void accumulate_wide(const T* x, acc<T>* y, std::size_t n, cudaStream_t stream);
//! dst[r * ldd + e] = src[r * lds + e] rounded to T, for r < rows and e < w.
template <class T>
void narrow_rows(const acc<T>* src, std::ptrdiff_t lds, T* dst, std::ptrdiff_t ldd, int rows, int w,
                 cudaStream_t stream);
//! Ops<Host>::transpose on acc<T> (batches of rows x cols, each transposed), a thread per element.
template <class T>
void transpose(const acc<T>* src, acc<T>* dst, int batches, int rows, int cols, cudaStream_t stream);
//! Ops<Host>::lse_merge's merge of a block's attention result into a running one, a thread per row and head.
template <class T>
void lse_merge(acc<T>* O, acc<T>* L, const T* Ob, const acc<T>* Lb, int B, int H, int c, int D, std::ptrdiff_t ld,
               cudaStream_t stream);
//! Ops<Host>::gather_rows, scatter_rows, combine_rows and row_dots (a mixture of experts' dispatch and combine).
template <class T>
void gather_rows(const T* src, const std::int32_t* rows, const T* weights, T* dst, std::size_t n, int d,
                 cudaStream_t stream);
template <class T>
void scatter_rows(const T* src, const std::int32_t* rows, T* dst, std::size_t n, int d, cudaStream_t stream);
template <class T>
void combine_rows(const T* src, const std::int32_t* slots, int k, const T* weights, T* dst, std::size_t tokens, int d,
                  cudaStream_t stream);
template <class T>
void row_dots(const T* a, const std::int32_t* rows, const T* b, double* out, std::size_t n, int d,
              cudaStream_t stream);
//! The sum of x, or of its squares, in double: reduced on the device to per-block partials that the host adds in a
//! fixed order (deterministic); returns when the stream has done it.
template <class T>
double sum(const T* x, std::size_t n, cudaStream_t stream);
template <class T>
double sum_squares(const T* x, std::size_t n, cudaStream_t stream);
//! Each piece's sum of squares (x + at[i], n[i] elements; at, n and out in host memory), with one wait for all.
template <class T>
void sums_of_squares(const T* x, const std::int64_t* at, const std::int64_t* n, std::size_t count, double* out,
                     cudaStream_t stream);

}  // namespace loom::kernels::cuda::entry

// LOOM_CUDA_KERNELS_FOR(prefix, T): every entry point above for storage type T, each preceded by `prefix template`
// (prefix: extern, or nothing for the definitions in src/cuda_kernels_*.cu).
#define LOOM_CUDA_KERNELS_FOR(prefix, T)                                                                              \
  prefix template void matmul<T>(const T*, const T*, T*, int, int, int, bool, bool, float, float, cudaStream_t);      \
  prefix template void matmul_bias<T>(const T*, const T*, const T*, T*, int, int, int, bool, bool, cudaStream_t);     \
  prefix template void matmul_residual<T>(const T*, const T*, const T*, const T*, T*, int, int, int, bool, bool,     \
                                          cudaStream_t);                                                             \
  prefix template void matmul_bias_gelu<T>(const T*, const T*, const T*, T*, T*, int, int, int, bool, bool,           \
                                           cudaStream_t);                                                             \
  prefix template void matmul_dgelu<T>(const T*, const T*, const T*, T*, int, int, int, bool, bool, cudaStream_t);    \
  prefix template void matmul_ld<T>(const T*, std::ptrdiff_t, const T*, std::ptrdiff_t, T*, std::ptrdiff_t, int, int, \
                                    int, bool, bool, float, float, cudaStream_t);                                     \
  prefix template void matmul_bgrad<T>(const T*, const T*, T*, T*, int, int, int, bool, float, float, cudaStream_t);   \
  prefix template void matmul_group<T>(const Product<T>*, std::size_t, bool, bool, float, float, cudaStream_t);      \
  prefix template void bias_add<T>(const T*, const T*, T*, int, int, cudaStream_t);                                   \
  prefix template void bias_backward<T>(const T*, T*, int, int, cudaStream_t);                                        \
  prefix template void add<T>(const T*, const T*, T*, std::size_t, cudaStream_t);                                     \
  prefix template void accumulate<T>(const T*, T*, std::size_t, cudaStream_t);                                        \
  prefix template void gelu_forward<T>(const T*, T*, std::size_t, cudaStream_t);                                      \
  prefix template void gelu_backward<T>(const T*, const T*, T*, std::size_t, cudaStream_t);                           \
  prefix template void swiglu_forward<T>(const T*, T*, int, int, cudaStream_t);                                       \
  prefix template void swiglu_backward<T>(const T*, const T*, T*, int, int, cudaStream_t);                            \
  prefix template void rmsnorm_forward<T>(const T*, const T*, T*, acc<T>*, int, int, double, cudaStream_t);           \
  prefix template void rmsnorm_backward_input<T>(const T*, const T*, const T*, const acc<T>*, T*, int, int,           \
                                                 const T*, cudaStream_t);                                             \
  prefix template void rmsnorm_backward_weight<T>(const T*, const T*, const acc<T>*, T*, int, int, cudaStream_t);     \
  prefix template void rope_rotate<T>(T*, const acc<T>*, const acc<T>*, int, int, int, int, int, bool,                \
                                      cudaStream_t);                                                                  \
  prefix template void layernorm_forward<T>(const T*, const T*, const T*, T*, acc<T>*, acc<T>*, int, int, double,     \
                                            cudaStream_t);                                                            \
  prefix template void layernorm_backward_input<T>(const T*, const T*, const T*, const acc<T>*, const acc<T>*,        \
                                                   T*, int, int, const T*, cudaStream_t);                             \
  prefix template void layernorm_backward_weight<T>(const T*, const T*, const acc<T>*, const acc<T>*, T*, T*,         \
                                                    int, int, cudaStream_t);                                          \
  prefix template void ce_partials<T>(const T*, acc<T>*, acc<T>*, int, int, std::ptrdiff_t, cudaStream_t);            \
  prefix template void ce_rescale<T>(const acc<T>*, const acc<T>*, acc<T>*, int, cudaStream_t);                       \
  prefix template void ce_target_logit<T>(const T*, const std::int32_t*, acc<T>*, int, int, int, std::ptrdiff_t,      \
                                          cudaStream_t);                                                              \
  prefix template void ce_losses<T>(const acc<T>*, const acc<T>*, const acc<T>*, T*, int, cudaStream_t);              \
  prefix template void ce_backward<T>(const T*, const std::int32_t*, const acc<T>*, const acc<T>*, const T*,          \
                                      T*, int, int, int, std::ptrdiff_t, cudaStream_t);                               \
  prefix template void ce_loss_grad<T>(T*, const std::int32_t*, acc<T>*, acc<T>*, T*, int, int, std::ptrdiff_t,       \
                                       cudaStream_t);                                                                 \
  prefix template void embedding_forward<T>(const std::int32_t*, const T*, T*, int, int, int, int, cudaStream_t);     \
  prefix template void embedding_backward<T>(const std::int32_t*, const T*, T*, int, int, int, int, cudaStream_t);    \
  prefix template void add_positions<T>(const T*, T*, int, int, int, int, cudaStream_t);                              \
  prefix template void positions_backward<T>(const T*, T*, int, int, int, int, cudaStream_t);                         \
  prefix template void dropout_forward<T>(const T*, T*, std::size_t, float, std::uint64_t, std::uint64_t,             \
                                          cudaStream_t);                                                              \
  prefix template void dropout_backward<T>(const T*, T*, std::size_t, float, std::uint64_t, std::uint64_t,            \
                                           cudaStream_t);                                                             \
  prefix template void attention_forward<T>(const T*, const T*, const T*, T*, acc<T>*, const AttentionShape&,         \
                                            cudaStream_t);                                                            \
  prefix template void attention_backward<T>(const T*, const T*, const T*, const T*, const T*, const acc<T>*, T*,     \
                                             T*, T*, const AttentionShape&, cudaStream_t);                            \
  prefix template void adamw_runs<T>(T*, const T*, acc<T>*, acc<T>*, acc<T>*, const UpdateRun*, std::size_t, double,  \
                                     double, double, double, double, int, cudaStream_t);                              \
  prefix template void adamw_step<T>(T*, const T*, acc<T>*, acc<T>*, std::size_t, double, double, double,             \
                                     double, double, int, acc<T>*, cudaStream_t);                                     \
  prefix template void sgd_step<T>(T*, const T*, acc<T>*, std::size_t, double, double, double, bool, acc<T>*,         \
                                   cudaStream_t);                                                                     \
  prefix template void fill<T>(T*, std::size_t, const T*, cudaStream_t);                                              \
  prefix template void scale<T>(T*, std::size_t, acc<T>, cudaStream_t);                                               \
  prefix template void widen<T>(const T*, acc<T>*, std::size_t, cudaStream_t);                                       \
  prefix template void accumulate_wide<T>(const T*, acc<T>*, std::size_t, cudaStream_t);                             \
  prefix template void gather_rows<T>(const T*, const std::int32_t*, const T*, T*, std::size_t, int, cudaStream_t);  \
  prefix template void scatter_rows<T>(const T*, const std::int32_t*, T*, std::size_t, int, cudaStream_t);           \
  prefix template void combine_rows<T>(const T*, const std::int32_t*, int, const T*, T*, std::size_t, int,           \
                                       cudaStream_t);                                                                 \
  prefix template void row_dots<T>(const T*, const std::int32_t*, const T*, double*, std::size_t, int, cudaStream_t);\
  prefix template void narrow_rows<T>(const acc<T>*, std::ptrdiff_t, T*, std::ptrdiff_t, int, int, cudaStream_t);    \
  prefix template void lse_merge<T>(acc<T>*, acc<T>*, const T*, const acc<T>*, int, int, int, int, std::ptrdiff_t,   \
                                    cudaStream_t);                                                                    \
  prefix template void narrow<T>(const acc<T>*, T*, std::size_t, cudaStream_t);                                      \
  prefix template void transpose<T>(const acc<T>*, acc<T>*, int, int, int, cudaStream_t);                            \
  prefix template double sum<T>(const T*, std::size_t, cudaStream_t);                                                 \
  prefix template double sum_squares<T>(const T*, std::size_t, cudaStream_t);                                         \
  prefix template void sums_of_squares<T>(const T*, const std::int64_t*, const std::int64_t*, std::size_t, double*,  \
                                          cudaStream_t);

#define LOOM_CUDA_KERNELS(prefix)             \
  LOOM_CUDA_KERNELS_FOR(prefix, float)        \
  LOOM_CUDA_KERNELS_FOR(prefix, double)       \
  LOOM_CUDA_KERNELS_FOR(prefix, ::loom::bf16) \
  LOOM_CUDA_KERNELS_FOR(prefix, ::loom::fp16)

#if defined(LOOM_EXTERN_CUDA_KERNELS)
namespace loom::kernels::cuda::entry {
LOOM_CUDA_KERNELS(extern)
}  // namespace loom::kernels::cuda::entry
#endif

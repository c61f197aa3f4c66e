// The definitions of <loom/kernels/cuda/entry.hpp>'s entry points, for nvcc: each forwards to its kernel in
// kernels::cuda. src/cuda_kernels_*.cu instantiates them once (loom::cuda_kernels); a source nvcc compiles without
// that library instantiates what it uses (header-only).
#pragma once

#include <loom/kernels/cuda/entry.hpp>
#include <loom/kernels/cuda/ops.cuh>

#include <cub/block/block_reduce.cuh>

#include <cstring>
#include <vector>

namespace loom::kernels::cuda {

namespace detail {

//! x[i] = value.
template <class T>
struct Fill {
  static constexpr int width = vec_width<T>;
  T* x;
  T value;
  template <int N>
  __device__ void apply(std::size_t i) const {
    Pack<T, N> p;
#pragma unroll
    for (int j = 0; j < N; ++j) p.v[j] = value;
    store_pack(x + i, p);
  }
};

//! dst[i] = src[i] converted (widened to the arithmetic type, or rounded back to storage).
template <class S, class D>
struct Convert {
  static constexpr int width = 1;
  const S* src;
  D* dst;
  template <int N>
  __device__ void apply(std::size_t i) const {
    if constexpr (std::is_same_v<D, acc_t<S>>) dst[i] = widen(src[i]);
    else dst[i] = narrow<D>(src[i]);
  }
};

//! y[i] += x[i] widened.
template <class T>
struct AccumulateWide {
  static constexpr int width = 1;
  const T* x;
  acc_t<T>* y;
  template <int N>
  __device__ void apply(std::size_t i) const {
    y[i] += widen(x[i]);
  }
};

//! Element i of a block of rows w wide: dst[r * ldd + e] = src[r * lds + e] rounded, r = i / w, e = i % w.
template <class S, class D>
struct NarrowRows {
  static constexpr int width = 1;
  const S* src;
  std::ptrdiff_t lds;
  D* dst;
  std::ptrdiff_t ldd;
  int w;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const std::ptrdiff_t r = static_cast<std::ptrdiff_t>(i / w), e = static_cast<std::ptrdiff_t>(i % w);
    dst[r * ldd + e] = narrow<D>(src[r * lds + e]);
  }
};

//! Element i of batches of rows x cols: dst[b][c][r] = src[b][r][c].
template <class U>
struct Transpose {
  static constexpr int width = 1;
  const U* src;
  U* dst;
  int rows, cols;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const std::size_t per = std::size_t(rows) * cols, b = i / per, r = i % per / cols, c = i % cols;
    dst[b * per + c * rows + r] = src[i];
  }
};

//! Row li = (b H + h) c + t of a log-sum-exp merge (Ops<Host>::lse_merge).
template <class T>
struct LseMerge {
  static constexpr int width = 1;
  using A = acc_t<T>;
  A* O;
  A* L;
  const T* Ob;
  const A* Lb;
  int H, c, D;
  std::ptrdiff_t ld;
  template <int N>
  __device__ void apply(std::size_t li) const {
    const int t = static_cast<int>(li % c), h = static_cast<int>(li / c % H), b = static_cast<int>(li / c / H);
    const A la = L[li], lb = Lb[li], m = max(la, lb);
    const A l = m + log_(exp_(la - m) + exp_(lb - m));
    const A wa = exp_(la - l), wb = exp_(lb - l);
    A* o = O + (std::ptrdiff_t(b) * c + t) * ld + std::ptrdiff_t(h) * D;
    const T* ob = Ob + (std::ptrdiff_t(b) * c + t) * ld + std::ptrdiff_t(h) * D;
    for (int d = 0; d < D; ++d) o[d] = o[d] * wa + widen(ob[d]) * wb;
    L[li] = l;
  }
};

//! Element i of n rows of d: dst row i from src row rows[i], times weights[i] where given.
template <class T>
struct GatherRows {
  static constexpr int width = 1;
  const T* src;
  const std::int32_t* rows;
  const T* weights;
  T* dst;
  int d;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const std::size_t r = i / d, c = i % d;
    const T x = src[std::size_t(rows[r]) * d + c];
    dst[i] = weights ? narrow<T>(widen(weights[r]) * widen(x)) : x;
  }
};
//! Element i of n rows of d: dst row rows[i / d] from src row i / d.
template <class T>
struct ScatterRows {
  static constexpr int width = 1;
  const T* src;
  const std::int32_t* rows;
  T* dst;
  int d;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const std::size_t r = i / d, c = i % d;
    dst[std::size_t(rows[r]) * d + c] = src[i];
  }
};
//! Element i of the tokens' rows: its token's slots added in order (weighted where weights are given).
template <class T>
struct CombineRows {
  static constexpr int width = 1;
  const T* src;
  const std::int32_t* slots;
  int k;
  const T* weights;
  T* dst;
  int d;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const std::size_t t = i / d, c = i % d;
    T y = dst[i];
    for (int m = 0; m < k; ++m) {
      const std::int32_t s = slots[t * k + m];
      if (s < 0) break;
      const T x = src[std::size_t(s) * d + c];
      const T term = weights ? narrow<T>(widen(weights[s]) * widen(x)) : x;  // rounded as the host's T product is
      y = narrow<T>(widen(y) + widen(term));
    }
    dst[i] = y;
  }
};
//! Row i's dot product, one thread per row, in double.
template <class T>
__global__ void row_dots_kernel(const T* a, const std::int32_t* rows, const T* b, double* out, std::size_t n, int d) {
  for (std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const T* x = a + std::size_t(rows[i]) * d;
    const T* y = b + i * d;
    double dot = 0;
    for (int c = 0; c < d; ++c) dot += static_cast<double>(widen(x[c])) * static_cast<double>(widen(y[c]));
    out[i] = dot;
  }
}

inline constexpr int sum_threads = 256;

//! partial[block] = the sum over the block's grid-stride share of f(x[i]), in double.
template <class T, bool Square>
__global__ void __launch_bounds__(sum_threads) sum_kernel(const T* x, std::size_t n, double* partial) {
  using Reduce = cub::BlockReduce<double, sum_threads>;
  __shared__ typename Reduce::TempStorage tmp;
  double s = 0;
  for (std::size_t i = std::size_t{blockIdx.x} * sum_threads + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * sum_threads) {
    const double v = static_cast<double>(widen(x[i]));
    s += Square ? v * v : v;
  }
  const double total = Reduce(tmp).Sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

//! Each piece's sum of x (or of its squares), x + at[i] over n[i] elements, into out[i] (host arrays): every
//! piece's per-block partials in one buffer, one copy and one wait for them all, then each piece's partials added
//! on the host in block order (the same bits however many pieces share the call).
template <bool Square, class T>
void device_sums(const T* x, const std::int64_t* at, const std::int64_t* n, std::size_t count, double* out,
                 cudaStream_t stream) {
  std::vector<unsigned> blocks(count, 0);
  std::size_t total = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (n[i] > 0) blocks[i] = grid_for(static_cast<std::size_t>(n[i]), sum_threads);
    total += blocks[i];
  }
  std::vector<double> host(total);
  if (total > 0) {
    CudaBuffer<double> partial(total, stream);
    std::size_t off = 0;
    for (std::size_t i = 0; i < count; ++i) {
      if (blocks[i] == 0) continue;
      sum_kernel<device_t<T>, Square><<<blocks[i], sum_threads, 0, stream>>>(dev(x) + at[i],
                                                                            static_cast<std::size_t>(n[i]),
                                                                            partial.data() + off);
      check_launch(Square ? "sum_squares" : "sum");
      off += blocks[i];
    }
    LOOM_CUDA(cudaMemcpyAsync(host.data(), partial.data(), total * sizeof(double), cudaMemcpyDeviceToHost, stream));
    LOOM_CUDA(cudaStreamSynchronize(stream));
  }
  std::size_t off = 0;
  for (std::size_t i = 0; i < count; ++i) {
    double s = 0;
    for (unsigned b = 0; b < blocks[i]; ++b) s += host[off + b];
    out[i] = s;
    off += blocks[i];
  }
}
//! The sum of x (or of its squares) over n elements, on `stream`, returned to the host.
template <bool Square, class T>
double device_sum(const T* x, std::size_t n, cudaStream_t stream) {
  const std::int64_t at = 0, len = static_cast<std::int64_t>(n);
  double out = 0;
  device_sums<Square>(x, &at, &len, 1, &out, stream);
  return out;
}

}  // namespace detail

namespace entry {

template <class T>
void matmul(const T* A, const T* B, T* C, int M, int N, int K, bool trans_a, bool trans_b, float alpha, float beta,
            cudaStream_t stream) {
  cuda::matmul(A, B, C, M, N, K, trans_a, trans_b, alpha, beta, stream);
}
template <class T>
void matmul_bias(const T* A, const T* B, const T* bias, T* C, int M, int N, int K, bool trans_a, bool trans_b,
                 cudaStream_t stream) {
  cuda::matmul_bias(A, B, bias, C, M, N, K, trans_a, trans_b, stream);
}
template <class T>
void matmul_residual(const T* A, const T* B, const T* bias, const T* R, T* C, int M, int N, int K, bool trans_a,
                     bool trans_b, cudaStream_t stream) {
  cuda::matmul_residual(A, B, bias, R, C, M, N, K, trans_a, trans_b, stream);
}
template <class T>
void matmul_bias_gelu(const T* A, const T* B, const T* bias, T* pre, T* C, int M, int N, int K, bool trans_a,
                      bool trans_b, cudaStream_t stream) {
  cuda::matmul_bias_gelu(A, B, bias, pre, C, M, N, K, trans_a, trans_b, stream);
}
template <class T>
void matmul_dgelu(const T* A, const T* B, const T* pre, T* C, int M, int N, int K, bool trans_a, bool trans_b,
                  cudaStream_t stream) {
  cuda::matmul_dgelu(A, B, pre, C, M, N, K, trans_a, trans_b, stream);
}
template <class T>
void matmul_ld(const T* A, std::ptrdiff_t lda, const T* B, std::ptrdiff_t ldb, T* C, std::ptrdiff_t ldc, int M, int N,
               int K, bool trans_a, bool trans_b, float alpha, float beta, cudaStream_t stream) {
  cuda::matmul_ld(A, lda, B, ldb, C, ldc, M, N, K, trans_a, trans_b, alpha, beta, stream);
}
template <class T>
void matmul_bgrad(const T* A, const T* B, T* C, T* dbias, int M, int N, int K, bool trans_a, float alpha, float beta,
                  cudaStream_t stream) {
  cuda::matmul_bgrad(A, B, C, dbias, M, N, K, trans_a, alpha, beta, stream);
}
template <class T>
void matmul_group(const Product<T>* ps, std::size_t count, bool trans_a, bool trans_b, float alpha, float beta,
                  cudaStream_t stream) {
  cuda::matmul_group(ps, count, trans_a, trans_b, alpha, beta, stream);
}
template <class T>
void bias_add(const T* x, const T* bias, T* out, int R, int C, cudaStream_t stream) {
  cuda::bias_add(x, bias, out, R, C, stream);
}
template <class T>
void bias_backward(const T* dout, T* dbias, int R, int C, cudaStream_t stream) {
  cuda::bias_backward(dout, dbias, R, C, stream);
}
template <class T>
void add(const T* a, const T* b, T* out, std::size_t n, cudaStream_t stream) {
  cuda::add(a, b, out, n, stream);
}
template <class T>
void accumulate(const T* x, T* y, std::size_t n, cudaStream_t stream) {
  cuda::accumulate(x, y, n, stream);
}
template <class T>
void gelu_forward(const T* x, T* out, std::size_t n, cudaStream_t stream) {
  cuda::gelu_forward(x, out, n, stream);
}
template <class T>
void gelu_backward(const T* x, const T* dout, T* dx, std::size_t n, cudaStream_t stream) {
  cuda::gelu_backward(x, dout, dx, n, stream);
}
template <class T>
void swiglu_forward(const T* h, T* out, int R, int F, cudaStream_t stream) {
  cuda::swiglu_forward(h, out, R, F, stream);
}
template <class T>
void swiglu_backward(const T* h, const T* dout, T* dh, int R, int F, cudaStream_t stream) {
  cuda::swiglu_backward(h, dout, dh, R, F, stream);
}
template <class T>
void rmsnorm_forward(const T* x, const T* w, T* out, acc<T>* rstd, int R, int C, double eps, cudaStream_t stream) {
  cuda::rmsnorm_forward(x, w, out, rstd, R, C, eps, stream);
}
template <class T>
void rmsnorm_backward_input(const T* dout, const T* x, const T* w, const acc<T>* rstd, T* dx, int R, int C,
                            const T* dres, cudaStream_t stream) {
  cuda::rmsnorm_backward_input(dout, x, w, rstd, dx, R, C, stream, dres);
}
template <class T>
void rmsnorm_backward_weight(const T* dout, const T* x, const acc<T>* rstd, T* dw, int R, int C,
                             cudaStream_t stream) {
  cuda::rmsnorm_backward_weight(dout, x, rstd, dw, R, C, stream);
}
template <class T>
void rope_rotate(T* x, const acc<T>* cos, const acc<T>* sin, int n, int ld, int heads, int hd, int t0, bool inverse,
                 cudaStream_t stream) {
  cuda::rope_rotate(x, cos, sin, n, ld, heads, hd, t0, inverse, stream);
}
template <class T>
void layernorm_forward(const T* x, const T* w, const T* b, T* out, acc<T>* mean, acc<T>* rstd, int R, int C,
                       double eps, cudaStream_t stream) {
  cuda::layernorm_forward(x, w, b, out, mean, rstd, R, C, eps, stream);
}
template <class T>
void layernorm_backward_input(const T* dout, const T* x, const T* w, const acc<T>* mean, const acc<T>* rstd, T* dx,
                              int R, int C, const T* dres, cudaStream_t stream) {
  cuda::layernorm_backward_input(dout, x, w, mean, rstd, dx, R, C, stream, dres);
}
template <class T>
void layernorm_backward_weight(const T* dout, const T* x, const acc<T>* mean, const acc<T>* rstd, T* dw, T* db,
                               int R, int C, cudaStream_t stream) {
  cuda::layernorm_backward_weight(dout, x, mean, rstd, dw, db, R, C, stream);
}
template <class T>
void ce_partials(const T* logits, acc<T>* row_max, acc<T>* row_sumexp, int R, int V_local, std::ptrdiff_t ld,
                 cudaStream_t stream) {
  cuda::ce_partials(logits, row_max, row_sumexp, R, V_local, ld, stream);
}
template <class T>
void ce_rescale(const acc<T>* local_max, const acc<T>* global_max, acc<T>* sumexp, int R, cudaStream_t stream) {
  cuda::ce_rescale<T>(local_max, global_max, sumexp, R, stream);
}
template <class T>
void ce_target_logit(const T* logits, const std::int32_t* targets, acc<T>* target_logit, int R, int V_local, int v0,
                     std::ptrdiff_t ld, cudaStream_t stream) {
  cuda::ce_target_logit(logits, targets, target_logit, R, V_local, v0, ld, stream);
}
template <class T>
void ce_losses(const acc<T>* row_max, const acc<T>* row_sumexp, const acc<T>* target_logit, T* losses, int R,
               cudaStream_t stream) {
  cuda::ce_losses<T>(row_max, row_sumexp, target_logit, losses, R, stream);
}
template <class T>
void ce_backward(const T* logits, const std::int32_t* targets, const acc<T>* row_max, const acc<T>* row_sumexp,
                 const T* dloss, T* dlogits, int R, int V_local, int v0, std::ptrdiff_t ld, cudaStream_t stream) {
  cuda::ce_backward(logits, targets, row_max, row_sumexp, dloss, dlogits, R, V_local, v0, ld, stream);
}
template <class T>
void ce_loss_grad(T* logits, const std::int32_t* targets, acc<T>* row_max, acc<T>* row_sumexp, T* losses, int R,
                  int V, std::ptrdiff_t ld, cudaStream_t stream) {
  cuda::ce_loss_grad(logits, targets, row_max, row_sumexp, losses, R, V, ld, stream);
}
template <class T>
void embedding_forward(const std::int32_t* ids, const T* table, T* out, int n, int C, int v0, int V_local,
                       cudaStream_t stream) {
  cuda::embedding_forward(ids, table, out, n, C, v0, V_local, stream);
}
template <class T>
void embedding_backward(const std::int32_t* ids, const T* dout, T* dtable, int n, int C, int v0, int V_local,
                        cudaStream_t stream) {
  cuda::embedding_backward(ids, dout, dtable, n, C, v0, V_local, stream);
}
template <class T>
void add_positions(const T* wpe, T* out, int B, int T_, int C, int t0, cudaStream_t stream) {
  cuda::add_positions(wpe, out, B, T_, C, t0, stream);
}
template <class T>
void positions_backward(const T* dout, T* dwpe, int B, int T_, int C, int t0, cudaStream_t stream) {
  cuda::positions_backward(dout, dwpe, B, T_, C, t0, stream);
}
template <class T>
void dropout_forward(const T* x, T* out, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0,
                     cudaStream_t stream) {
  cuda::dropout_forward(x, out, n, p, seed, index0, stream);
}
template <class T>
void dropout_backward(const T* dout, T* dx, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0,
                      cudaStream_t stream) {
  cuda::dropout_backward(dout, dx, n, p, seed, index0, stream);
}
template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, acc<T>* lse, const AttentionShape& s,
                       cudaStream_t stream) {
  cuda::attention_forward(q, k, v, out, lse, s, stream);
}
template <class T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const acc<T>* lse, T* dq,
                        T* dk, T* dv, const AttentionShape& s, cudaStream_t stream) {
  cuda::attention_backward(dout, q, k, v, out, lse, dq, dk, dv, s, stream);
}
template <class T>
void adamw_step(T* param, const T* grad, acc<T>* m, acc<T>* v, std::size_t n, double lr, double beta1, double beta2,
                double eps, double weight_decay, int t, acc<T>* master, cudaStream_t stream) {
  cuda::adamw_step(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, t, master, stream);
}
template <class T>
void adamw_runs(T* param, const T* grad, acc<T>* m, acc<T>* v, acc<T>* master, const UpdateRun* runs, std::size_t count,
                double lr, double beta1, double beta2, double eps, double weight_decay, int t, cudaStream_t stream) {
  cuda::adamw_runs(param, grad, m, v, master, runs, count, lr, beta1, beta2, eps, weight_decay, t, stream);
}
template <class T>
void sgd_step(T* param, const T* grad, acc<T>* buf, std::size_t n, double lr, double momentum, double weight_decay,
              bool first, acc<T>* master, cudaStream_t stream) {
  cuda::sgd_step(param, grad, buf, n, lr, momentum, weight_decay, first, master, stream);
}
template <class T>
void fill(T* x, std::size_t n, const T* value, cudaStream_t stream) {
  using D = device_t<T>;
  static_assert(sizeof(D) == sizeof(T), "loom: a device element has its host type's bytes");
  D v;
  std::memcpy(static_cast<void*>(&v), value, sizeof(T));
  detail::launch_map(detail::Fill<D>{detail::dev(x), v}, n, detail::vec_ok({x}), stream, "fill");
}
template <class T>
void scale(T* x, std::size_t n, acc<T> s, cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::Scale<D>{detail::dev(x), s}, n, detail::vec_ok({x}), stream, "scale");
}
template <class T>
void widen(const T* src, acc<T>* dst, std::size_t n, cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::Convert<D, acc<T>>{detail::dev(src), dst}, n, false, stream, "widen");
}
template <class T>
void narrow(const acc<T>* src, T* dst, std::size_t n, cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::Convert<acc<T>, D>{src, detail::dev(dst)}, n, false, stream, "narrow");
}
template <class T>
void accumulate_wide(const T* x, acc<T>* y, std::size_t n, cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::AccumulateWide<D>{detail::dev(x), y}, n, false, stream, "accumulate_wide");
}
template <class T>
void narrow_rows(const acc<T>* src, std::ptrdiff_t lds, T* dst, std::ptrdiff_t ldd, int rows, int w,
                 cudaStream_t stream) {
  using D = device_t<T>;
  if (rows <= 0 || w <= 0) return;
  detail::launch_map(detail::NarrowRows<acc<T>, D>{src, lds, detail::dev(dst), ldd, w},
                     std::size_t(rows) * std::size_t(w), false, stream, "narrow_rows");
}
template <class T>
void transpose(const acc<T>* src, acc<T>* dst, int batches, int rows, int cols, cudaStream_t stream) {
  const std::size_t n = std::size_t(batches) * rows * cols;
  if (n == 0) return;
  detail::launch_map(detail::Transpose<acc<T>>{src, dst, rows, cols}, n, false, stream, "transpose");
}
template <class T>
void lse_merge(acc<T>* O, acc<T>* L, const T* Ob, const acc<T>* Lb, int B, int H, int c, int D, std::ptrdiff_t ld,
               cudaStream_t stream) {
  using Dt = device_t<T>;
  detail::launch_map(detail::LseMerge<Dt>{O, L, detail::dev(Ob), Lb, H, c, D, ld}, std::size_t(B) * H * c, false,
                     stream, "lse_merge");
}
template <class T>
void gather_rows(const T* src, const std::int32_t* rows, const T* weights, T* dst, std::size_t n, int d,
                 cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::GatherRows<D>{detail::dev(src), rows, detail::dev(weights), detail::dev(dst), d},
                     n * std::size_t(d), false, stream, "gather_rows");
}
template <class T>
void scatter_rows(const T* src, const std::int32_t* rows, T* dst, std::size_t n, int d, cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::ScatterRows<D>{detail::dev(src), rows, detail::dev(dst), d}, n * std::size_t(d), false,
                     stream, "scatter_rows");
}
template <class T>
void combine_rows(const T* src, const std::int32_t* slots, int k, const T* weights, T* dst, std::size_t tokens, int d,
                  cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::CombineRows<D>{detail::dev(src), slots, k, detail::dev(weights), detail::dev(dst), d},
                     tokens * std::size_t(d), false, stream, "combine_rows");
}
template <class T>
void row_dots(const T* a, const std::int32_t* rows, const T* b, double* out, std::size_t n, int d,
              cudaStream_t stream) {
  if (n == 0) return;
  using D = device_t<T>;
  detail::row_dots_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(detail::dev(a), rows, detail::dev(b), out, n,
                                                                        d);
  detail::check_launch("row_dots");
}
template <class T>
double sum(const T* x, std::size_t n, cudaStream_t stream) {
  return detail::device_sum<false>(x, n, stream);
}
template <class T>
double sum_squares(const T* x, std::size_t n, cudaStream_t stream) {
  return detail::device_sum<true>(x, n, stream);
}
template <class T>
void sums_of_squares(const T* x, const std::int64_t* at, const std::int64_t* n, std::size_t count, double* out,
                     cudaStream_t stream) {
  detail::device_sums<true>(x, at, n, count, out, stream);
}

}  // namespace entry

}  // namespace loom::kernels::cuda

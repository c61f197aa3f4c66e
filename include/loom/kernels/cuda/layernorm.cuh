// Layer norm on the device: one warp per row held in registers where the row is at most 1024 aligned columns, else
// one block per row reducing with cub::BlockReduce; the weight gradients are column sums.
#pragma once

#include <loom/kernels/cuda/elementwise.cuh>

#include <cub/block/block_reduce.cuh>

namespace loom::kernels::cuda {

namespace detail {

template <class A>
struct Pair {
  A a, b;
  __host__ __device__ Pair operator+(const Pair& o) const { return {a + o.a, b + o.b}; }
};

template <class T, int Block>
__global__ void __launch_bounds__(Block) layernorm_forward_kernel(const T* x, const T* w, const T* b, T* out,
                                                                   acc_t<T>* mean, acc_t<T>* rstd, int C, double eps) {
  using A = acc_t<T>;
  using Reduce = cub::BlockReduce<A, Block>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ A s_mean, s_rstd;
  const std::size_t row = blockIdx.x;
  const T* xr = x + row * C;
  T* yr = out + row * C;
  A sum = 0;
  for (int c = threadIdx.x; c < C; c += Block) sum += widen(xr[c]);
  sum = Reduce(tmp).Sum(sum);
  if (threadIdx.x == 0) s_mean = sum / A(C);
  __syncthreads();  // also ends the first use of tmp before the second
  const A m = s_mean;
  A var = 0;
  for (int c = threadIdx.x; c < C; c += Block) {
    const A d = widen(xr[c]) - m;
    var += d * d;
  }
  var = Reduce(tmp).Sum(var);
  if (threadIdx.x == 0) {
    s_rstd = A(1) / sqrt_(var / A(C) + A(eps));
    mean[row] = m;
    rstd[row] = s_rstd;
  }
  __syncthreads();
  const A rs = s_rstd;
  for (int c = threadIdx.x; c < C; c += Block) yr[c] = narrow<T>((widen(xr[c]) - m) * rs * widen(w[c]) + widen(b[c]));
}

template <class T, int Block>
__global__ void __launch_bounds__(Block)
    layernorm_backward_input_kernel(const T* dout, const T* x, const T* w, const acc_t<T>* mean,
                                    const acc_t<T>* rstd, T* dx, int C, const T* dres) {
  using A = acc_t<T>;
  using Reduce = cub::BlockReduce<Pair<A>, Block>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ Pair<A> s_sums;
  const std::size_t row = blockIdx.x;
  const T* xr = x + row * C;
  const T* gr = dout + row * C;
  T* dr = dx + row * C;
  const A m = mean[row], rs = rstd[row];
  Pair<A> p{0, 0};
  for (int c = threadIdx.x; c < C; c += Block) {
    const A g = widen(gr[c]) * widen(w[c]);
    p.a += g;
    p.b += g * (widen(xr[c]) - m) * rs;
  }
  p = Reduce(tmp).Sum(p);
  if (threadIdx.x == 0) s_sums = p;
  __syncthreads();
  const A mean_g = s_sums.a / A(C), mean_gx = s_sums.b / A(C);
  for (int c = threadIdx.x; c < C; c += Block) {
    const A xhat = (widen(xr[c]) - m) * rs;
    const A g = widen(gr[c]) * widen(w[c]);
    dr[c] = with_residual(narrow<T>(rs * (g - mean_g - xhat * mean_gx)), dres, row * C + c);
  }
}

// Rows of up to warp_row_max columns whose packs of 16 bytes line up (the widths of GPT-2 and the like): one warp a
// row, the row kept in registers and read from memory once, the sums reduced with shuffles; no block barriers.
inline constexpr int warp_row_max = 1024;
inline constexpr int warp_rows_per_block = 4;

//! Whether rows of C columns at these addresses take the one-warp kernels.
template <class T>
bool warp_rows(int C, std::initializer_list<const void*> ptrs) {
  return C <= warp_row_max && C % vec_width<T> == 0 && vec_ok(ptrs);
}

template <class T>
__global__ void __launch_bounds__(32 * warp_rows_per_block)
    layernorm_forward_warp_kernel(const T* x, const T* w, const T* b, T* out, acc_t<T>* mean, acc_t<T>* rstd, int R,
                                  int C, double eps) {
  using A = acc_t<T>;
  constexpr int V = vec_width<T>, P = warp_row_max / (32 * V);  // packs a lane holds at most
  const int row = blockIdx.x * warp_rows_per_block + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= R) return;  // whole warps leave together
  const int packs = C / V;
  const T* xr = x + std::size_t(row) * C;
  A v[P][V];
  A sum = 0;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int p = i * 32 + lane;
    if (p >= packs) break;
    const auto xp = load_pack<V>(xr + p * V);
#pragma unroll
    for (int j = 0; j < V; ++j) sum += v[i][j] = widen(xp.v[j]);
  }
  const A m = group_sum<32>(sum) / A(C);
  A var = 0;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    if (i * 32 + lane >= packs) break;
#pragma unroll
    for (int j = 0; j < V; ++j) var += (v[i][j] - m) * (v[i][j] - m);
  }
  const A rs = A(1) / sqrt_(group_sum<32>(var) / A(C) + A(eps));
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
  T* yr = out + std::size_t(row) * C;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int p = i * 32 + lane;
    if (p >= packs) break;
    const auto wp = load_pack<V>(w + p * V), bp = load_pack<V>(b + p * V);
    Pack<T, V> y;
#pragma unroll
    for (int j = 0; j < V; ++j) y.v[j] = narrow<T>((v[i][j] - m) * rs * widen(wp.v[j]) + widen(bp.v[j]));
    store_pack(yr + p * V, y);
  }
}

template <class T>
__global__ void __launch_bounds__(32 * warp_rows_per_block)
    layernorm_backward_input_warp_kernel(const T* dout, const T* x, const T* w, const acc_t<T>* mean,
                                         const acc_t<T>* rstd, T* dx, int R, int C, const T* dres) {
  using A = acc_t<T>;
  constexpr int V = vec_width<T>, P = warp_row_max / (32 * V);
  const int row = blockIdx.x * warp_rows_per_block + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= R) return;
  const int packs = C / V;
  const std::size_t at = std::size_t(row) * C;
  const A m = mean[row], rs = rstd[row];
  A gw[P][V], xh[P][V];  // dout * w and the normalised input
  A sum_g = 0, sum_gx = 0;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int p = i * 32 + lane;
    if (p >= packs) break;
    const auto gp = load_pack<V>(dout + at + p * V), xp = load_pack<V>(x + at + p * V), wp = load_pack<V>(w + p * V);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      gw[i][j] = widen(gp.v[j]) * widen(wp.v[j]);
      xh[i][j] = (widen(xp.v[j]) - m) * rs;
      sum_g += gw[i][j];
      sum_gx += gw[i][j] * xh[i][j];
    }
  }
  const A mean_g = group_sum<32>(sum_g) / A(C), mean_gx = group_sum<32>(sum_gx) / A(C);
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int p = i * 32 + lane;
    if (p >= packs) break;
    Pack<T, V> d, r;
    if (dres != nullptr) r = load_pack<V>(dres + at + p * V);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      d.v[j] = narrow<T>(rs * (gw[i][j] - mean_g - xh[i][j] * mean_gx));
      if (dres != nullptr) d.v[j] = narrow<T>(add_rn(widen(r.v[j]), widen(d.v[j])));
    }
    store_pack(dx + at + p * V, d);
  }
}

template <class T>
struct LayernormWeight {
  using acc = acc_t<T>;
  static constexpr int outputs = 2;
  const T* dout;
  const T* x;
  const acc* mean;
  const acc* rstd;
  T* dw;
  T* db;
  int C;
  __device__ void add(int r, int c, acc (&a)[2]) const {
    const std::size_t i = std::size_t(r) * C + c;
    const acc g = widen(dout[i]);
    a[0] += g * (widen(x[i]) - mean[r]) * rstd[r];
    a[1] += g;
  }
  __device__ void finish(int c, const acc (&s)[2]) const {
    dw[c] = narrow<T>(widen(dw[c]) + s[0]);
    db[c] = narrow<T>(widen(db[c]) + s[1]);
  }
};

//! Calls f(std::integral_constant<int, Block>) with the block size for rows of C columns.
template <class F>
void with_row_block(int C, F&& f) {
  if (C <= 1024) f(std::integral_constant<int, 128>{});
  else if (C <= 4096) f(std::integral_constant<int, 256>{});
  else f(std::integral_constant<int, 512>{});
}

}  // namespace detail

//! out[r] = (x[r] - mean) * rstd * w + b over C columns; mean[r] and rstd[r] are kept for backward.
template <Floating T>
void layernorm_forward(const T* x, const T* w, const T* b, T* out, acc_t<T>* mean, acc_t<T>* rstd, int R, int C,
                       double eps, cudaStream_t stream) {
  if (R <= 0) return;
  using D = device_t<T>;
  if (detail::warp_rows<D>(C, {x, w, b, out})) {
    detail::layernorm_forward_warp_kernel<D>
        <<<(R + detail::warp_rows_per_block - 1) / detail::warp_rows_per_block, 32 * detail::warp_rows_per_block, 0,
           stream>>>(detail::dev(x), detail::dev(w), detail::dev(b), detail::dev(out), mean, rstd, R, C, eps);
  } else {
    detail::with_row_block(C, [&](auto block) {
      detail::layernorm_forward_kernel<D, block()><<<R, block(), 0, stream>>>(
          detail::dev(x), detail::dev(w), detail::dev(b), detail::dev(out), mean, rstd, C, eps);
    });
  }
  detail::check_launch("layernorm_forward");
}
//! With the CPU's default eps = 1e-5.
template <Floating T>
void layernorm_forward(const T* x, const T* w, const T* b, T* out, acc_t<T>* mean, acc_t<T>* rstd, int R, int C,
                       cudaStream_t stream) {
  layernorm_forward(x, w, b, out, mean, rstd, R, C, 1e-5, stream);
}

//! dx = gradient of the input (written); with dres, dx = dres + that gradient rounded to T (what a separate
//! accumulate of it gives, one pass fewer); dres may be dx.
template <Floating T>
void layernorm_backward_input(const T* dout, const T* x, const T* w, const acc_t<T>* mean, const acc_t<T>* rstd,
                              T* dx, int R, int C, cudaStream_t stream, const T* dres = nullptr) {
  if (R <= 0) return;
  using D = device_t<T>;
  if (detail::warp_rows<D>(C, {dout, x, w, dx, dres})) {
    detail::layernorm_backward_input_warp_kernel<D>
        <<<(R + detail::warp_rows_per_block - 1) / detail::warp_rows_per_block, 32 * detail::warp_rows_per_block, 0,
           stream>>>(detail::dev(dout), detail::dev(x), detail::dev(w), mean, rstd, detail::dev(dx), R, C,
                     detail::dev(dres));
  } else {
    detail::with_row_block(C, [&](auto block) {
      detail::layernorm_backward_input_kernel<D, block()><<<R, block(), 0, stream>>>(
          detail::dev(dout), detail::dev(x), detail::dev(w), mean, rstd, detail::dev(dx), C, detail::dev(dres));
    });
  }
  detail::check_launch("layernorm_backward_input");
}

//! dw += sum_r dout * xhat, db += sum_r dout (fixed summation order).
template <Floating T>
void layernorm_backward_weight(const T* dout, const T* x, const acc_t<T>* mean, const acc_t<T>* rstd, T* dw, T* db,
                               int R, int C, cudaStream_t stream) {
  detail::column_sums(detail::LayernormWeight<device_t<T>>{detail::dev(dout), detail::dev(x), mean, rstd,
                                                           detail::dev(dw), detail::dev(db), C},
                      R, C, stream, "layernorm_backward_weight");
}

}  // namespace loom::kernels::cuda

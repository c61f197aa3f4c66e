// Layer norm on the device: one block per row reduces with cub::BlockReduce; the weight gradients are column sums.
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
                                    const acc_t<T>* rstd, T* dx, int C) {
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
    dr[c] = narrow<T>(rs * (g - mean_g - xhat * mean_gx));
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
  detail::with_row_block(C, [&](auto block) {
    detail::layernorm_forward_kernel<device_t<T>, block()><<<R, block(), 0, stream>>>(
        detail::dev(x), detail::dev(w), detail::dev(b), detail::dev(out), mean, rstd, C, eps);
  });
  detail::check_launch("layernorm_forward");
}
//! With the CPU's default eps = 1e-5.
template <Floating T>
void layernorm_forward(const T* x, const T* w, const T* b, T* out, acc_t<T>* mean, acc_t<T>* rstd, int R, int C,
                       cudaStream_t stream) {
  layernorm_forward(x, w, b, out, mean, rstd, R, C, 1e-5, stream);
}

//! dx = gradient of the input (written).
template <Floating T>
void layernorm_backward_input(const T* dout, const T* x, const T* w, const acc_t<T>* mean, const acc_t<T>* rstd,
                              T* dx, int R, int C, cudaStream_t stream) {
  if (R <= 0) return;
  detail::with_row_block(C, [&](auto block) {
    detail::layernorm_backward_input_kernel<device_t<T>, block()><<<R, block(), 0, stream>>>(
        detail::dev(dout), detail::dev(x), detail::dev(w), mean, rstd, detail::dev(dx), C);
  });
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

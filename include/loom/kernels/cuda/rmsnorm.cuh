// RMS norm on the device (Llama's): one block per row reduces the sum of squares with cub::BlockReduce; the weight
// gradient is a column sum in a fixed order.
#pragma once

#include <loom/kernels/cuda/elementwise.cuh>
#include <loom/kernels/cuda/layernorm.cuh>

#include <cub/block/block_reduce.cuh>

namespace loom::kernels::cuda {

namespace detail {

template <class T, int Block>
__global__ void __launch_bounds__(Block)
    rmsnorm_forward_kernel(const T* x, const T* w, T* out, acc_t<T>* rstd, int C, double eps) {
  using A = acc_t<T>;
  using Reduce = cub::BlockReduce<A, Block>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ A s_rstd;
  const std::size_t row = blockIdx.x;
  const T* xr = x + row * C;
  T* yr = out + row * C;
  A sq = 0;
  for (int c = threadIdx.x; c < C; c += Block) sq += widen(xr[c]) * widen(xr[c]);
  sq = Reduce(tmp).Sum(sq);
  if (threadIdx.x == 0) {
    s_rstd = A(1) / sqrt_(sq / A(C) + A(eps));
    rstd[row] = s_rstd;
  }
  __syncthreads();
  const A rs = s_rstd;
  for (int c = threadIdx.x; c < C; c += Block) yr[c] = narrow<T>(widen(xr[c]) * rs * widen(w[c]));
}

template <class T, int Block>
__global__ void __launch_bounds__(Block)
    rmsnorm_backward_input_kernel(const T* dout, const T* x, const T* w, const acc_t<T>* rstd, T* dx, int C,
                                  const T* dres) {
  using A = acc_t<T>;
  using Reduce = cub::BlockReduce<A, Block>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ A s_gx;
  const std::size_t row = blockIdx.x;
  const T* xr = x + row * C;
  const T* gr = dout + row * C;
  T* dr = dx + row * C;
  const A rs = rstd[row];
  A gx = 0;
  for (int c = threadIdx.x; c < C; c += Block) gx += widen(gr[c]) * widen(w[c]) * widen(xr[c]);
  gx = Reduce(tmp).Sum(gx);
  if (threadIdx.x == 0) s_gx = gx / A(C);
  __syncthreads();
  const A k = rs * rs * s_gx;
  for (int c = threadIdx.x; c < C; c += Block)
    dr[c] = with_residual(narrow<T>(rs * (widen(gr[c]) * widen(w[c]) - widen(xr[c]) * k)), dres, row * C + c);
}

template <class T>
struct RmsnormWeight {
  using acc = acc_t<T>;
  static constexpr int outputs = 1;
  const T* dout;
  const T* x;
  const acc* rstd;
  T* dw;
  int C;
  __device__ void add(int r, int c, acc (&a)[1]) const {
    const std::size_t i = std::size_t(r) * C + c;
    a[0] += widen(dout[i]) * widen(x[i]) * rstd[r];
  }
  __device__ void finish(int c, const acc (&s)[1]) const { dw[c] = narrow<T>(widen(dw[c]) + s[0]); }
};

}  // namespace detail

//! out[r] = x[r] * rstd * w over C columns, rstd = (mean of x[r]^2 + eps)^-1/2, kept for backward.
template <Floating T>
void rmsnorm_forward(const T* x, const T* w, T* out, acc_t<T>* rstd, int R, int C, double eps,
                     cudaStream_t stream) {
  if (R <= 0) return;
  detail::with_row_block(C, [&](auto block) {
    detail::rmsnorm_forward_kernel<device_t<T>, block()>
        <<<R, block(), 0, stream>>>(detail::dev(x), detail::dev(w), detail::dev(out), rstd, C, eps);
  });
  detail::check_launch("rmsnorm_forward");
}

//! dx = gradient of the input (written); with dres, dx = dres + it, as layernorm_backward_input.
template <Floating T>
void rmsnorm_backward_input(const T* dout, const T* x, const T* w, const acc_t<T>* rstd, T* dx, int R, int C,
                            cudaStream_t stream, const T* dres = nullptr) {
  if (R <= 0) return;
  detail::with_row_block(C, [&](auto block) {
    detail::rmsnorm_backward_input_kernel<device_t<T>, block()><<<R, block(), 0, stream>>>(
        detail::dev(dout), detail::dev(x), detail::dev(w), rstd, detail::dev(dx), C, detail::dev(dres));
  });
  detail::check_launch("rmsnorm_backward_input");
}

//! dw += sum_r dout * x * rstd (fixed summation order).
template <Floating T>
void rmsnorm_backward_weight(const T* dout, const T* x, const acc_t<T>* rstd, T* dw, int R, int C,
                             cudaStream_t stream) {
  detail::column_sums(detail::RmsnormWeight<device_t<T>>{detail::dev(dout), detail::dev(x), rstd, detail::dev(dw), C},
                      R, C, stream, "rmsnorm_backward_weight");
}

}  // namespace loom::kernels::cuda

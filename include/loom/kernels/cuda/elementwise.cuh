// Element-wise operations on the device (bias, sums, GELU, SwiGLU) and the deterministic column sums that bias and
// layer-norm weight gradients reduce with.
#pragma once

#include <loom/kernels/cuda/device.cuh>

namespace loom::kernels::cuda {

namespace detail {

// --- column sums: out[c] (+)= sum over r of f(r, c), in a fixed order (no atomics) -------------------------------
// Phase 1: blocks of 32 columns x 8 row lanes sum a chunk of rows each; with one chunk they finish directly,
// otherwise phase 2 adds the chunks' partials column by column.

inline constexpr int colsum_cols = 32, colsum_lanes = 8;

template <class Op>
__global__ void __launch_bounds__(colsum_cols* colsum_lanes)
    colsum_partial_kernel(Op op, int R, int C, int rows_per_chunk, typename Op::acc* partial) {
  using A = typename Op::acc;
  constexpr int K = Op::outputs;
  __shared__ A sh[K][colsum_lanes][colsum_cols + 1];
  const int tx = threadIdx.x % colsum_cols, ty = threadIdx.x / colsum_cols;
  const int c = blockIdx.x * colsum_cols + tx;
  const int r0 = blockIdx.y * rows_per_chunk, r1 = min(R, r0 + rows_per_chunk);
  A acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = A(0);
  if (c < C) {
#pragma unroll 4
    for (int r = r0 + ty; r < r1; r += colsum_lanes) op.add(r, c, acc);  // four rows' loads in flight
  }
#pragma unroll
  for (int k = 0; k < K; ++k) sh[k][ty][tx] = acc[k];
  __syncthreads();
  if (ty != 0 || c >= C) return;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    A s = sh[k][0][tx];
    for (int y = 1; y < colsum_lanes; ++y) s += sh[k][y][tx];
    acc[k] = s;
  }
  if (partial == nullptr) {
    op.finish(c, acc);
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) partial[(std::size_t(blockIdx.y) * K + k) * C + c] = acc[k];
  }
}

template <class Op>
__global__ void colsum_finish_kernel(Op op, int C, int chunks, const typename Op::acc* partial) {
  using A = typename Op::acc;
  constexpr int K = Op::outputs;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  A acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    A s = A(0);
    for (int ch = 0; ch < chunks; ++ch) s += partial[(std::size_t(ch) * K + k) * C + c];
    acc[k] = s;
  }
  op.finish(c, acc);
}

//! Op: `acc` type, `outputs` (K), add(r, c, A (&acc)[K]) and finish(c, const A (&sums)[K]).
template <class Op>
void column_sums(const Op& op, int R, int C, cudaStream_t stream, const char* name) {
  using A = typename Op::acc;
  if (R <= 0 || C <= 0) return;
  const int col_blocks = (C + colsum_cols - 1) / colsum_cols;
  // Eight blocks (64 warps of loads) per multiprocessor where the rows allow it, at least 32 rows per chunk: the
  // sums are bound by memory, and a narrow matrix (a bias of 768 columns) has few column blocks to spread.
  const int max_chunks = std::max(1, (R + 31) / 32);
  int chunks = std::clamp((8 * multiprocessors() + col_blocks - 1) / col_blocks, 1, max_chunks);
  chunks = std::min(chunks, 65535);
  const int rows_per_chunk = (R + chunks - 1) / chunks;
  chunks = (R + rows_per_chunk - 1) / rows_per_chunk;
  const dim3 grid(col_blocks, chunks);
  if (chunks == 1) {
    colsum_partial_kernel<<<grid, colsum_cols * colsum_lanes, 0, stream>>>(op, R, C, rows_per_chunk, nullptr);
    check_launch(name);
    return;
  }
  CudaBuffer<A> partial(std::size_t(chunks) * Op::outputs * C, stream);
  colsum_partial_kernel<<<grid, colsum_cols * colsum_lanes, 0, stream>>>(op, R, C, rows_per_chunk, partial.data());
  check_launch(name);
  colsum_finish_kernel<<<(C + 255) / 256, 256, 0, stream>>>(op, C, chunks, partial.data());
  check_launch(name);
}

// --- element-wise operations -------------------------------------------------------------------------------------

template <class T>
struct BiasAdd {
  static constexpr int width = vec_width<T>;
  const T* x;
  const T* bias;
  T* out;
  int C;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const int c = static_cast<int>(i % C);  // a pack never crosses a row: C % N == 0 when N > 1
    const auto a = load_pack<N>(x + i);
    const auto b = load_pack<N>(bias + c);
    Pack<T, N> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = narrow<T>(widen(a.v[j]) + widen(b.v[j]));
    store_pack(out + i, r);
  }
};

template <class T>
struct BiasBackward {
  using acc = acc_t<T>;
  static constexpr int outputs = 1;
  const T* dout;
  T* dbias;
  int C;
  __device__ void add(int r, int c, acc (&a)[1]) const { a[0] += widen(dout[std::size_t(r) * C + c]); }
  __device__ void finish(int c, const acc (&s)[1]) const { dbias[c] = narrow<T>(widen(dbias[c]) + s[0]); }
};

template <class T>
struct Add {
  static constexpr int width = vec_width<T>;
  const T* a;
  const T* b;
  T* out;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const auto x = load_pack<N>(a + i);
    const auto y = load_pack<N>(b + i);
    Pack<T, N> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = narrow<T>(widen(x.v[j]) + widen(y.v[j]));
    store_pack(out + i, r);
  }
};

template <class A>
__device__ __forceinline__ A gelu(A x) {
  const A k = A(0.7978845608028654), c = A(0.044715);
  return A(0.5) * x * (A(1) + tanh_(k * (x + c * x * x * x)));
}
template <class A>
__device__ __forceinline__ A gelu_grad(A x) {
  const A k = A(0.7978845608028654), c = A(0.044715);
  const A th = tanh_(k * (x + c * x * x * x));
  return A(0.5) * (A(1) + th) + A(0.5) * x * (A(1) - th * th) * k * (A(1) + A(3) * c * x * x);
}

template <class T>
struct GeluForward {
  static constexpr int width = vec_width<T>;
  const T* x;
  T* out;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const auto a = load_pack<N>(x + i);
    Pack<T, N> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = narrow<T>(gelu(widen(a.v[j])));
    store_pack(out + i, r);
  }
};

template <class T>
struct GeluBackward {
  static constexpr int width = vec_width<T>;
  const T* x;
  const T* dout;
  T* dx;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const auto a = load_pack<N>(x + i);
    const auto g = load_pack<N>(dout + i);
    Pack<T, N> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = narrow<T>(widen(g.v[j]) * gelu_grad(widen(a.v[j])));
    store_pack(dx + i, r);
  }
};

//! SwiGLU on rows [gate | up] of 2F: out = silu(gate) up; N elements at a time where F is a multiple of N (a pack
//! never crosses a row).
template <class T>
struct SwigluForward {
  static constexpr int width = vec_width<T>;
  const T* h;
  T* out;
  int F;
  template <int N>
  __device__ void apply(std::size_t i) const {
    using A = acc_t<T>;
    const std::size_t r = i / F, c = i % F;
    const auto g = load_pack<N>(h + r * 2 * F + c), u = load_pack<N>(h + r * 2 * F + F + c);
    Pack<T, N> y;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const A x = widen(g.v[j]);
      y.v[j] = narrow<T>(x / (A(1) + exp_(-x)) * widen(u.v[j]));
    }
    store_pack(out + i, y);
  }
};
template <class T>
struct SwigluBackward {
  static constexpr int width = vec_width<T>;
  const T* h;
  const T* dout;
  T* dh;
  int F;
  template <int N>
  __device__ void apply(std::size_t i) const {
    using A = acc_t<T>;
    const std::size_t r = i / F, c = i % F;
    const auto g = load_pack<N>(h + r * 2 * F + c), u = load_pack<N>(h + r * 2 * F + F + c);
    const auto dy = load_pack<N>(dout + i);
    Pack<T, N> dg, du;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const A x = widen(g.v[j]), up = widen(u.v[j]), d = widen(dy.v[j]);
      const A sig = A(1) / (A(1) + exp_(-x));
      dg.v[j] = narrow<T>(d * up * sig * (A(1) + x * (A(1) - sig)));
      du.v[j] = narrow<T>(d * x * sig);
    }
    store_pack(dh + r * 2 * F + c, dg);
    store_pack(dh + r * 2 * F + F + c, du);
  }
};
//! x *= s over n elements (a product with K = 0 is beta * C).
template <class T>
struct Scale {
  static constexpr int width = vec_width<T>;
  T* x;
  acc_t<T> s;
  template <int N>
  __device__ void apply(std::size_t i) const {
    auto a = load_pack<N>(x + i);
#pragma unroll
    for (int j = 0; j < N; ++j) a.v[j] = narrow<T>(widen(a.v[j]) * s);  // as the host: NaN * 0 stays NaN
    store_pack(x + i, a);
  }
};

}  // namespace detail

//! out[r, c] = x[r, c] + bias[c] for R rows of C columns; out may be x.
template <Floating T>
void bias_add(const T* x, const T* bias, T* out, int R, int C, cudaStream_t stream) {
  using D = device_t<T>;
  const bool vec = C % detail::vec_width<D> == 0 && detail::vec_ok({x, bias, out});
  detail::launch_map(detail::BiasAdd<D>{detail::dev(x), detail::dev(bias), detail::dev(out), C},
                     std::size_t(R) * C, vec, stream, "bias_add");
}

//! dbias[c] += sum over r of dout[r, c] (fixed summation order: the same bits run to run).
template <Floating T>
void bias_backward(const T* dout, T* dbias, int R, int C, cudaStream_t stream) {
  detail::column_sums(detail::BiasBackward<device_t<T>>{detail::dev(dout), detail::dev(dbias), C}, R, C, stream,
                      "bias_backward");
}

//! out = a + b over n elements; out may be a or b.
template <Floating T>
void add(const T* a, const T* b, T* out, std::size_t n, cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::Add<D>{detail::dev(a), detail::dev(b), detail::dev(out)}, n,
                     detail::vec_ok({a, b, out}), stream, "add");
}

//! y += x over n elements.
template <Floating T>
void accumulate(const T* x, T* y, std::size_t n, cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::Add<D>{detail::dev(x), detail::dev(y), detail::dev(y)}, n,
                     detail::vec_ok({x, y}), stream, "accumulate");
}

//! out = GELU(x), tanh form.
template <Floating T>
void gelu_forward(const T* x, T* out, std::size_t n, cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::GeluForward<D>{detail::dev(x), detail::dev(out)}, n, detail::vec_ok({x, out}),
                     stream, "gelu_forward");
}

//! dx = dout * GELU'(x); dx may be dout.
template <Floating T>
void gelu_backward(const T* x, const T* dout, T* dx, std::size_t n, cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::GeluBackward<D>{detail::dev(x), detail::dev(dout), detail::dev(dx)}, n,
                     detail::vec_ok({x, dout, dx}), stream, "gelu_backward");
}

//! out[r, c] = silu(h[r, c]) h[r, F + c] for R rows of [gate | up] (2F columns), as kernels::cpu::swiglu_forward.
template <Floating T>
void swiglu_forward(const T* h, T* out, int R, int F, cudaStream_t stream) {
  using D = device_t<T>;
  const bool vec = F % detail::vec_width<D> == 0 && detail::vec_ok({h, out});
  detail::launch_map(detail::SwigluForward<D>{detail::dev(h), detail::dev(out), F}, std::size_t(R) * F, vec, stream,
                     "swiglu_forward");
}
//! dh (R x 2F, written) from dout (R x F).
template <Floating T>
void swiglu_backward(const T* h, const T* dout, T* dh, int R, int F, cudaStream_t stream) {
  using D = device_t<T>;
  const bool vec = F % detail::vec_width<D> == 0 && detail::vec_ok({h, dout, dh});
  detail::launch_map(detail::SwigluBackward<D>{detail::dev(h), detail::dev(dout), detail::dev(dh), F},
                     std::size_t(R) * F, vec, stream, "swiglu_backward");
}

}  // namespace loom::kernels::cuda

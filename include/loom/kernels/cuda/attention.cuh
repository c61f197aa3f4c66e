// Attention on the device, FlashAttention-2 style: a block holds a tile of queries (or keys) in shared memory and
// streams the other side through in tiles, with an online softmax; the T x Tk matrix is never formed and the per-row
// log-sum-exp is kept for backward. Causal self-attention (Tk = T, query t sees keys 0..t), or a block of Tk keys
// that every query sees (causal = false: ring attention's blocks of another rank's keys). GQA/MQA: query head h
// reads key/value head h / (Hq / Hkv).
//
// bf16 and fp16 with head size 64 or 128 run the register-resident kernels of attention_mma.cuh (mma.sync, every
// accumulator in registers). The other cases' tile products go through a policy: Wmma (bf16/fp16 with D a multiple
// of 16: tensor cores through WMMA, 64 x 64 tiles, fp32 accumulation) or Simt (float, double, and the other head
// sizes: plain FMAs in the accumulation type). Both keep accumulators in shared memory, so the softmax and the
// masks are written once for both.
// Backward is deterministic: one kernel per key tile sums dK and dV over the query tiles (and, for GQA, the query
// heads of its group), another per query tile sums dQ over the key tiles; no atomics.
#pragma once

#include <loom/kernels/cuda/attention_mma.cuh>
#include <loom/kernels/cuda/device.cuh>

#include <mma.h>

#include <cstdlib>
#include <string_view>

namespace loom::kernels::cuda {

namespace detail::attn {

//! FMAs in the accumulation type; operand tiles are kept widened.
template <class T>
struct Simt {
  using A = acc_t<T>;
  using S = A;  //!< element type of operand tiles in shared memory
  static constexpr int tile = std::is_same_v<A, double> ? 16 : 32;  //!< queries and keys per tile
  static constexpr int threads = 256;
  static constexpr int pad_s = 1, pad_f = 1;  //!< row padding of operand and accumulator tiles (odd strides)

  //! C[M x N] (+)= A[M x K] * B, with B stored K x N, or N x K when TransB.
  template <bool TransB, bool Accumulate>
  __device__ static void gemm(const S* a, int lda, const S* b, int ldb, A* c, int ldc, int M, int N, int K) {
    for (int e = threadIdx.x; e < M * N; e += threads) {
      const int m = e / N, n = e % N;
      A sum = Accumulate ? c[m * ldc + n] : A(0);
      const S* ar = a + m * lda;
      if constexpr (TransB) {
        const S* br = b + n * ldb;
        for (int k = 0; k < K; ++k) sum += ar[k] * br[k];
      } else {
        for (int k = 0; k < K; ++k) sum += ar[k] * b[k * ldb + n];
      }
      c[m * ldc + n] = sum;
    }
  }
};

//! Tensor cores through WMMA (16 x 16 x 16, fp32 accumulators); warp w computes rows [16w, 16w + 16).
template <class T>
struct Wmma {
  using A = float;
  using S = T;
  static constexpr int tile = 64;
  static constexpr int threads = 128;  // 4 warps x 16 rows = one tile
  static constexpr int pad_s = 8, pad_f = 4;  // strides stay multiples of 16 bytes, as WMMA needs; fewer conflicts

  template <bool TransB, bool Accumulate>
  __device__ static void gemm(const S* a, int lda, const S* b, int ldb, A* c, int ldc, int M, int N, int K) {
    using namespace nvcuda;
    (void)M;  // always `tile`: one 16-row strip per warp
    const int row0 = (threadIdx.x / 32) * 16;
    for (int n0 = 0; n0 < N; n0 += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      if constexpr (Accumulate) wmma::load_matrix_sync(acc, c + row0 * ldc + n0, ldc, wmma::mem_row_major);
      else wmma::fill_fragment(acc, 0.0f);
      for (int k0 = 0; k0 < K; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, a + row0 * lda + k0, lda);
        if constexpr (TransB) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;  // (k, n) at b[n * ldb + k]
          wmma::load_matrix_sync(fb, b + n0 * ldb + k0, ldb);
          wmma::mma_sync(acc, fa, fb, acc);
        } else {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
          wmma::load_matrix_sync(fb, b + k0 * ldb + n0, ldb);
          wmma::mma_sync(acc, fa, fb, acc);
        }
      }
      wmma::store_matrix_sync(c + row0 * ldc + n0, acc, ldc, wmma::mem_row_major);
    }
  }
};

//! Carves dynamic shared memory into regions that start on 128 bytes; the same code sizes it on the host.
struct Carve {
  std::size_t bytes = 0;
  template <class X>
  __host__ __device__ std::size_t take(std::size_t n) {
    bytes = (bytes + 127) / 128 * 128;
    const std::size_t at = bytes;
    bytes += n * sizeof(X);
    return at;
  }
};

//! Row strides of the tiles for head size D.
template <class P>
struct Strides {
  int s, st, f, o;  //!< operand D wide, operand tile wide, accumulator tile wide, accumulator D wide
  __host__ __device__ explicit Strides(int D)
      : s(D + P::pad_s), st(P::tile + P::pad_s), f(P::tile + P::pad_f), o(D + P::pad_f) {}
};

template <class P>
struct ForwardSmem {
  using S = typename P::S;
  using A = typename P::A;
  Strides<P> ld;
  std::size_t q, k, v, s, p, o, row, bytes;
  __host__ __device__ explicit ForwardSmem(int D) : ld(D) {
    constexpr int n = P::tile;
    Carve c;
    q = c.take<S>(n * ld.s);
    k = c.take<S>(n * ld.s);
    v = c.take<S>(n * ld.s);
    s = c.take<A>(n * ld.f);
    p = c.take<S>(n * ld.st);
    o = c.take<A>(n * ld.o);
    row = c.take<A>(2 * n);
    bytes = c.bytes;
  }
};

template <class P>
struct BackwardSmem {  // both backward kernels: four operand tiles, two score tiles, two probability tiles, two
                       // accumulators (dK and dV, or dQ alone), and per-row lse and delta
  using S = typename P::S;
  using A = typename P::A;
  Strides<P> ld;
  std::size_t x0, x1, y0, y1, s, dp, p, ds, acc0, acc1, lse, delta, bytes;
  __host__ __device__ BackwardSmem(int D, bool two_accumulators) : ld(D) {
    constexpr int n = P::tile;
    Carve c;
    x0 = c.take<S>(n * ld.s);
    x1 = c.take<S>(n * ld.s);
    y0 = c.take<S>(n * ld.s);
    y1 = c.take<S>(n * ld.s);
    s = c.take<A>(n * ld.f);
    dp = c.take<A>(n * ld.f);
    p = c.take<S>(n * ld.st);
    ds = c.take<S>(n * ld.st);
    acc0 = c.take<A>(n * ld.o);
    acc1 = two_accumulators ? c.take<A>(n * ld.o) : acc0;
    lse = c.take<A>(n);
    delta = c.take<A>(n);
    bytes = c.bytes;
  }
};

template <class X>
__device__ __forceinline__ X* at(unsigned char* base, std::size_t offset) {
  return reinterpret_cast<X*>(base + offset);
}


//! `tile` rows of D elements from global memory into shared memory (load_rows).
template <class P, class T>
__device__ void load_tile(typename P::S* dst, int lds, const T* src, std::ptrdiff_t ld, int valid, int D) {
  load_rows<P>(dst, lds, src, ld, P::tile, valid, D);
}

template <class A>
__device__ void zero_tile(A* dst, int lds, int rows, int cols, int threads) {
  for (int e = threadIdx.x; e < rows * cols; e += threads) dst[(e / cols) * lds + e % cols] = A(0);
}

// --- forward -----------------------------------------------------------------------------------------------------

template <class P, class T>
__global__ void __launch_bounds__(P::threads)
    forward_kernel(const T* q, const T* k, const T* v, T* out, acc_t<T>* lse, AttentionShape s) {
  using S = typename P::S;
  using A = typename P::A;
  constexpr int n = P::tile, G = P::threads / n;  // G threads share a query row in the softmax
  extern __shared__ __align__(128) unsigned char smem[];
  const int D = s.D;
  const ForwardSmem<P> L(D);
  S* Qs = at<S>(smem, L.q);
  S* Ks = at<S>(smem, L.k);
  S* Vs = at<S>(smem, L.v);
  A* Sf = at<A>(smem, L.s);
  S* Ps = at<S>(smem, L.p);
  A* Of = at<A>(smem, L.o);
  A* row_inv = at<A>(smem, L.row);  // 1 / l per row, then lse per row
  A* row_lse = row_inv + n;

  const int qb = gridDim.x - 1 - blockIdx.x;  // the last query tiles have the most keys: start them first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (s.Hq / s.Hkv);
  const int q0 = qb * n, q_valid = min(n, s.T - q0);
  load_tile<P>(Qs, L.ld.s, q + (std::size_t(b) * s.T + q0) * s.ldq + std::size_t(h) * D, s.ldq, q_valid, D);
  zero_tile(Of, L.ld.o, n, D, P::threads);

  const int r = threadIdx.x / G, g = threadIdx.x % G, t = q0 + r;
  const A scale = A(s.scale);
  A m_i = neg_inf<A>(), l_i = A(0);
  const int Tk = s.Tk < 0 ? s.T : s.Tk;  // s.keys(), a host function
  const int key_tiles = s.causal ? (min(s.T, q0 + n) - 1) / n + 1 : (Tk + n - 1) / n;
  for (int kb = 0; kb < key_tiles; ++kb) {
    const int k0 = kb * n, k_valid = min(n, Tk - k0);
    const std::size_t kv = (std::size_t(b) * Tk + k0) * s.ldkv + std::size_t(hk) * D;
    __syncthreads();  // the previous tile's readers of Ks, Vs and Ps are done
    load_tile<P>(Ks, L.ld.s, k + kv, s.ldkv, k_valid, D);
    load_tile<P>(Vs, L.ld.s, v + kv, s.ldkv, k_valid, D);
    __syncthreads();
    P::template gemm<true, false>(Qs, L.ld.s, Ks, L.ld.s, Sf, L.ld.f, n, n, D);  // S = Q K^T
    __syncthreads();
    // Online softmax of row r over this tile; masked entries (future or padding keys) are -inf.
    A* srow = Sf + r * L.ld.f;
    A mx = neg_inf<A>();
    for (int c = g; c < n; c += G) {
      const int j = k0 + c;
      const A x = (j < Tk && (!s.causal || j <= t)) ? srow[c] * scale : neg_inf<A>();
      srow[c] = x;
      mx = max(mx, x);
    }
    mx = group_max<G>(mx);
    const A m_new = max(m_i, mx);
    const A base = m_new == neg_inf<A>() ? A(0) : m_new;  // a row with no key yet stays at zero
    const A corr = exp_(m_i - base);                       // 0 on the first tile (m_i = -inf)
    A sum = 0;
    S* prow = Ps + r * L.ld.st;
    for (int c = g; c < n; c += G) {
      const A p = exp_(srow[c] - base);
      prow[c] = narrow<S>(p);
      sum += p;
    }
    sum = group_sum<G>(sum);
    l_i = l_i * corr + sum;
    m_i = m_new;
    A* orow = Of + r * L.ld.o;
    for (int d = g; d < D; d += G) orow[d] *= corr;
    __syncthreads();
    P::template gemm<false, true>(Ps, L.ld.st, Vs, L.ld.s, Of, L.ld.o, n, D, n);  // O += P V
  }
  if (g == 0) {
    row_inv[r] = A(1) / l_i;
    row_lse[r] = m_i + log_(l_i);
  }
  __syncthreads();
  T* ob = out + (std::size_t(b) * s.T + q0) * s.ldo + std::size_t(h) * D;
  for (int e = threadIdx.x; e < q_valid * D; e += P::threads) {
    const int rr = e / D, d = e % D;
    ob[rr * s.ldo + d] = narrow<T>(Of[rr * L.ld.o + d] * row_inv[rr]);
  }
  acc_t<T>* lb = lse + (std::size_t(b) * s.Hq + h) * s.T + q0;
  for (int rr = threadIdx.x; rr < q_valid; rr += P::threads) lb[rr] = row_lse[rr];
}

// --- backward ----------------------------------------------------------------------------------------------------

//! delta[b, h, t] = sum over d of dout * out (one warp per row), laid out as lse.
template <class T>
__global__ void delta_kernel(const T* dout, const T* out, acc_t<T>* delta, AttentionShape s) {
  using A = acc_t<T>;
  const std::size_t row = (std::size_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const std::size_t rows = std::size_t(s.B) * s.T * s.Hq;
  if (row >= rows) return;  // whole warps leave together: rows are warp-uniform
  const int h = static_cast<int>(row % s.Hq);
  const std::size_t bt = row / s.Hq;
  const int t = static_cast<int>(bt % s.T), b = static_cast<int>(bt / s.T);
  const T* o = out + bt * s.ldo + std::size_t(h) * s.D;
  const T* g = dout + bt * s.ldo + std::size_t(h) * s.D;
  A sum = 0;
  for (int d = lane; d < s.D; d += 32) sum += widen(g[d]) * widen(o[d]);
  sum = group_sum<32>(sum);
  if (lane == 0) delta[(std::size_t(b) * s.Hq + h) * s.T + t] = sum;
}
//! The same in 16-byte loads, G lanes a row (a warp holds 32 / G rows), where rows and heads start on 16 bytes.
template <class T, int G>
__global__ void delta_packed_kernel(const T* dout, const T* out, acc_t<T>* delta, AttentionShape s) {
  using A = acc_t<T>;
  constexpr int V = vec_width<T>;
  const std::size_t row = (std::size_t(blockIdx.x) * blockDim.x + threadIdx.x) / G;
  const int lane = threadIdx.x % G;
  const std::size_t rows = std::size_t(s.B) * s.T * s.Hq;
  // A warp's last rows may lie past the end: their lanes stay for the shuffles, reading nothing.
  const bool valid = row < rows;
  const int h = valid ? static_cast<int>(row % s.Hq) : 0;
  const std::size_t bt = valid ? row / s.Hq : 0;
  A sum = 0;
  if (valid) {
    const T* o = out + bt * s.ldo + std::size_t(h) * s.D;
    const T* g = dout + bt * s.ldo + std::size_t(h) * s.D;
    for (int d = lane * V; d < s.D; d += G * V) {
      const auto gp = load_pack<V>(g + d), op = load_pack<V>(o + d);
#pragma unroll
      for (int e = 0; e < V; ++e) sum += widen(gp.v[e]) * widen(op.v[e]);
    }
  }
  sum = group_sum<G>(sum);
  if (valid && lane == 0) {
    const int t = static_cast<int>(bt % s.T), b = static_cast<int>(bt / s.T);
    delta[(std::size_t(b) * s.Hq + h) * s.T + t] = sum;
  }
}

//! Per key tile: dV = sum P^T dO and dK = scale sum dS^T Q over the query tiles that see it (causal: those at or
//! after it), and over the query heads that share the key/value head.
template <class P, class T>
__global__ void __launch_bounds__(P::threads)
    backward_kv_kernel(const T* dout, const T* q, const T* k, const T* v, const acc_t<T>* lse,
                       const acc_t<T>* delta, T* dk, T* dv, AttentionShape s) {
  using S = typename P::S;
  using A = typename P::A;
  constexpr int n = P::tile;
  extern __shared__ __align__(128) unsigned char smem[];
  const int D = s.D;
  const BackwardSmem<P> L(D, true);
  S* Ks = at<S>(smem, L.x0);
  S* Vs = at<S>(smem, L.x1);
  S* Qs = at<S>(smem, L.y0);
  S* dOs = at<S>(smem, L.y1);
  A* Sf = at<A>(smem, L.s);
  A* dPf = at<A>(smem, L.dp);
  S* Ps = at<S>(smem, L.p);
  S* dSs = at<S>(smem, L.ds);
  A* dKf = at<A>(smem, L.acc0);
  A* dVf = at<A>(smem, L.acc1);
  A* lse_s = at<A>(smem, L.lse);
  A* delta_s = at<A>(smem, L.delta);

  const int kb = blockIdx.x;  // the first key tiles see the most queries: they start first
  const int hk = blockIdx.y, b = blockIdx.z, group = s.Hq / s.Hkv;
  const int Tk = s.Tk < 0 ? s.T : s.Tk;  // s.keys(), a host function
  const int k0 = kb * n, k_valid = min(n, Tk - k0);
  const std::size_t kv = (std::size_t(b) * Tk + k0) * s.ldkv + std::size_t(hk) * D;
  load_tile<P>(Ks, L.ld.s, k + kv, s.ldkv, k_valid, D);
  load_tile<P>(Vs, L.ld.s, v + kv, s.ldkv, k_valid, D);
  zero_tile(dKf, L.ld.o, n, D, P::threads);
  zero_tile(dVf, L.ld.o, n, D, P::threads);
  const A scale = A(s.scale);
  const int query_tiles = (s.T + n - 1) / n;
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    for (int qb = s.causal ? kb : 0; qb < query_tiles; ++qb) {  // causal: query tiles before kb see none of these
      const int q0 = qb * n, q_valid = min(n, s.T - q0);
      __syncthreads();
      load_tile<P>(Qs, L.ld.s, q + (std::size_t(b) * s.T + q0) * s.ldq + std::size_t(h) * D, s.ldq, q_valid, D);
      load_tile<P>(dOs, L.ld.s, dout + (std::size_t(b) * s.T + q0) * s.ldo + std::size_t(h) * D, s.ldo, q_valid, D);
      const std::size_t row0 = (std::size_t(b) * s.Hq + h) * s.T + q0;
      for (int i = threadIdx.x; i < n; i += P::threads) {
        lse_s[i] = i < q_valid ? A(lse[row0 + i]) : A(0);
        delta_s[i] = i < q_valid ? A(delta[row0 + i]) : A(0);
      }
      __syncthreads();
      P::template gemm<true, false>(Ks, L.ld.s, Qs, L.ld.s, Sf, L.ld.f, n, n, D);    // S^T = K Q^T
      P::template gemm<true, false>(Vs, L.ld.s, dOs, L.ld.s, dPf, L.ld.f, n, n, D);  // dP^T = V dO^T
      __syncthreads();
      for (int e = threadIdx.x; e < n * n; e += P::threads) {
        const int c = e / n, rq = e % n;  // key c, query rq
        const int j = k0 + c, t = q0 + rq;
        A p = 0;
        if (t < s.T && j < Tk && (!s.causal || j <= t)) p = exp_(Sf[c * L.ld.f + rq] * scale - lse_s[rq]);
        Ps[c * L.ld.st + rq] = narrow<S>(p);
        dSs[c * L.ld.st + rq] = narrow<S>(p * (dPf[c * L.ld.f + rq] - delta_s[rq]));
      }
      __syncthreads();
      P::template gemm<false, true>(Ps, L.ld.st, dOs, L.ld.s, dVf, L.ld.o, n, D, n);  // dV += P^T dO
      P::template gemm<false, true>(dSs, L.ld.st, Qs, L.ld.s, dKf, L.ld.o, n, D, n);  // dK += dS^T Q
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < k_valid * D; e += P::threads) {
    const int c = e / D, d = e % D;
    dk[kv + c * s.ldkv + d] = narrow<T>(dKf[c * L.ld.o + d] * scale);
    dv[kv + c * s.ldkv + d] = narrow<T>(dVf[c * L.ld.o + d]);
  }
}

//! Per query tile: dQ = scale sum dS K over the key tiles it sees (causal: those up to it).
template <class P, class T>
__global__ void __launch_bounds__(P::threads)
    backward_q_kernel(const T* dout, const T* q, const T* k, const T* v, const acc_t<T>* lse, const acc_t<T>* delta,
                      T* dq, AttentionShape s) {
  using S = typename P::S;
  using A = typename P::A;
  constexpr int n = P::tile;
  extern __shared__ __align__(128) unsigned char smem[];
  const int D = s.D;
  const BackwardSmem<P> L(D, false);
  S* Qs = at<S>(smem, L.x0);
  S* dOs = at<S>(smem, L.x1);
  S* Ks = at<S>(smem, L.y0);
  S* Vs = at<S>(smem, L.y1);
  A* Sf = at<A>(smem, L.s);
  A* dPf = at<A>(smem, L.dp);
  S* dSs = at<S>(smem, L.ds);
  A* dQf = at<A>(smem, L.acc0);
  A* lse_s = at<A>(smem, L.lse);
  A* delta_s = at<A>(smem, L.delta);

  const int qb = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (s.Hq / s.Hkv);
  const int q0 = qb * n, q_valid = min(n, s.T - q0);
  load_tile<P>(Qs, L.ld.s, q + (std::size_t(b) * s.T + q0) * s.ldq + std::size_t(h) * D, s.ldq, q_valid, D);
  load_tile<P>(dOs, L.ld.s, dout + (std::size_t(b) * s.T + q0) * s.ldo + std::size_t(h) * D, s.ldo, q_valid, D);
  const std::size_t row0 = (std::size_t(b) * s.Hq + h) * s.T + q0;
  for (int i = threadIdx.x; i < n; i += P::threads) {
    lse_s[i] = i < q_valid ? A(lse[row0 + i]) : A(0);
    delta_s[i] = i < q_valid ? A(delta[row0 + i]) : A(0);
  }
  zero_tile(dQf, L.ld.o, n, D, P::threads);
  const A scale = A(s.scale);
  const int Tk = s.Tk < 0 ? s.T : s.Tk;  // s.keys(), a host function
  const int key_tiles = s.causal ? (min(s.T, q0 + n) - 1) / n + 1 : (Tk + n - 1) / n;
  for (int kb = 0; kb < key_tiles; ++kb) {
    const int k0 = kb * n, k_valid = min(n, Tk - k0);
    const std::size_t kv = (std::size_t(b) * Tk + k0) * s.ldkv + std::size_t(hk) * D;
    __syncthreads();
    load_tile<P>(Ks, L.ld.s, k + kv, s.ldkv, k_valid, D);
    load_tile<P>(Vs, L.ld.s, v + kv, s.ldkv, k_valid, D);
    __syncthreads();
    P::template gemm<true, false>(Qs, L.ld.s, Ks, L.ld.s, Sf, L.ld.f, n, n, D);    // S = Q K^T
    P::template gemm<true, false>(dOs, L.ld.s, Vs, L.ld.s, dPf, L.ld.f, n, n, D);  // dP = dO V^T
    __syncthreads();
    for (int e = threadIdx.x; e < n * n; e += P::threads) {
      const int rq = e / n, c = e % n;
      const int t = q0 + rq, j = k0 + c;
      A p = 0;
      if (t < s.T && j < Tk && (!s.causal || j <= t)) p = exp_(Sf[rq * L.ld.f + c] * scale - lse_s[rq]);
      dSs[rq * L.ld.st + c] = narrow<S>(p * (dPf[rq * L.ld.f + c] - delta_s[rq]));
    }
    __syncthreads();
    P::template gemm<false, true>(dSs, L.ld.st, Ks, L.ld.s, dQf, L.ld.o, n, D, n);  // dQ += dS K
  }
  __syncthreads();
  T* qg = dq + (std::size_t(b) * s.T + q0) * s.ldq + std::size_t(h) * D;
  for (int e = threadIdx.x; e < q_valid * D; e += P::threads) {
    const int rq = e / D, d = e % D;
    qg[rq * s.ldq + d] = narrow<T>(dQf[rq * L.ld.o + d] * scale);
  }
}

// --- launch ------------------------------------------------------------------------------------------------------

inline void check_device_shape(const AttentionShape& s) {
  kernels::check_shape(s);  // the rules both devices share
  LOOM_CHECK(s.B <= 65535 && s.Hq <= 65535, "attention on the device takes at most 65535 sequences and heads (B=",
             s.B, " Hq=", s.Hq, ")");
}

//! Raises the kernel's dynamic shared memory limit to `bytes`, or says why the device cannot run it.
template <class Kernel>
void prepare(Kernel kernel, std::size_t bytes, const AttentionShape& s, const char* name) {
  const int limit = max_shared_per_block();
  LOOM_CHECK(bytes <= static_cast<std::size_t>(limit), name, " with head size D=", s.D, " needs ", bytes,
             " bytes of shared memory per block; the device offers ", limit);
  if (bytes > 48 * 1024)
    LOOM_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

//! Calls f(Policy{}) with the policy for element type T and head size D: tensor cores for bf16/fp16 when D is a
//! multiple of 16 and the kernel's tiles fit in shared memory (forward and backward each asks for its own), FMAs
//! otherwise.
template <class T, bool Backward, class F>
void with_policy(int D, F&& f) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
    const std::size_t bytes = Backward ? BackwardSmem<Wmma<T>>(D, true).bytes : ForwardSmem<Wmma<T>>(D).bytes;
    if (D % 16 == 0 && bytes <= static_cast<std::size_t>(max_shared_per_block())) {
      f(Wmma<T>{});
      return;
    }
  }
  f(Simt<T>{});
}

//! Whether LOOM_CUDA_ATTENTION=wmma asks for the shared-memory kernels where the register-resident ones would run
//! (to compare the two on one machine, or to set aside a register kernel suspected of a fault); read once.
inline bool registers_set_aside() {
  static const bool aside = [] {
    const char* v = std::getenv("LOOM_CUDA_ATTENTION");
    return v && std::string_view(v) == "wmma";
  }();
  return aside;
}

//! Calls f(Mma<T, D>{}) and returns true where the register-resident kernels take T and s.D (bf16 or fp16, head
//! size 64 or 128) and the device offers the shared memory of all three, unless registers_set_aside(); false
//! otherwise.
template <class T, class F>
bool with_registers(int D, F&& f) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
    if (registers_set_aside()) return false;
    const auto run = [&](auto policy) {
      using P = decltype(policy);
      const std::size_t most =
          std::max({forward_mma_bytes<P>(), backward_kv_mma_bytes<P>(), backward_q_mma_bytes<P>()});
      if (most > static_cast<std::size_t>(max_shared_per_block())) return false;
      f(policy);
      return true;
    };
    if (D == 64) return run(Mma<T, 64>{});
    if (D == 128) return run(Mma<T, 128>{});
  }
  return false;
}

template <class T>
void forward(const T* q, const T* k, const T* v, T* out, acc_t<T>* lse, const AttentionShape& s, cudaStream_t stream) {
  check_device_shape(s);
  if (s.B == 0 || s.T == 0) return;
  const dim3 grid_of_queries((s.T + 63) / 64, s.Hq, s.B);
  if (with_registers<T>(s.D, [&](auto policy) {
        using P = decltype(policy);
        const std::size_t bytes = forward_mma_bytes<P>();
        auto kernel = forward_mma_kernel<P, T>;
        prepare(kernel, bytes, s, "attention_forward");
        kernel<<<grid_of_queries, P::threads, bytes, stream>>>(q, k, v, out, lse, s);
        check_launch("attention_forward");
      }))
    return;
  with_policy<T, false>(s.D, [&](auto policy) {
    using P = decltype(policy);
    const std::size_t bytes = ForwardSmem<P>(s.D).bytes;
    auto kernel = forward_kernel<P, T>;
    prepare(kernel, bytes, s, "attention_forward");
    const dim3 grid((s.T + P::tile - 1) / P::tile, s.Hq, s.B);
    kernel<<<grid, P::threads, bytes, stream>>>(q, k, v, out, lse, s);
    check_launch("attention_forward");
  });
}

template <class T>
void backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const acc_t<T>* lse, T* dq, T* dk,
              T* dv, const AttentionShape& s, cudaStream_t stream) {
  check_device_shape(s);
  if (s.B == 0 || s.T == 0) return;
  const std::size_t rows = std::size_t(s.B) * s.T * s.Hq;
  CudaBuffer<acc_t<T>> delta(rows, stream);
  constexpr int group = 8;  // lanes a row in 16-byte loads: GPT-2's head of 64 bf16 is one load each
  if (s.D % vec_width<T> == 0 && s.ldo * std::int64_t(sizeof(T)) % 16 == 0 && vec_ok({dout, out}))
    delta_packed_kernel<T, group><<<static_cast<unsigned>((rows * group + 255) / 256), 256, 0, stream>>>(
        dout, out, delta.data(), s);
  else
    delta_kernel<<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, stream>>>(dout, out, delta.data(), s);
  check_launch("attention_backward");
  if (with_registers<T>(s.D, [&](auto policy) {
        using P = decltype(policy);
        const int tiles = (s.T + P::tile - 1) / P::tile, key_tiles = (s.keys() + P::tile - 1) / P::tile;
        const std::size_t kv_bytes = backward_kv_mma_bytes<P>(), q_bytes = backward_q_mma_bytes<P>();
        auto kv_kernel = backward_kv_mma_kernel<P, T>;
        auto q_kernel = backward_q_mma_kernel<P, T>;
        prepare(kv_kernel, kv_bytes, s, "attention_backward");
        prepare(q_kernel, q_bytes, s, "attention_backward");
        kv_kernel<<<dim3(key_tiles, s.Hkv, s.B), P::threads, kv_bytes, stream>>>(dout, q, k, v, lse, delta.data(),
                                                                                   dk, dv, s);
        check_launch("attention_backward");
        q_kernel<<<dim3(tiles, s.Hq, s.B), P::threads, q_bytes, stream>>>(dout, q, k, v, lse, delta.data(), dq, s);
        check_launch("attention_backward");
      }))
    return;
  with_policy<T, true>(s.D, [&](auto policy) {
    using P = decltype(policy);
    const int tiles = (s.T + P::tile - 1) / P::tile, key_tiles = (s.keys() + P::tile - 1) / P::tile;
    const std::size_t kv_bytes = BackwardSmem<P>(s.D, true).bytes;
    auto kv_kernel = backward_kv_kernel<P, T>;
    prepare(kv_kernel, kv_bytes, s, "attention_backward");
    kv_kernel<<<dim3(key_tiles, s.Hkv, s.B), P::threads, kv_bytes, stream>>>(dout, q, k, v, lse, delta.data(), dk,
                                                                               dv, s);
    check_launch("attention_backward");
    const std::size_t q_bytes = BackwardSmem<P>(s.D, false).bytes;
    auto q_kernel = backward_q_kernel<P, T>;
    prepare(q_kernel, q_bytes, s, "attention_backward");
    q_kernel<<<dim3(tiles, s.Hq, s.B), P::threads, q_bytes, stream>>>(dout, q, k, v, lse, delta.data(), dq, s);
    check_launch("attention_backward");
  });
}

}  // namespace detail::attn

//! Attention in tiles with an online softmax; the T x Tk matrix is never materialised. Causal self-attention
//! (s.causal, Tk = T), or every query over a block of Tk = s.keys() keys (causal = false).
//! q: B x T x Hq x D with row stride ldq (elements between consecutive (b, t)); k, v: B x Tk x Hkv x D with stride
//! ldkv; out: B x T x Hq x D with stride ldo; lse: B x Hq x T, the per-row log-sum-exp kept for backward.
//! Query head h reads key/value head h / (Hq / Hkv). scale is usually 1/sqrt(D). q, k, v may point into one fused
//! qkv buffer.
template <Floating T>
void attention_forward(const T* q, const T* k, const T* v, T* out, acc_t<T>* lse, const AttentionShape& s,
                       cudaStream_t stream) {
  detail::attn::forward(detail::dev(q), detail::dev(k), detail::dev(v), detail::dev(out), lse, s, stream);
}

//! dq, dk, dv (written; strides as q, k, v) from dout (stride ldo), using out and lse from forward.
template <Floating T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const acc_t<T>* lse, T* dq,
                        T* dk, T* dv, const AttentionShape& s, cudaStream_t stream) {
  detail::attn::backward(detail::dev(dout), detail::dev(q), detail::dev(k), detail::dev(v), detail::dev(out), lse,
                         detail::dev(dq), detail::dev(dk), detail::dev(dv), s, stream);
}

}  // namespace loom::kernels::cuda

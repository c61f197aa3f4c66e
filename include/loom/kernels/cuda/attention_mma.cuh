// Attention for bf16/fp16 with head size 64 or 128: FlashAttention-2's arrangement with every accumulator in
// registers. Each warp owns 16 rows of its block's tile; the products are mma.sync m16n8k16 (fp32 accumulation),
// their operands come from shared memory through ldmatrix, and the score fragment of one product is, packed to
// 16 bits, the operand fragment of the next (P of S = Q K^T multiplies V without leaving the registers). The
// softmax runs in base 2 with the scale folded in (exp2(x log2 e) = exp(x)). The tiles a block walks over (K and V,
// or Q and dO) are double-buffered: the next pair is copied in with cp.async while the current one is multiplied.
//
// Fragment layouts (PTX ISA, mma.m16n8k16): lane = 4 g + t. A (16 x 16, row-major) holds rows g and g + 8 at
// columns 2t, 2t + 1 and 2t + 8, 2t + 9 in four 32-bit registers; B (16 x 8) holds rows 2t, 2t + 1 and 2t + 8,
// 2t + 9 of column g in two; C (16 x 8, fp32) holds rows g and g + 8 at columns 2t, 2t + 1.
//
// The same three kernels as the tiled kernels of attention.cuh: forward, and a deterministic backward of one
// kernel per key tile (dK, dV) and one per query tile (dQ).
#pragma once

#include <loom/kernels/cuda/device.cuh>

#include <cstdint>

namespace loom::kernels::cuda::detail::attn {

//! Whether rows of T, ld elements apart from src on, each start on 16 bytes.
template <class T>
__host__ __device__ bool rows_on_16_bytes(const T* src, std::ptrdiff_t ld) {
  return reinterpret_cast<std::uintptr_t>(src) % 16 == 0 && ld % (16 / std::ptrdiff_t(sizeof(T))) == 0;
}

//! `rows` rows of D elements from global memory (rows ld apart) into shared memory (rows lds apart), 16 bytes at a
//! time where both sides allow it; rows from `valid` on are zero. Both families of attention kernels load through it.
template <class P, class T>
__device__ void load_rows(typename P::S* dst, int lds, const T* src, std::ptrdiff_t ld, int rows, int valid, int D) {
  using S = typename P::S;
  const int n = rows;
  if constexpr (std::is_same_v<S, T>) {
    constexpr int V = 16 / sizeof(T);
    if (D % V == 0 && lds % V == 0 && rows_on_16_bytes(src, ld)) {
      const int per_row = D / V;
      for (int e = threadIdx.x; e < n * per_row; e += P::threads) {
        const int r = e / per_row, c = (e % per_row) * V;
        Pack<T, V> x;
        if (r < valid) {
          x = load_pack<V>(src + r * ld + c);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) x.v[j] = narrow<T>(0.0f);
        }
        store_pack(dst + r * lds + c, x);
      }
      return;
    }
  }
  for (int e = threadIdx.x; e < n * D; e += P::threads) {
    const int r = e / D, c = e % D;
    dst[r * lds + c] = r < valid ? narrow<S>(widen(src[r * ld + c])) : narrow<S>(0.0f);
  }
}

//! Register-resident tiles for head size D (64 or 128): 64 queries by 64 keys per block, four warps of 16 rows.
//! The key/value kernel of backward walks the queries `kv_queries` at a time (fewer for D = 128, so that dK, dV
//! and the two score strips stay in registers).
template <class T, int D>
struct Mma {
  using A = float;
  using S = T;
  static constexpr int head = D;
  static constexpr int tile = 64;
  static constexpr int threads = 128;
  static constexpr int pad_s = 8;  // rows 16-byte aligned for ldmatrix, and its eight rows on distinct banks
  static constexpr int ld = D + pad_s;
  static constexpr int kv_queries = D == 64 ? 64 : 32;
  static constexpr int forward_blocks = D == 64 ? 4 : 2;  //!< blocks a multiprocessor holds: registers and smem
};

namespace mma {

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

//! Four 8 x 8 matrices of 16-bit elements; lanes 8i to 8i + 7 give the row addresses of matrix i.
__device__ __forceinline__ void load_x4(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
}
//! The same, each matrix transposed on the way.
__device__ __forceinline__ void load_x4_trans(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
}

//! This lane's address for a 16 x 16 block at (r0, c0) of a row-major tile with row stride ld: with load_x4, the A
//! fragment of that block; with load_x4_trans, when the tile is stored k-major (row = k), the B fragments of the
//! n-tiles at c0 (registers 0, 1) and c0 + 8 (registers 2, 3) for the k-step at r0.
template <class T>
__device__ __forceinline__ const T* block_address(const T* tile, int ld, int r0, int c0) {
  const int lane = threadIdx.x % 32;
  return tile + (r0 + (lane & 15)) * ld + c0 + (lane >> 4) * 8;
}
//! This lane's address, with load_x4, for the B fragments of the n-tiles at n0 (registers 0, 1) and n0 + 8
//! (registers 2, 3) for the k-step at k0, from a tile stored n-major (row = n): K for Q K^T.
template <class T>
__device__ __forceinline__ const T* nmajor_address(const T* tile, int ld, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  return tile + (n0 + ((lane >> 4) << 3) + (lane & 7)) * ld + k0 + ((lane >> 3) & 1) * 8;
}

//! d += a b for one 16 x 8 x 16 block, fp32 accumulators.
template <class T>
__device__ __forceinline__ void product(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                        std::uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

//! Two floats as two 16-bit elements of one register, lo in the low half.
template <class T>
__device__ __forceinline__ std::uint32_t pack(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  }
}

//! The A fragment, as T, of k-step kk of a warp's 16-row strip held as C fragments (n-tiles 2kk and 2kk + 1).
template <class T, int N>
__device__ __forceinline__ void as_operand(std::uint32_t (&a)[4], const float (&c)[N][4], int kk) {
  a[0] = pack<T>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack<T>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

//! c = the 16 x K strip at row r0 of tile a times tile b (N*8 rows of K, n-major) transposed; c[j] is columns 8j to
//! 8j + 7.
template <class T, int K, int N>
__device__ __forceinline__ void product_nt(float (&c)[N][4], const T* a, int r0, const T* b, int ld) {
#pragma unroll
  for (int j = 0; j < N; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    std::uint32_t af[4];
    load_x4(af, block_address(a, ld, r0, kk * 16));
#pragma unroll
    for (int j = 0; j < N; j += 2) {
      std::uint32_t bf[4];
      load_x4(bf, nmajor_address(b, ld, j * 8, kk * 16));
      product<T>(c[j], af, bf[0], bf[1]);
      product<T>(c[j + 1], af, bf[2], bf[3]);
    }
  }
}

//! acc (16 x DT*8) += p (16 x N*8, C fragments packed to T) times the k-major tile b (N*8 rows of DT*8).
template <class T, int N, int DT>
__device__ __forceinline__ void accumulate_pv(float (&acc)[DT][4], const float (&p)[N][4], const T* b, int ld) {
#pragma unroll
  for (int kk = 0; kk < N / 2; ++kk) {
    std::uint32_t af[4];
    as_operand<T>(af, p, kk);
#pragma unroll
    for (int dt = 0; dt < DT; dt += 2) {
      std::uint32_t bf[4];
      load_x4_trans(bf, block_address(b, ld, kk * 16, dt * 8));
      product<T>(acc[dt], af, bf[0], bf[1]);
      product<T>(acc[dt + 1], af, bf[2], bf[3]);
    }
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
}


constexpr float log2e = 1.4426950408889634f;
constexpr float ln2 = 0.6931471805599453f;

//! Starts a 16-byte copy from global to shared memory that does not wait (zeros where !valid: src is not read).
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
//! Closes the group of copies started since the last one.
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
//! Waits for this thread's groups of copies but the latest.
__device__ __forceinline__ void wait_copies_but_latest() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

//! Stores a warp's 16 x DT*8 strip of C fragments, times row factors, as T to rows (r0 + row) of dst (row stride
//! ld), rows from `valid` on left out.
template <class T, int DT>
__device__ __forceinline__ void store_strip(T* dst, std::ptrdiff_t ld, const float (&c)[DT][4], int r0, int valid,
                                            float f0, float f1) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + g + 8 * half;
    if (r >= valid) continue;
    const float f = half ? f1 : f0;
    T* row = dst + r * ld;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      row[dt * 8 + 2 * t] = narrow<T>(c[dt][2 * half] * f);
      row[dt * 8 + 2 * t + 1] = narrow<T>(c[dt][2 * half + 1] * f);
    }
  }
}

}  // namespace mma

//! Two tiles of `rows` rows (K and V, or Q and dO) that the kernels walk over, in two shared-memory copies: while
//! the threads multiply one, the next is copied into the other without waiting (cp.async), where the global rows
//! allow 16-byte copies; elsewhere each pair is loaded, waiting, into the first copy.
template <class P, class T>
struct TilePairs {
  T* base;     //!< 2 copies x 2 tiles x rows x P::ld
  int rows;
  bool async;  //!< the global rows allow 16-byte copies (uniform over the block)

  __device__ T* first(int copy) const { return base + std::ptrdiff_t(copy) * 2 * rows * P::ld; }
  __device__ T* second(int copy) const { return first(copy) + std::ptrdiff_t(rows) * P::ld; }

  //! Fills copy `copy` from rows x0, x1 (ld0, ld1 apart), rows from `valid` on zero; async: only starts it.
  __device__ void fetch(int copy, const T* x0, std::ptrdiff_t ld0, const T* x1, std::ptrdiff_t ld1, int valid) const {
    if (!async) {
      load_rows<P>(first(copy), P::ld, x0, ld0, rows, valid, P::head);
      load_rows<P>(second(copy), P::ld, x1, ld1, rows, valid, P::head);
      return;
    }
    constexpr int V = 16 / sizeof(T), per_row = P::head / V;
    for (int e = threadIdx.x; e < rows * per_row; e += P::threads) {
      const int r = e / per_row, c = (e % per_row) * V, from = r < valid ? r : 0;
      mma::copy16_async(first(copy) + r * P::ld + c, x0 + from * ld0 + c, r < valid);
      mma::copy16_async(second(copy) + r * P::ld + c, x1 + from * ld1 + c, r < valid);
    }
  }
  //! Makes step i's pair ready in shared memory, having started step i + 1's (fetch(i) is this block's fetch of
  //! step i into the copy given), and returns the copy holding step i. Ends with every thread's copies visible;
  //! starts with a barrier, so that the copy being overwritten is no longer read.
  template <class Fetch>
  __device__ int advance(int i, int steps, Fetch&& fetch_step) const {
    __syncthreads();
    if (!async) {
      fetch_step(i, 0);
      __syncthreads();
      return 0;
    }
    if (i == 0) {
      fetch_step(0, 0);
      mma::commit_copies();
    }
    if (i + 1 < steps) fetch_step(i + 1, (i + 1) & 1);
    mma::commit_copies();  // possibly empty: wait_copies_but_latest then always means step i
    mma::wait_copies_but_latest();
    __syncthreads();
    return i & 1;
  }
};

//! The key tiles a block of queries [q0, q0 + P::tile) of sequence b sees through key/value head hk (causal: those
//! up to its last query), walked as TilePairs of K and V whose copies start at `base`.
template <class P, class T>
struct KeyWalk {
  const T* k;
  const T* v;
  std::ptrdiff_t ldkv;
  std::size_t row0;  //!< the element of (b, key 0, head hk)
  int keys, tiles;
  TilePairs<P, T> kv;

  __device__ KeyWalk(T* base, const T* k_, const T* v_, const AttentionShape& s_, int b, int hk, int q0)
      : k(k_), v(v_), ldkv(s_.ldkv),
        row0(std::size_t(b) * (s_.Tk < 0 ? s_.T : s_.Tk) * s_.ldkv + std::size_t(hk) * P::head),
        keys(s_.Tk < 0 ? s_.T : s_.Tk),
        tiles(s_.causal ? (min(s_.T, q0 + P::tile) - 1) / P::tile + 1 : (keys + P::tile - 1) / P::tile),
        kv{base, P::tile,
           rows_on_16_bytes(k_ + row0, s_.ldkv) && rows_on_16_bytes(v_ + row0, s_.ldkv)} {}

  //! Makes key tile kb ready (TilePairs::advance) and returns its K and V in shared memory.
  __device__ void advance(int kb, const T*& Ks, const T*& Vs) const {
    const int copy = kv.advance(kb, tiles, [&](int i, int to) {
      const std::size_t at = row0 + std::size_t(i) * P::tile * ldkv;
      kv.fetch(to, k + at, ldkv, v + at, ldkv, min(P::tile, keys - i * P::tile));
    });
    Ks = kv.first(copy);
    Vs = kv.second(copy);
  }
};

// --- forward -----------------------------------------------------------------------------------------------------

template <class P, class T>
__global__ void __launch_bounds__(P::threads, P::forward_blocks)
    forward_mma_kernel(const T* q, const T* k, const T* v, T* out, float* lse, AttentionShape s) {
  constexpr int n = P::tile, D = P::head, ld = P::ld, NT = n / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);

  const int qb = gridDim.x - 1 - blockIdx.x;  // the last query tiles have the most keys: start them first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (s.Hq / s.Hkv);
  const int q0 = qb * n, q_valid = min(n, s.T - q0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  load_rows<P>(Qs, ld, q + (std::size_t(b) * s.T + q0) * s.ldq + std::size_t(h) * D, s.ldq, n, q_valid, D);
  __syncthreads();
  std::uint32_t qf[D / 16][4];  // this warp's 16 query rows, as A fragments, for every key tile
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) mma::load_x4(qf[kk], mma::block_address(Qs, ld, warp * 16, kk * 16));

  float o[DT][4];
  mma::zero(o);
  float m[2] = {neg_inf<float>(), neg_inf<float>()}, l[2] = {0.0f, 0.0f};  // l: this lane's part of the row sum
  const float scale2 = s.scale * mma::log2e;
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  const KeyWalk<P, T> walk(Qs + n * ld, k, v, s, b, hk, q0);
  const int Tk = walk.keys;
  for (int kb = 0; kb < walk.tiles; ++kb) {
    const int k0 = kb * n, k_valid = min(n, Tk - k0);
    const T *Ks, *Vs;
    walk.advance(kb, Ks, Vs);
    float sc[NT][4];
    mma::zero(sc);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        std::uint32_t bf[4];
        mma::load_x4(bf, mma::nmajor_address(Ks, ld, j * 8, kk * 16));
        mma::product<T>(sc[j], qf[kk], bf[0], bf[1]);
        mma::product<T>(sc[j + 1], qf[kk], bf[2], bf[3]);
      }
    // Scores in base 2; masked entries (future or padding keys) are -inf.
    const bool masked = k_valid < n || (s.causal && k0 + n - 1 > q0 + warp * 16);
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = sc[j][e] * scale2;
        if (masked) {
          const int key = k0 + j * 8 + 2 * t + (e & 1);
          if (key >= Tk || (s.causal && key > row[e >> 1])) x = neg_inf<float>();
        }
        sc[j][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = group_max<4>(mx[r]);  // over the four lanes that hold the row
      const float base = m_new == neg_inf<float>() ? 0.0f : m_new;  // a row with no key yet stays at zero
      const float corr = exp2f(m[r] - base);                           // 0 on the first tile (m = -inf)
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        sc[j][2 * r] = exp2f(sc[j][2 * r] - base);
        sc[j][2 * r + 1] = exp2f(sc[j][2 * r + 1] - base);
        sum += sc[j][2 * r] + sc[j][2 * r + 1];
      }
      l[r] = l[r] * corr + sum;
      m[r] = m_new;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[dt][2 * r] *= corr;
        o[dt][2 * r + 1] *= corr;
      }
    }
    mma::accumulate_pv<T>(o, sc, Vs, ld);  // O += P V, P rounded to T
  }
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = group_sum<4>(l[r]);  // likewise
    inv[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int rr = warp * 16 + g + 8 * r;
    if (t == 0 && rr < q_valid) lse[(std::size_t(b) * s.Hq + h) * s.T + q0 + rr] = (m[r] + log2f(sum)) * mma::ln2;
  }
  mma::store_strip(out + (std::size_t(b) * s.T + q0) * s.ldo + std::size_t(h) * D, s.ldo, o, warp * 16, q_valid,
                   inv[0], inv[1]);
}

// --- backward ----------------------------------------------------------------------------------------------------

//! Per key tile (16 keys a warp): dV = sum P^T dO and dK = scale sum dS^T Q over the query tiles that see it and the
//! query heads of its group, `kv_queries` queries at a time.
template <class P, class T>
__global__ void __launch_bounds__(P::threads)
    backward_kv_mma_kernel(const T* dout, const T* q, const T* k, const T* v, const float* lse, const float* delta,
                           T* dk, T* dv, AttentionShape s) {
  constexpr int n = P::tile, nq = P::kv_queries, D = P::head, ld = P::ld, NQ = nq / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + n * ld;
  float* lse_s = reinterpret_cast<float*>(Vs + n * ld);  // in base 2
  float* delta_s = lse_s + nq;

  const int kb = blockIdx.x;  // the first key tiles see the most queries: they start first
  const int hk = blockIdx.y, b = blockIdx.z, group = s.Hq / s.Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int Tk = s.Tk < 0 ? s.T : s.Tk;
  const int k0 = kb * n, k_valid = min(n, Tk - k0);
  const std::size_t kv = (std::size_t(b) * Tk + k0) * s.ldkv + std::size_t(hk) * D;
  load_rows<P>(Ks, ld, k + kv, s.ldkv, n, k_valid, D);
  load_rows<P>(Vs, ld, v + kv, s.ldkv, n, k_valid, D);
  float dK[DT][4], dV[DT][4];
  mma::zero(dK);
  mma::zero(dV);
  const float scale2 = s.scale * mma::log2e;
  const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  // Steps: the query heads of the group, each over its query tiles from the first that sees these keys (causal:
  // earlier queries see none of them).
  const int first_qb = s.causal ? k0 / nq : 0, per_head = (s.T + nq - 1) / nq - first_qb, steps = group * per_head;
  const auto head_of = [&](int i) { return hk * group + i / per_head; };
  const auto q0_of = [&](int i) { return (first_qb + i % per_head) * nq; };
  const auto q_at = [&](int i) { return (std::size_t(b) * s.T + q0_of(i)) * s.ldq + std::size_t(head_of(i)) * D; };
  const auto o_at = [&](int i) { return (std::size_t(b) * s.T + q0_of(i)) * s.ldo + std::size_t(head_of(i)) * D; };
  const TilePairs<P, T> qdo{reinterpret_cast<T*>(delta_s + nq), nq,
                            rows_on_16_bytes(q + q_at(0), s.ldq) &&
                                rows_on_16_bytes(dout + o_at(0), s.ldo)};
  const auto fetch = [&](int i, int copy) {
    qdo.fetch(copy, q + q_at(i), s.ldq, dout + o_at(i), s.ldo, min(nq, s.T - q0_of(i)));
  };
  for (int i = 0; i < steps; ++i) {
    const int h = head_of(i), q0 = q0_of(i), q_valid = min(nq, s.T - q0);
    const int copy = qdo.advance(i, steps, fetch);
    const T* Qs = qdo.first(copy);
    const T* dOs = qdo.second(copy);
    {
      // lse and delta of these queries: written after advance's first barrier (the last step's readers are done),
      // read after a second.
      const std::size_t row0 = (std::size_t(b) * s.Hq + h) * s.T + q0;
      for (int c = threadIdx.x; c < nq; c += P::threads) {
        lse_s[c] = c < q_valid ? lse[row0 + c] * mma::log2e : 0.0f;
        delta_s[c] = c < q_valid ? delta[row0 + c] : 0.0f;
      }
      __syncthreads();
      float st[NQ][4], dpt[NQ][4];  // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys
      mma::product_nt<T, D>(st, Ks, warp * 16, Qs, ld);
      mma::product_nt<T, D>(dpt, Vs, warp * 16, dOs, ld);
      const bool masked = q_valid < nq || k_valid < n || (s.causal && k0 + warp * 16 + 15 > q0);
#pragma unroll
      for (int j = 0; j < NQ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = j * 8 + 2 * t + (e & 1), query = q0 + c, kr = key[e >> 1];
          float p = exp2f(st[j][e] * scale2 - lse_s[c]);
          if (masked && (query >= s.T || kr >= Tk || (s.causal && kr > query))) p = 0.0f;
          st[j][e] = p;
          dpt[j][e] = p * (dpt[j][e] - delta_s[c]);
        }
      mma::accumulate_pv<T>(dV, st, dOs, ld);  // dV += P^T dO
      mma::accumulate_pv<T>(dK, dpt, Qs, ld);  // dK += dS^T Q
    }
  }
  mma::store_strip(dk + kv, s.ldkv, dK, warp * 16, k_valid, s.scale, s.scale);
  mma::store_strip(dv + kv, s.ldkv, dV, warp * 16, k_valid, 1.0f, 1.0f);
}

//! Per query tile (16 queries a warp): dQ = scale sum dS K over the key tiles it sees.
template <class P, class T>
__global__ void __launch_bounds__(P::threads)
    backward_q_mma_kernel(const T* dout, const T* q, const T* k, const T* v, const float* lse, const float* delta,
                          T* dq, AttentionShape s) {
  constexpr int n = P::tile, D = P::head, ld = P::ld, NT = n / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + n * ld;

  const int qb = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (s.Hq / s.Hkv);
  const int q0 = qb * n, q_valid = min(n, s.T - q0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  load_rows<P>(Qs, ld, q + (std::size_t(b) * s.T + q0) * s.ldq + std::size_t(h) * D, s.ldq, n, q_valid, D);
  load_rows<P>(dOs, ld, dout + (std::size_t(b) * s.T + q0) * s.ldo + std::size_t(h) * D, s.ldo, n, q_valid, D);
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::size_t at = (std::size_t(b) * s.Hq + h) * s.T + row[r];
    lse2[r] = row[r] < s.T ? lse[at] * mma::log2e : 0.0f;
    dl[r] = row[r] < s.T ? delta[at] : 0.0f;
  }
  float dQ[DT][4];
  mma::zero(dQ);
  const float scale2 = s.scale * mma::log2e;
  const KeyWalk<P, T> walk(dOs + n * ld, k, v, s, b, hk, q0);
  const int Tk = walk.keys;
  for (int kb = 0; kb < walk.tiles; ++kb) {
    const int k0 = kb * n, k_valid = min(n, Tk - k0);
    const T *Ks, *Vs;
    walk.advance(kb, Ks, Vs);
    float sc[NT][4], dp[NT][4];
    mma::product_nt<T, D>(sc, Qs, warp * 16, Ks, ld);   // S = Q K^T
    mma::product_nt<T, D>(dp, dOs, warp * 16, Vs, ld);  // dP = dO V^T
    const bool masked = k_valid < n || (s.causal && k0 + n - 1 > q0 + warp * 16);
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, kc = k0 + j * 8 + 2 * t + (e & 1);
        float p = exp2f(sc[j][e] * scale2 - lse2[r]);
        if (masked && (kc >= Tk || (s.causal && kc > row[r]))) p = 0.0f;
        sc[j][e] = p * (dp[j][e] - dl[r]);
      }
    mma::accumulate_pv<T>(dQ, sc, Ks, ld);  // dQ += dS K
  }
  mma::store_strip(dq + (std::size_t(b) * s.T + q0) * s.ldq + std::size_t(h) * D, s.ldq, dQ, warp * 16, q_valid,
                   s.scale, s.scale);
}

// --- launch ------------------------------------------------------------------------------------------------------

// Shared memory: the tiles a block keeps, and two copies of the pair of tiles it walks over (TilePairs).
template <class P>
constexpr std::size_t forward_mma_bytes() {  // Q; K, V twice
  return std::size_t{5} * P::tile * P::ld * sizeof(typename P::S);
}
template <class P>
constexpr std::size_t backward_kv_mma_bytes() {  // K, V; lse, delta; Q, dO twice
  return std::size_t{2} * P::tile * P::ld * sizeof(typename P::S) + std::size_t{2} * P::kv_queries * sizeof(float) +
         std::size_t{4} * P::kv_queries * P::ld * sizeof(typename P::S);
}
template <class P>
constexpr std::size_t backward_q_mma_bytes() {  // Q, dO; K, V twice
  return std::size_t{6} * P::tile * P::ld * sizeof(typename P::S);
}

}  // namespace loom::kernels::cuda::detail::attn

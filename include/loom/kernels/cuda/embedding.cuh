// Token and position embeddings on the device over a slice [v0, v0 + V_local) of the table: gather forward,
// scatter-add backward (the positions sorted by id, then each id's rows summed in their order in acc_t and added
// once: deterministic, no atomics), positions added and summed over the batch.
#pragma once

#include <loom/kernels/cuda/elementwise.cuh>

#include <cub/device/device_radix_sort.cuh>

namespace loom::kernels::cuda {

namespace detail {

template <class T>
struct EmbeddingForward {
  static constexpr int width = vec_width<T>;
  const std::int32_t* ids;
  const T* table;
  T* out;
  int C, v0, V;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const std::size_t row = i / C;
    const int c = static_cast<int>(i % C);
    const long long local = static_cast<long long>(ids[row]) - v0;
    Pack<T, N> r;
    if (local >= 0 && local < V) {
      r = load_pack<N>(table + local * C + c);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) r.v[j] = narrow<T>(0.0f);
    }
    store_pack(out + i, r);
  }
};

//! The sort's keys: each position's row of the slice, V for an id outside it (sorted last, skipped); and its index.
template <class I>
__global__ void embedding_keys_kernel(const I* ids, I* keys, I* positions, int n, int v0, int V) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const long long local = static_cast<long long>(ids[i]) - v0;
  keys[i] = local >= 0 && local < V ? static_cast<I>(local) : static_cast<I>(V);
  positions[i] = static_cast<I>(i);
}

//! Block j, where sorted position j starts its id's run: the run's rows of dout summed in order (a stable sort keeps
//! the positions ascending), W columns a thread at a time, added to the id's row of the table once.
template <class T, int W>
__global__ void embedding_backward_runs_kernel(const std::int32_t* keys, const std::int32_t* positions, const T* dout,
                                               T* dtable, int n, int C, int V) {
  using A = acc_t<T>;
  const int j = blockIdx.x;
  const int key = keys[j];
  if (key >= V || (j > 0 && keys[j - 1] == key)) return;  // the whole block leaves together
  int end = j + 1;
  while (end < n && keys[end] == key) ++end;
  T* row = dtable + std::size_t(key) * C;
  for (int c = threadIdx.x * W; c < C; c += blockDim.x * W) {
    A s[W];
#pragma unroll
    for (int e = 0; e < W; ++e) s[e] = 0;
    // A frequent token's run is long (hundreds of rows in real text): eight rows' loads in flight at a time.
#pragma unroll 8
    for (int k = j; k < end; ++k) {
      const auto g = load_pack<W>(dout + std::size_t(positions[k]) * C + c);
#pragma unroll
      for (int e = 0; e < W; ++e) s[e] += widen(g.v[e]);
    }
    auto cur = load_pack<W>(row + c);
#pragma unroll
    for (int e = 0; e < W; ++e) cur.v[e] = narrow<T>(widen(cur.v[e]) + s[e]);
    store_pack(row + c, cur);
  }
}

template <class T>
struct AddPositions {
  static constexpr int width = vec_width<T>;
  const T* wpe;
  T* out;
  int T_, C, t0;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const std::size_t bt = i / C;
    const int c = static_cast<int>(i % C);
    const int t = static_cast<int>(bt % T_);
    const auto p = load_pack<N>(wpe + std::size_t(t0 + t) * C + c);
    auto o = load_pack<N>(out + i);
#pragma unroll
    for (int j = 0; j < N; ++j) o.v[j] = narrow<T>(widen(o.v[j]) + widen(p.v[j]));
    store_pack(out + i, o);
  }
};

// One thread per (t, c): the sum over b runs in order, no atomics.
template <class T>
struct PositionsBackward {
  static constexpr int width = vec_width<T>;
  const T* dout;
  T* dwpe;
  int B, T_, C, t0;
  template <int N>
  __device__ void apply(std::size_t i) const {  // i = t * C + c
    acc_t<T> s[N];
#pragma unroll
    for (int j = 0; j < N; ++j) s[j] = 0;
    for (int b = 0; b < B; ++b) {
      const auto g = load_pack<N>(dout + std::size_t(b) * T_ * C + i);
#pragma unroll
      for (int j = 0; j < N; ++j) s[j] += widen(g.v[j]);
    }
    T* w = dwpe + std::size_t(t0) * C + i;
    auto cur = load_pack<N>(w);
#pragma unroll
    for (int j = 0; j < N; ++j) cur.v[j] = narrow<T>(widen(cur.v[j]) + s[j]);
    store_pack(w, cur);
  }
};

}  // namespace detail

//! out[i] = table[ids[i] - v0] for n ids when the id lies in [v0, v0 + V_local), else 0; rows of C.
template <Floating T>
void embedding_forward(const std::int32_t* ids, const T* table, T* out, int n, int C, int v0, int V_local,
                       cudaStream_t stream) {
  using D = device_t<T>;
  const bool vec = C % detail::vec_width<D> == 0 && detail::vec_ok({table, out});
  detail::launch_map(detail::EmbeddingForward<D>{ids, detail::dev(table), detail::dev(out), C, v0, V_local},
                     std::size_t(n) * C, vec, stream, "embedding_forward");
}

//! dtable[ids[i] - v0] += dout[i] for ids in the slice: the positions sorted by id (cub's stable radix sort), then
//! a block per distinct id sums its rows in the order of the positions and adds the sum once. The same bits every
//! run (an atomic scatter-add's order would vary) and one rounding per element of the table.
template <Floating T>
void embedding_backward(const std::int32_t* ids, const T* dout, T* dtable, int n, int C, int v0, int V_local,
                        cudaStream_t stream) {
  using D = device_t<T>;
  if (n <= 0 || C <= 0 || V_local <= 0) return;
  CudaBuffer<std::int32_t> keys(std::size_t(n), stream), positions(std::size_t(n), stream),
      sorted_keys(std::size_t(n), stream), sorted_positions(std::size_t(n), stream);
  detail::embedding_keys_kernel<<<(n + 255) / 256, 256, 0, stream>>>(ids, keys.data(), positions.data(), n, v0,
                                                                     V_local);
  detail::check_launch("embedding_backward");
  int bits = 1;  // the keys lie in [0, V_local]
  while (bits < 31 && (std::int64_t{1} << bits) <= V_local) ++bits;
  std::size_t scratch_bytes = 0;
  LOOM_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, scratch_bytes, keys.data(), sorted_keys.data(),
                                            positions.data(), sorted_positions.data(), n, 0, bits, stream));
  CudaBuffer<unsigned char> scratch(scratch_bytes, stream);
  LOOM_CUDA(cub::DeviceRadixSort::SortPairs(scratch.data(), scratch_bytes, keys.data(), sorted_keys.data(),
                                            positions.data(), sorted_positions.data(), n, 0, bits, stream));
  constexpr int threads = 128;
  if (C % detail::vec_width<D> == 0 && detail::vec_ok({dout, dtable})) {
    detail::embedding_backward_runs_kernel<D, detail::vec_width<D>><<<n, threads, 0, stream>>>(
        sorted_keys.data(), sorted_positions.data(), detail::dev(dout), detail::dev(dtable), n, C, V_local);
  } else {
    detail::embedding_backward_runs_kernel<D, 1><<<n, threads, 0, stream>>>(
        sorted_keys.data(), sorted_positions.data(), detail::dev(dout), detail::dev(dtable), n, C, V_local);
  }
  detail::check_launch("embedding_backward");
}

//! out[b, t] += wpe[t0 + t] for B sequences of T positions starting at position t0, rows of C.
template <Floating T>
void add_positions(const T* wpe, T* out, int B, int T_, int C, int t0, cudaStream_t stream) {
  using D = device_t<T>;
  const bool vec = C % detail::vec_width<D> == 0 && detail::vec_ok({wpe, out});
  detail::launch_map(detail::AddPositions<D>{detail::dev(wpe), detail::dev(out), T_, C, t0},
                     std::size_t(B) * T_ * C, vec, stream, "add_positions");
}
template <Floating T>
void add_positions(const T* wpe, T* out, int B, int T_, int C, cudaStream_t stream) {
  add_positions(wpe, out, B, T_, C, 0, stream);
}

//! dwpe[t0 + t] += sum over b of dout[b, t] (in order of b).
template <Floating T>
void positions_backward(const T* dout, T* dwpe, int B, int T_, int C, int t0, cudaStream_t stream) {
  using D = device_t<T>;
  const bool vec = C % detail::vec_width<D> == 0 && detail::vec_ok({dout, dwpe});
  detail::launch_map(detail::PositionsBackward<D>{detail::dev(dout), detail::dev(dwpe), B, T_, C, t0},
                     std::size_t(T_) * C, vec, stream, "positions_backward");
}
template <Floating T>
void positions_backward(const T* dout, T* dwpe, int B, int T_, int C, cudaStream_t stream) {
  positions_backward(dout, dwpe, B, T_, C, 0, stream);
}

}  // namespace loom::kernels::cuda

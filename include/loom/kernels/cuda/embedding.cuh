// Token and position embeddings on the device over a slice [v0, v0 + V_local) of the table: gather forward,
// scatter-add backward (atomicAdd: repeated ids add in an unspecified order), positions added and summed over the
// batch.
#pragma once

#include <loom/kernels/cuda/elementwise.cuh>

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

template <class T>
struct EmbeddingBackward {
  static constexpr int width = 1;
  const std::int32_t* ids;
  const T* dout;
  T* dtable;
  int C, v0, V;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const std::size_t row = i / C;
    const int c = static_cast<int>(i % C);
    const long long local = static_cast<long long>(ids[row]) - v0;
    if (local >= 0 && local < V) atomicAdd(dtable + local * C + c, dout[i]);
  }
};

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

//! dtable[ids[i] - v0] += dout[i] for ids in the slice (a scatter-add with atomicAdd).
template <Floating T>
void embedding_backward(const std::int32_t* ids, const T* dout, T* dtable, int n, int C, int v0, int V_local,
                        cudaStream_t stream) {
  using D = device_t<T>;
  detail::launch_map(detail::EmbeddingBackward<D>{ids, detail::dev(dout), detail::dev(dtable), C, v0, V_local},
                     std::size_t(n) * C, false, stream, "embedding_backward");
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

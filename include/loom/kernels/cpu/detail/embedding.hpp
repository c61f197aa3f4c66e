// Token embeddings over a slice of the table, and learned positions. Include <loom/kernels/cpu/ops.hpp> instead.
#pragma once

#include <loom/kernels/cpu/detail/common.hpp>

#include <cstring>

namespace loom::kernels::cpu {

template <class T>
void embedding_forward(const std::int32_t* ids, const T* table, T* out, int n, int C, int v0, int V_local) {
  detail::check_type<T>();
  for (int i = 0; i < n; ++i) {
    const std::int64_t v = std::int64_t(ids[i]) - v0;
    T* o = out + std::ptrdiff_t(i) * C;
    if (v >= 0 && v < V_local) std::memcpy(o, table + v * C, sizeof(T) * std::size_t(C));
    else std::fill(o, o + C, T(0));
  }
}

template <class T>
void embedding_backward(const std::int32_t* ids, const T* dout, T* dtable, int n, int C, int v0, int V_local) {
  detail::check_type<T>();
  for (int i = 0; i < n; ++i) {
    const std::int64_t v = std::int64_t(ids[i]) - v0;
    if (v >= 0 && v < V_local) accumulate(dout + std::ptrdiff_t(i) * C, dtable + v * C, std::size_t(C));
  }
}

template <class T>
void add_positions(const T* wpe, T* out, int B, int T_, int C, int t0) {
  detail::check_type<T>();
  const std::size_t n = std::size_t(T_) * std::size_t(C);
  for (int b = 0; b < B; ++b) accumulate(wpe + std::ptrdiff_t(t0) * C, out + std::ptrdiff_t(b) * std::ptrdiff_t(n), n);
}

template <class T>
void positions_backward(const T* dout, T* dwpe, int B, int T_, int C, int t0) {
  detail::check_type<T>();
  const std::size_t n = std::size_t(T_) * std::size_t(C);
  for (int b = 0; b < B; ++b)
    accumulate(dout + std::ptrdiff_t(b) * std::ptrdiff_t(n), dwpe + std::ptrdiff_t(t0) * C, n);
}

}  // namespace loom::kernels::cpu

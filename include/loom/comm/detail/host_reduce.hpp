// Element-wise reductions over host memory, used by the Local and Mpi backends. Private: include
// <loom/comm/local.hpp> or <loom/comm/mpi.hpp> instead.
#pragma once

#ifndef LOOM_COMM_BACKEND_INCLUDED
#error "loom: comm/detail/ is private: include <loom/comm/local.hpp>, <loom/comm/mpi.hpp> or <loom/comm/nccl.hpp>"
#endif

#include <loom/comm/types.hpp>

#include <algorithm>
#include <cstring>

namespace loom::comm::detail {

template <class T>
inline void reduce_into(T* __restrict dst, const T* __restrict src, std::size_t n, Reduce op) {
  switch (op) {
    case Reduce::sum:
    case Reduce::avg:
      for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] + src[i];
      break;
    case Reduce::prod:
      for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] * src[i];
      break;
    case Reduce::max:
      for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] < src[i] ? src[i] : dst[i];
      break;
    case Reduce::min:
      for (std::size_t i = 0; i < n; ++i) dst[i] = src[i] < dst[i] ? src[i] : dst[i];
      break;
  }
}

//! dst = reduction of srcs[0..nsrc) over n elements, in cache-sized blocks; dst may alias any one source.
template <class T>
inline void reduce_sources(T* dst, const T* const* srcs, int nsrc, std::size_t n, Reduce op) {
  constexpr std::size_t block = 16384 / sizeof(T);
  // A source equal to dst must be read before dst is written: start from it.
  int first = 0;
  for (int q = 0; q < nsrc; ++q)
    if (srcs[q] == dst) first = q;
  for (std::size_t at = 0; at < n; at += block) {
    const std::size_t len = std::min(block, n - at);
    if (srcs[first] != dst) std::memcpy(dst + at, srcs[first] + at, len * sizeof(T));
    for (int q = 0; q < nsrc; ++q)
      if (q != first) reduce_into(dst + at, srcs[q] + at, len, op);
  }
}

//! Divides by the group size after a sum, for Reduce::avg.
template <class T>
inline void finish_avg(T* dst, std::size_t n, int group_size, Reduce op) {
  if (op != Reduce::avg) return;
  const T d = static_cast<T>(group_size);
  for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] / d;
}

}  // namespace loom::comm::detail

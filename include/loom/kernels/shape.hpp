// The shapes of kernel calls that every device's kernels take (CPU and CUDA alike).
#pragma once

#include <loom/core/error.hpp>

#include <cstddef>

namespace loom::kernels {

//! Causal self-attention over q: B x T x Hq x D with row stride ldq (elements between consecutive (b, t)); k, v:
//! B x T x Hkv x D with stride ldkv; out: B x T x Hq x D with stride ldo; lse: B x Hq x T, the per-row log-sum-exp
//! kept for backward. Query head h reads key/value head h / (Hq / Hkv) (multi-head: Hkv = Hq; GQA; MQA: Hkv = 1).
//! scale is usually 1/sqrt(D); it is double so that a double model scales exactly as PyTorch's (float models round
//! it to float). q, k, v may point into one fused qkv buffer.
struct AttentionShape {
  int B, T, Hq, Hkv, D;
  std::ptrdiff_t ldq, ldkv, ldo;
  double scale;
};

//! The rules every device's attention kernels check: positive sizes, Hq a multiple of Hkv, strides that hold
//! every head.
inline void check_shape(const AttentionShape& s) {
  LOOM_CHECK(s.B >= 0 && s.T >= 0 && s.D > 0 && s.Hq > 0 && s.Hkv > 0 && s.Hq % s.Hkv == 0,
             "attention needs Hq divisible by Hkv and positive sizes (B=", s.B, " T=", s.T, " Hq=", s.Hq,
             " Hkv=", s.Hkv, " D=", s.D, ")");
  LOOM_CHECK(s.ldq >= std::ptrdiff_t(s.Hq) * s.D && s.ldkv >= std::ptrdiff_t(s.Hkv) * s.D &&
                 s.ldo >= std::ptrdiff_t(s.Hq) * s.D,
             "attention row strides must hold all heads (ldq=", s.ldq, " ldkv=", s.ldkv, " ldo=", s.ldo, ")");
}

}  // namespace loom::kernels

// The shapes of kernel calls that every device's kernels take (CPU and CUDA alike).
#pragma once

#include <loom/core/error.hpp>

#include <cstddef>

namespace loom::kernels {

//! Attention of queries q: B x T x Hq x D with row stride ldq (elements between consecutive (b, t)) over keys and
//! values k, v: B x Tk x Hkv x D with stride ldkv; out: B x T x Hq x D with stride ldo; lse: B x Hq x T, the per-row
//! log-sum-exp kept for backward. Query head h reads key/value head h / (Hq / Hkv) (multi-head: Hkv = Hq; GQA; MQA:
//! Hkv = 1). scale is usually 1/sqrt(D); it is double so that a double model scales exactly as PyTorch's (float
//! models round it to float). q, k, v may point into one fused qkv buffer.
//!
//! Causal self-attention (the default: Tk = -1, keys are the queries' own positions, causal) lets query i see keys
//! 0..i. A block of ring attention sets Tk (the keys' count) and causal: false lets every query see every key
//! (keys that all come before the queries); causal: true needs Tk = T (the diagonal block). Both devices' kernels
//! take blocks.
struct AttentionShape {
  int B, T, Hq, Hkv, D;
  std::ptrdiff_t ldq, ldkv, ldo;
  double scale;
  int Tk = -1;         //!< keys per sequence; -1: T
  bool causal = true;  //!< query i sees keys 0..i (else every key)

  constexpr int keys() const { return Tk < 0 ? T : Tk; }
  //! Whether this is plain causal self-attention (what every device's kernels compute).
  constexpr bool self_causal() const { return causal && keys() == T; }
};

//! The rules every device's attention kernels check: positive sizes, Hq a multiple of Hkv, strides that hold
//! every head, and a causal block only on the diagonal.
inline void check_shape(const AttentionShape& s) {
  LOOM_CHECK(s.B >= 0 && s.T >= 0 && s.D > 0 && s.Hq > 0 && s.Hkv > 0 && s.Hq % s.Hkv == 0,
             "attention needs Hq divisible by Hkv and positive sizes (B=", s.B, " T=", s.T, " Hq=", s.Hq,
             " Hkv=", s.Hkv, " D=", s.D, ")");
  LOOM_CHECK(s.ldq >= std::ptrdiff_t(s.Hq) * s.D && s.ldkv >= std::ptrdiff_t(s.Hkv) * s.D &&
                 s.ldo >= std::ptrdiff_t(s.Hq) * s.D,
             "attention row strides must hold all heads (ldq=", s.ldq, " ldkv=", s.ldkv, " ldo=", s.ldo, ")");
  LOOM_CHECK(s.keys() >= 0 && (!s.causal || s.keys() == s.T), "causal attention needs as many keys as queries (T=",
             s.T, " Tk=", s.keys(), "); a block of keys before the queries is causal: false");
  LOOM_CHECK(s.causal || s.keys() > 0 || s.T == 0, "attention without keys has no softmax (T=", s.T, " Tk=0)");
}

}  // namespace loom::kernels

// The shapes of kernel calls that every device's kernels take (CPU and CUDA alike).
#pragma once

#include <loom/core/error.hpp>

#include <cstddef>
#include <cstdint>

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

//! A run of elements an optimizer updates alike (Ops::adamw_runs): parameters [param, param + n) of the model's
//! flat buffer, their gradients at the same place of the gradient buffer, their state at [at, at + n) of the
//! optimizer's, with weight decay or without.
struct UpdateRun {
  std::int64_t param, at, n;
  bool decay;  //!< weight decay applies (matrices and embeddings)
};

//! One product of a group (Ops::matmul_group): C = alpha op(A) op(B) + beta C with op(A) m x k, op(B) k x n and C
//! m x n, row-major and dense, each product with sizes and operands of its own (a mixture of experts' products, one
//! per expert over the rows it received). The group shares the transposes, alpha and beta.
template <class T>
struct Product {
  const T* a;
  const T* b;
  T* c;
  int m, n, k;
};

//! The sizes of a group's products, refused where negative.
template <class T>
void check_group(const Product<T>* ps, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i)
    LOOM_CHECK(ps[i].m >= 0 && ps[i].n >= 0 && ps[i].k >= 0, "matmul_group: product ", i, " has a negative size (m=",
               ps[i].m, ", n=", ps[i].n, ", k=", ps[i].k, ")");
}

}  // namespace loom::kernels

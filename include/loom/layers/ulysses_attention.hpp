// Ulysses attention over the context-parallel (cp) ranks: an all-to-all turns the split of the sequence into a split
// of the heads, each rank computes causal attention over the whole sequence for its heads, and a second all-to-all
// turns the result back. The rows a rank holds are those of the zigzag split (ring_attention.hpp), so that the two
// algorithms take the same layout. Needs Hq and Hkv divisible by the cp ranks (key/value heads are not replicated).
// Per rank and layer, forward: all-to-alls of q, k, v and out (4 N h / P elements per rank for N tokens, width h
// and P ranks, with Hkv = Hq) and of the log-sum-exp (Hq N / P); backward: q, k, v, out, dout and the log-sum-exp
// again, then dq, dk and dv back.
#pragma once

#include <loom/layers/ring_attention.hpp>

#include <vector>

namespace loom::layers {

namespace detail {

//! Calls f(src, dst) for each row of each head group p of the all-to-all between this rank's rows (B x 2c, stride
//! ld, H heads of D) and the whole sequence (B x 2nc, in order) of its head group (H / n heads): src is the offset
//! of the row's first element in the send buffer (n blocks of B x 2c rows of (H / n) D), dst that of rank p's row in
//! the sequence.
template <class F>
void each_head_row(int n, int B, int c, F&& f) {
  for (int p = 0; p < n; ++p)
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < 2 * c; ++t) f(p, b, t, std::size_t(b) * 2 * n * c + zigzag_position(t, p, n, c));
}

//! This rank's rows (B x 2c, stride ld, H heads of D) to the whole sequence (B x 2nc, in order) of head group `cp
//! rank` (H / n heads): out is B x 2nc x (H / n) D.
template <class T, class Comm>
std::vector<T> to_heads(Comm& cp, const T* x, std::ptrdiff_t ld, int B, int c, int H, int D) {
  const int n = cp.size(), hw = H / n * D;
  const std::size_t block = std::size_t(B) * 2 * c * hw;
  std::vector<T> send(block * n), recv(block * n), out(std::size_t(B) * 2 * n * c * hw);
  each_head_row(n, B, c, [&](int p, int b, int t, std::size_t) {
    std::copy_n(x + (std::ptrdiff_t(b) * 2 * c + t) * ld + std::ptrdiff_t(p) * hw, hw,
                send.data() + p * block + (std::size_t(b) * 2 * c + t) * hw);
  });
  cp.all_to_all(send, recv);
  each_head_row(n, B, c, [&](int p, int b, int t, std::size_t at) {
    std::copy_n(recv.data() + p * block + (std::size_t(b) * 2 * c + t) * hw, hw, out.data() + at * hw);
  });
  return out;
}

//! The inverse of to_heads: the whole sequence of this rank's head group (B x 2nc x (H / n) D) back to this rank's
//! rows of every head, written to dst (stride ld).
template <class T, class Comm>
void to_rows(Comm& cp, const std::vector<T>& g, T* dst, std::ptrdiff_t ld, int B, int c, int H, int D) {
  const int n = cp.size(), hw = H / n * D;
  const std::size_t block = std::size_t(B) * 2 * c * hw;
  std::vector<T> send(block * n), recv(block * n);
  each_head_row(n, B, c, [&](int p, int b, int t, std::size_t at) {
    std::copy_n(g.data() + at * hw, hw, send.data() + p * block + (std::size_t(b) * 2 * c + t) * hw);
  });
  cp.all_to_all(send, recv);
  each_head_row(n, B, c, [&](int p, int b, int t, std::size_t) {
    std::copy_n(recv.data() + p * block + (std::size_t(b) * 2 * c + t) * hw, hw,
                dst + (std::ptrdiff_t(b) * 2 * c + t) * ld + std::ptrdiff_t(p) * hw);
  });
}

//! The log-sum-exp as rows of width 1 per head: local B x Hq x 2c <-> head group B x (Hq / n) x 2nc.
template <class A>
std::vector<A> lse_as_rows(const A* lse, int B, int H, int T) {  // B x H x T to B x T x H
  std::vector<A> rows(std::size_t(B) * T * H);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) rows[(std::size_t(b) * T + t) * H + h] = lse[(std::size_t(b) * H + h) * T + t];
  return rows;
}
template <class A>
void rows_as_lse(const std::vector<A>& rows, A* lse, int B, int H, int T) {  // B x T x H to B x H x T
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) lse[(std::size_t(b) * H + h) * T + t] = rows[(std::size_t(b) * T + t) * H + h];
}

template <class Comm>
void check_ulysses(const Comm& cp, const kernels::AttentionShape& s) {
  const int n = chunk_sizes(cp, s, "Ulysses attention").n;
  LOOM_CHECK(s.Hq % n == 0 && s.Hkv % n == 0, "Ulysses attention splits the heads over the ", n,
             " cp ranks: it needs heads (", s.Hq, ") and key/value heads (", s.Hkv, ") divisible by ", n,
             " (ring attention takes any)");
}

}  // namespace detail

//! Ulysses attention forward over the cp group: the arguments and the result are ring_attention_forward's.
template <class T, class Comm>
void ulysses_attention_forward(Comm& cp, const T* q, const T* k, const T* v, T* out, acc_t<T>* lse,
                               const kernels::AttentionShape& s) {
  using A = acc_t<T>;
  const int n = cp.size(), B = s.B, c = s.T / 2, hq = s.Hq / n, hkv = s.Hkv / n, Tg = 2 * n * c;
  detail::check_ulysses(cp, s);
  // q, k, v and out of the head split, an all-to-all's two buffers of the widest, the log-sum-exp three times.
  const std::size_t R = std::size_t(B) * 2 * c, wq = std::size_t(s.Hq) * s.D, wkv = std::size_t(s.Hkv) * s.D;
  const ChargedBytes workspace(MemoryUse::activations, R * (4 * wq + 2 * wkv) * sizeof(T) + 3 * R * s.Hq * sizeof(A));
  const auto Q = detail::to_heads(cp, q, s.ldq, B, c, s.Hq, s.D);
  const auto K = detail::to_heads(cp, k, s.ldkv, B, c, s.Hkv, s.D);
  const auto V = detail::to_heads(cp, v, s.ldkv, B, c, s.Hkv, s.D);
  std::vector<T> O(Q.size());
  std::vector<A> L(std::size_t(B) * hq * Tg);
  const kernels::AttentionShape g{B, Tg, hq, hkv, s.D, hq * s.D, hkv * s.D, hq * s.D, s.scale};
  kernels::cpu::attention_forward(Q.data(), K.data(), V.data(), O.data(), L.data(), g);
  detail::to_rows(cp, O, out, s.ldo, B, c, s.Hq, s.D);
  std::vector<A> rows(std::size_t(B) * 2 * c * s.Hq);
  detail::to_rows(cp, detail::lse_as_rows(L.data(), B, hq, Tg), rows.data(), s.Hq, B, c, s.Hq, 1);
  detail::rows_as_lse(rows, lse, B, s.Hq, 2 * c);
}

//! Ulysses attention backward: the arguments and the result are ring_attention_backward's.
template <class T, class Comm>
void ulysses_attention_backward(Comm& cp, const T* dout, const T* q, const T* k, const T* v, const T* out,
                                const acc_t<T>* lse, T* dq, T* dk, T* dv, const kernels::AttentionShape& s) {
  const int n = cp.size(), B = s.B, c = s.T / 2, hq = s.Hq / n, hkv = s.Hkv / n, Tg = 2 * n * c;
  detail::check_ulysses(cp, s);
  // q, k, v, out, dout and dq, dk, dv of the head split, an all-to-all's two buffers, the log-sum-exp three times.
  const std::size_t R = std::size_t(B) * 2 * c, wq = std::size_t(s.Hq) * s.D, wkv = std::size_t(s.Hkv) * s.D;
  const ChargedBytes workspace(MemoryUse::activations,
                               R * (6 * wq + 4 * wkv) * sizeof(T) + 3 * R * s.Hq * sizeof(acc_t<T>));
  const auto Q = detail::to_heads(cp, q, s.ldq, B, c, s.Hq, s.D);
  const auto K = detail::to_heads(cp, k, s.ldkv, B, c, s.Hkv, s.D);
  const auto V = detail::to_heads(cp, v, s.ldkv, B, c, s.Hkv, s.D);
  const auto O = detail::to_heads(cp, out, s.ldo, B, c, s.Hq, s.D);
  const auto dO = detail::to_heads(cp, dout, s.ldo, B, c, s.Hq, s.D);
  const auto rows = detail::lse_as_rows(lse, B, s.Hq, 2 * c);
  const auto lrows = detail::to_heads(cp, rows.data(), s.Hq, B, c, s.Hq, 1);
  std::vector<acc_t<T>> L(std::size_t(B) * hq * Tg);
  detail::rows_as_lse(lrows, L.data(), B, hq, Tg);
  std::vector<T> dQ(Q.size()), dK(K.size()), dV(V.size());
  const kernels::AttentionShape g{B, Tg, hq, hkv, s.D, hq * s.D, hkv * s.D, hq * s.D, s.scale};
  kernels::cpu::attention_backward(dO.data(), Q.data(), K.data(), V.data(), O.data(), L.data(), dQ.data(), dK.data(),
                                   dV.data(), g);
  detail::to_rows(cp, dQ, dq, s.ldq, B, c, s.Hq, s.D);
  detail::to_rows(cp, dK, dk, s.ldkv, B, c, s.Hkv, s.D);
  detail::to_rows(cp, dV, dv, s.ldkv, B, c, s.Hkv, s.D);
}

}  // namespace loom::layers

// Ulysses attention over the context-parallel (cp) ranks: an all-to-all turns the split of the sequence into a split
// of the heads, each rank computes causal attention over the whole sequence for its heads, and a second all-to-all
// turns the result back; on either device (the reorders around the all-to-alls are the device's Ops::copy_rows). The
// rows a rank holds are those of the zigzag split (ring_attention.hpp), so that the two algorithms take the same
// layout. Needs Hq and Hkv divisible by the cp ranks (key/value heads are not replicated).
// Per rank and layer, forward: all-to-alls of q, k, v and out (4 N h / P elements per rank for N tokens, width h
// and P ranks, with Hkv = Hq) and of the log-sum-exp (Hq N / P); backward: q, k, v, out, dout and the log-sum-exp
// again, then dq, dk and dv back.
#pragma once

#include <loom/layers/ring_attention.hpp>

#include <span>
#include <vector>

namespace loom::layers {

namespace detail {

//! This rank's rows (B x 2c, stride ld, H heads of D) to the whole sequence (B x 2nc, in order) of head group `cp
//! rank` (H / n heads): out is B x 2nc x (H / n) D, on the device of `ops`.
template <class T, class Comm, class Ops>
RingBuf<T, typename Ops::device> to_heads(Comm& cp, const Ops& ops, const T* x, std::ptrdiff_t ld, int B, int c,
                                          int H, int D) {
  using Dev = typename Ops::device;
  const int n = cp.size(), hw = H / n * D;
  const std::size_t block = std::size_t(B) * 2 * c * hw;
  auto send = ring_buf<T, Dev>(block * n), recv = ring_buf<T, Dev>(block * n),
       out = ring_buf<T, Dev>(std::size_t(B) * 2 * n * c * hw);
  for (int p = 0; p < n; ++p)  // head group p of every row, to rank p
    for (int b = 0; b < B; ++b)
      ops.copy_rows(x + std::ptrdiff_t(b) * 2 * c * ld + std::ptrdiff_t(p) * hw, ld,
                    send.data() + p * block + std::size_t(b) * 2 * c * hw, std::ptrdiff_t(hw), 2 * c, hw);
  {
    const auto ordered = cp.on_stream(kernels::stream_of(ops));  // on a device: after the copies that fill `send`
    cp.all_to_all(std::span<const T>(whole(send)), whole(recv));
  }
  for (int p = 0; p < n; ++p)  // rank p's two chunks of each sequence, where they sit in it
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < 2; ++j)
        ops.copy_rows(recv.data() + p * block + (std::size_t(b) * 2 * c + std::size_t(j) * c) * hw, std::ptrdiff_t(hw),
                      out.data() + (std::size_t(b) * 2 * n * c + std::size_t(zigzag_chunks(p, n)[j]) * c) * hw,
                      std::ptrdiff_t(hw), c, hw);
  ops.synchronize();  // on a device: send and recv go when this returns
  return out;
}

//! The inverse of to_heads: the whole sequence of this rank's head group (B x 2nc x (H / n) D) back to this rank's
//! rows of every head, written to dst (stride ld).
template <class T, class Comm, class Ops>
void to_rows(Comm& cp, const Ops& ops, const T* g, T* dst, std::ptrdiff_t ld, int B, int c, int H, int D) {
  using Dev = typename Ops::device;
  const int n = cp.size(), hw = H / n * D;
  const std::size_t block = std::size_t(B) * 2 * c * hw;
  auto send = ring_buf<T, Dev>(block * n), recv = ring_buf<T, Dev>(block * n);
  for (int p = 0; p < n; ++p)
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < 2; ++j)
        ops.copy_rows(g + (std::size_t(b) * 2 * n * c + std::size_t(zigzag_chunks(p, n)[j]) * c) * hw,
                      std::ptrdiff_t(hw), send.data() + p * block + (std::size_t(b) * 2 * c + std::size_t(j) * c) * hw,
                      std::ptrdiff_t(hw), c, hw);
  {
    const auto ordered = cp.on_stream(kernels::stream_of(ops));
    cp.all_to_all(std::span<const T>(whole(send)), whole(recv));
  }
  for (int p = 0; p < n; ++p)
    for (int b = 0; b < B; ++b)
      ops.copy_rows(recv.data() + p * block + std::size_t(b) * 2 * c * hw, std::ptrdiff_t(hw),
                    dst + std::ptrdiff_t(b) * 2 * c * ld + std::ptrdiff_t(p) * hw, ld, 2 * c, hw);
  ops.synchronize();
}

//! The log-sum-exp as rows of width 1 per head: B x H x T to B x T x H, and back.
template <class Ops, class A>
void lse_to_rows(const Ops& ops, const A* lse, A* rows, int B, int H, int T) {
  ops.transpose(lse, rows, B, H, T);
}
template <class Ops, class A>
void rows_to_lse(const Ops& ops, const A* rows, A* lse, int B, int H, int T) {
  ops.transpose(rows, lse, B, T, H);
}

template <class Comm>
void check_ulysses(const Comm& cp, const kernels::AttentionShape& s) {
  const int n = chunk_sizes(cp, s, "Ulysses attention").n;
  LOOM_CHECK(s.Hq % n == 0 && s.Hkv % n == 0, "Ulysses attention splits the heads over the ", n,
             " cp ranks: it needs heads (", s.Hq, ") and key/value heads (", s.Hkv, ") divisible by ", n,
             " (ring attention takes any)");
}

}  // namespace detail

//! Ulysses attention forward over the cp group, on the device of `ops`: the arguments and the result are
//! ring_attention_forward's.
template <class T, class Comm, class Ops>
void ulysses_attention_forward(Comm& cp, const Ops& ops, const T* q, const T* k, const T* v, T* out, acc_t<T>* lse,
                               const kernels::AttentionShape& s) {
  using A = acc_t<T>;
  using Dev = typename Ops::device;
  const int n = cp.size(), B = s.B, c = s.T / 2, hq = s.Hq / n, hkv = s.Hkv / n, Tg = 2 * n * c;
  detail::check_ulysses(cp, s);
  // q, k, v and out of the head split, an all-to-all's two buffers of the widest, the log-sum-exp three times.
  const std::size_t R = std::size_t(B) * 2 * c, wq = std::size_t(s.Hq) * s.D, wkv = std::size_t(s.Hkv) * s.D;
  const ChargedBytes workspace =
      detail::host_workspace<Dev>(R * (4 * wq + 2 * wkv) * sizeof(T) + 3 * R * s.Hq * sizeof(A));
  const auto Q = detail::to_heads(cp, ops, q, s.ldq, B, c, s.Hq, s.D);
  const auto K = detail::to_heads(cp, ops, k, s.ldkv, B, c, s.Hkv, s.D);
  const auto V = detail::to_heads(cp, ops, v, s.ldkv, B, c, s.Hkv, s.D);
  auto O = detail::ring_buf<T, Dev>(R * wq);
  auto L = detail::ring_buf<A, Dev>(std::size_t(B) * hq * Tg);
  auto heads = detail::ring_buf<A, Dev>(std::size_t(B) * hq * Tg), rows = detail::ring_buf<A, Dev>(R * s.Hq);
  const kernels::AttentionShape g{B, Tg, hq, hkv, s.D, hq * s.D, hkv * s.D, hq * s.D, s.scale};
  ops.attention_forward(Q.data(), K.data(), V.data(), O.data(), L.data(), g);
  detail::to_rows(cp, ops, static_cast<const T*>(O.data()), out, s.ldo, B, c, s.Hq, s.D);
  detail::lse_to_rows(ops, static_cast<const A*>(L.data()), heads.data(), B, hq, Tg);
  detail::to_rows(cp, ops, static_cast<const A*>(heads.data()), rows.data(), s.Hq, B, c, s.Hq, 1);
  detail::rows_to_lse(ops, static_cast<const A*>(rows.data()), lse, B, s.Hq, 2 * c);
  ops.synchronize();  // on a device: the buffers go when this returns
}

//! Ulysses attention backward, on the device of `ops`: the arguments and the result are ring_attention_backward's.
template <class T, class Comm, class Ops>
void ulysses_attention_backward(Comm& cp, const Ops& ops, const T* dout, const T* q, const T* k, const T* v,
                                const T* out, const acc_t<T>* lse, T* dq, T* dk, T* dv,
                                const kernels::AttentionShape& s) {
  using A = acc_t<T>;
  using Dev = typename Ops::device;
  const int n = cp.size(), B = s.B, c = s.T / 2, hq = s.Hq / n, hkv = s.Hkv / n, Tg = 2 * n * c;
  detail::check_ulysses(cp, s);
  // q, k, v, out, dout and dq, dk, dv of the head split, an all-to-all's two buffers, the log-sum-exp three times.
  const std::size_t R = std::size_t(B) * 2 * c, wq = std::size_t(s.Hq) * s.D, wkv = std::size_t(s.Hkv) * s.D;
  const ChargedBytes workspace =
      detail::host_workspace<Dev>(R * (6 * wq + 4 * wkv) * sizeof(T) + 3 * R * s.Hq * sizeof(A));
  const auto Q = detail::to_heads(cp, ops, q, s.ldq, B, c, s.Hq, s.D);
  const auto K = detail::to_heads(cp, ops, k, s.ldkv, B, c, s.Hkv, s.D);
  const auto V = detail::to_heads(cp, ops, v, s.ldkv, B, c, s.Hkv, s.D);
  const auto O = detail::to_heads(cp, ops, out, s.ldo, B, c, s.Hq, s.D);
  const auto dO = detail::to_heads(cp, ops, dout, s.ldo, B, c, s.Hq, s.D);
  auto rows = detail::ring_buf<A, Dev>(R * s.Hq), L = detail::ring_buf<A, Dev>(std::size_t(B) * hq * Tg);
  detail::lse_to_rows(ops, lse, rows.data(), B, s.Hq, 2 * c);
  const auto heads = detail::to_heads(cp, ops, static_cast<const A*>(rows.data()), s.Hq, B, c, s.Hq, 1);
  detail::rows_to_lse(ops, static_cast<const A*>(heads.data()), L.data(), B, hq, Tg);
  auto dQ = detail::ring_buf<T, Dev>(R * wq), dK = detail::ring_buf<T, Dev>(R * wkv),
       dV = detail::ring_buf<T, Dev>(R * wkv);
  const kernels::AttentionShape g{B, Tg, hq, hkv, s.D, hq * s.D, hkv * s.D, hq * s.D, s.scale};
  ops.attention_backward(dO.data(), Q.data(), K.data(), V.data(), O.data(), L.data(), dQ.data(), dK.data(),
                         dV.data(), g);
  detail::to_rows(cp, ops, static_cast<const T*>(dQ.data()), dq, s.ldq, B, c, s.Hq, s.D);
  detail::to_rows(cp, ops, static_cast<const T*>(dK.data()), dk, s.ldkv, B, c, s.Hkv, s.D);
  detail::to_rows(cp, ops, static_cast<const T*>(dV.data()), dv, s.ldkv, B, c, s.Hkv, s.D);
  ops.synchronize();
}

//! Ulysses attention on the host (kernels::Ops<Host>).
template <class T, class Comm>
void ulysses_attention_forward(Comm& cp, const T* q, const T* k, const T* v, T* out, acc_t<T>* lse,
                               const kernels::AttentionShape& s) {
  ulysses_attention_forward(cp, kernels::Ops<Host>{}, q, k, v, out, lse, s);
}
template <class T, class Comm>
void ulysses_attention_backward(Comm& cp, const T* dout, const T* q, const T* k, const T* v, const T* out,
                                const acc_t<T>* lse, T* dq, T* dk, T* dv, const kernels::AttentionShape& s) {
  ulysses_attention_backward(cp, kernels::Ops<Host>{}, dout, q, k, v, out, lse, dq, dk, dv, s);
}

}  // namespace loom::layers

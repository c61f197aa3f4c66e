// Ring attention over the context-parallel (cp) ranks, with the causal load balance of the zigzag split.
//
// The sequence of T tokens is cut into 2n chunks of c = T / 2n tokens for n cp ranks; rank r holds chunks r and
// 2n - 1 - r (its local rows: chunk r, then chunk 2n - 1 - r), so that under the causal mask every rank does the same
// work. Queries stay where they are; each rank's keys and values (its two chunks, all kv heads: with grouped-query
// attention only the shared heads travel) go around the ring, one hop per step, the next block's transfer running
// while the current block is computed. Of the four chunk pairs (query chunk, key chunk) of a step, the pairs whose
// keys all come after the queries are skipped, the diagonal is causal, and the rest are full: every rank computes two
// causal blocks at the first step and two full blocks at each other. Partial results merge by their log-sum-exp
// (the online softmax of the tiled kernel): out = Σ_b out_b · exp(lse_b - lse), lse = log Σ_b exp(lse_b).
//
// Backward: the key/value blocks go around the ring again; each rank adds its contribution to the gradient of the
// block it holds and passes that gradient on, so that after n steps each gradient comes home summed over every rank.
// Per rank and layer: forward n - 1 key/value rotations; backward n - 1 key/value rotations and n rotations of their
// gradient (in acc_t<T>). The buffers each call holds are charged to the rank's ledger as activations.
#pragma once

#include <loom/comm/types.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory.hpp>
#include <loom/kernels/cpu/ops.hpp>
#include <loom/kernels/shape.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <vector>

namespace loom::layers {

//! The two chunks (of 2n, in sequence order) that cp rank r of n holds, in the order of its local rows.
constexpr std::array<int, 2> zigzag_chunks(int r, int n) { return {r, 2 * n - 1 - r}; }

//! How the sequence is split over the cp ranks: the zigzag (balanced under the causal mask), or contiguous (rank r
//! holds chunks 2r and 2r + 1: the last rank does about 2n - 1 times the first one's work; for comparison only).
enum class SeqSplit { zigzag, contiguous };
constexpr std::array<int, 2> split_chunks(int r, int n, SeqSplit split) {
  return split == SeqSplit::zigzag ? zigzag_chunks(r, n) : std::array<int, 2>{2 * r, 2 * r + 1};
}

//! The position in the whole sequence of local row t of cp rank r of n, whose chunks hold c tokens each.
constexpr int split_position(int t, int r, int n, int c, SeqSplit split) {
  return split_chunks(r, n, split)[t < c ? 0 : 1] * c + t % c;
}
constexpr int zigzag_position(int t, int r, int n, int c) { return split_position(t, r, n, c, SeqSplit::zigzag); }


//! Checks that a sequence of T tokens splits over n cp ranks as the zigzag does (2n chunks of equal length).
inline void check_zigzag(int T, int n) {
  LOOM_CHECK(n >= 1 && T % (2 * n) == 0, "context parallelism over ", n, " ranks cuts each sequence into 2 x ", n,
             " = ", 2 * n, " chunks, but the sequence of ", T, " tokens is not a multiple of ", 2 * n);
}

namespace detail {

//! Chunk j (0 or 1) of each of B sequences of 2c rows (stride ld, w elements used) into dst: B x c x w.
template <class S, class D>
void gather_chunk(const S* src, std::ptrdiff_t ld, int B, int c, int w, int j, D* dst) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < c; ++t) {
      const S* row = src + (std::ptrdiff_t(b) * 2 * c + std::ptrdiff_t(j) * c + t) * ld;
      D* out = dst + (std::ptrdiff_t(b) * c + t) * w;
      for (int e = 0; e < w; ++e) out[e] = static_cast<D>(row[e]);
    }
}

//! The inverse: dst's chunk j of each sequence (stride ld) from src: B x c x w.
template <class S, class D>
void scatter_chunk(const S* src, int B, int c, int w, int j, D* dst, std::ptrdiff_t ld) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < c; ++t) {
      const S* row = src + (std::ptrdiff_t(b) * c + t) * w;
      D* out = dst + (std::ptrdiff_t(b) * 2 * c + std::ptrdiff_t(j) * c + t) * ld;
      for (int e = 0; e < w; ++e) out[e] = static_cast<D>(row[e]);
    }
}

//! What a ring step computes: for each of this rank's query chunks (0, 1) and the held key chunks (0, 1), whether
//! the pair is skipped, causal (the diagonal) or full.
enum class Block { skip, causal, full };
constexpr Block block_of(int r, int src, int n, int qi, int kj, SeqSplit split = SeqSplit::zigzag) {
  const int gq = split_chunks(r, n, split)[qi], gk = split_chunks(src, n, split)[kj];
  return gk > gq ? Block::skip : gk == gq ? Block::causal : Block::full;
}

//! The sizes of a rank's part: n ranks, rank r, B sequences of two c-row chunks, widths of q and kv rows, and the
//! elements of a chunk of q, of k or v, and of the log-sum-exp. Checks that s is a rank's two chunks of causal
//! self-attention.
struct ChunkSizes {
  int n, r, B, c, wq, wkv;
  std::size_t qn, kvn, ln;
};
template <class Comm>
ChunkSizes chunk_sizes(const Comm& cp, const kernels::AttentionShape& s, const char* what) {
  kernels::check_shape(s);
  LOOM_CHECK(s.self_causal() && s.T % 2 == 0, what, " takes a rank's two chunks of causal self-attention (an even "
             "number of local rows), got T=", s.T, " Tk=", s.keys(), " causal=", s.causal);
  const int B = s.B, c = s.T / 2, wq = s.Hq * s.D, wkv = s.Hkv * s.D;
  return {cp.size(), cp.rank(), B, c, wq, wkv, std::size_t(B) * c * wq, std::size_t(B) * c * wkv,
          std::size_t(B) * s.Hq * c};
}

//! k and v's chunks into kv: [K chunk 0, K chunk 1, V chunk 0, V chunk 1].
template <class T>
void gather_kv(const T* k, const T* v, const kernels::AttentionShape& s, const ChunkSizes& z, T* kv) {
  for (int j = 0; j < 2; ++j) {
    gather_chunk(k, s.ldkv, z.B, z.c, z.wkv, j, kv + j * z.kvn);
    gather_chunk(v, s.ldkv, z.B, z.c, z.wkv, j, kv + (2 + j) * z.kvn);
  }
}

//! Sends `out` to rank `to` and receives `in` from rank `from`, in one exchange: a hop around the ring.
template <class Comm, class U>
comm::Handle rotate(Comm& cp, const std::vector<U>& out, std::vector<U>& in, int to, int from) {
  return cp.exchange_async({comm::send_op(std::span<const U>(out), to), comm::recv_op(std::span<U>(in), from)});
}

//! The kernel's shape of a block: a chunk of queries over a chunk of keys, contiguous.
inline kernels::AttentionShape block_shape(const kernels::AttentionShape& s, const ChunkSizes& z, Block block) {
  return {z.B, z.c, s.Hq, s.Hkv, s.D, z.wq, z.wkv, z.wq, s.scale, z.c, block == Block::causal};
}

}  // namespace detail

//! Ring attention forward over the cp group `cp` (a communicator: rank(), size(), exchange_async). q, k, v, out and
//! lse are this rank's (s.T = 2c local rows per sequence, in zigzag order, or as `split` says; lse: B x Hq x 2c) and
//! s is the local causal self-attention's shape; the result equals causal attention over the whole sequence at these
//! rows.
template <class T, class Comm>
void ring_attention_forward(Comm& cp, const T* q, const T* k, const T* v, T* out, acc_t<T>* lse,
                            const kernels::AttentionShape& s, SeqSplit split = SeqSplit::zigzag) {
  using A = acc_t<T>;
  const detail::ChunkSizes z = detail::chunk_sizes(cp, s, "ring attention");
  const int n = z.n, r = z.r, B = z.B, c = z.c, wq = z.wq;
  const std::size_t qn = z.qn, kvn = z.kvn, ln = z.ln;
  // This rank's query chunks; the held key/value block as [K chunk 0, K chunk 1, V chunk 0, V chunk 1].
  const std::size_t blocks = n > 1 ? 8 * kvn : 4 * kvn;
  const ChargedBytes workspace(MemoryUse::activations, (3 * qn + blocks) * sizeof(T) + (2 * qn + 3 * ln) * sizeof(A));
  std::vector<T> Q(2 * qn), kv(4 * kvn), next(n > 1 ? 4 * kvn : 0), Ob(qn);
  std::vector<A> O(2 * qn, A(0)), L(2 * ln, -std::numeric_limits<A>::infinity()), Lb(ln);
  for (int j = 0; j < 2; ++j) detail::gather_chunk(q, s.ldq, B, c, wq, j, Q.data() + j * qn);
  detail::gather_kv(k, v, s, z, kv.data());
  const int to = (r + 1) % n, from = (r + n - 1) % n;
  for (int step = 0; step < n; ++step) {
    // The next block, while this one is computed.
    comm::Handle moving = step + 1 < n ? detail::rotate(cp, kv, next, to, from) : comm::Handle();
    const int src = (r + n - step) % n;
    for (int qi = 0; qi < 2; ++qi)
      for (int kj = 0; kj < 2; ++kj) {
        const auto block = detail::block_of(r, src, n, qi, kj, split);
        if (block == detail::Block::skip) continue;
        const kernels::AttentionShape bs = detail::block_shape(s, z, block);
        kernels::cpu::attention_forward(Q.data() + qi * qn, kv.data() + kj * kvn, kv.data() + (2 + kj) * kvn,
                                        Ob.data(), Lb.data(), bs);
        // Merge by log-sum-exp: rows [b][t], heads h.
        A* Oq = O.data() + qi * qn;
        A* Lq = L.data() + qi * ln;
        for (int b = 0; b < B; ++b)
          for (int h = 0; h < s.Hq; ++h)
            for (int t = 0; t < c; ++t) {
              const std::size_t li = (std::size_t(b) * s.Hq + h) * c + t;
              const A la = Lq[li], lb = Lb[li], m = std::max(la, lb);
              const A l = m + std::log(std::exp(la - m) + std::exp(lb - m));
              const A wa = std::exp(la - l), wb = std::exp(lb - l);
              A* o = Oq + (std::size_t(b) * c + t) * wq + std::size_t(h) * s.D;
              const T* ob = Ob.data() + (std::size_t(b) * c + t) * wq + std::size_t(h) * s.D;
              for (int d = 0; d < s.D; ++d) o[d] = o[d] * wa + static_cast<A>(ob[d]) * wb;
              Lq[li] = l;
            }
      }
    if (step + 1 < n) {
      moving.wait();
      kv.swap(next);
    }
  }
  for (int j = 0; j < 2; ++j) {
    detail::scatter_chunk(O.data() + j * qn, B, c, wq, j, out, s.ldo);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.Hq; ++h)
        std::copy_n(L.data() + j * ln + (std::size_t(b) * s.Hq + h) * c, c,
                    lse + (std::size_t(b) * s.Hq + h) * 2 * c + std::size_t(j) * c);
  }
}

//! Ring attention backward: dq, dk, dv (written; strides as q, k, v) of this rank's rows from dout, and the out and
//! lse that ring_attention_forward gave. Collective over `cp`, as forward.
template <class T, class Comm>
void ring_attention_backward(Comm& cp, const T* dout, const T* q, const T* k, const T* v, const T* out,
                             const acc_t<T>* lse, T* dq, T* dk, T* dv, const kernels::AttentionShape& s,
                             SeqSplit split = SeqSplit::zigzag) {
  using A = acc_t<T>;
  const detail::ChunkSizes z = detail::chunk_sizes(cp, s, "ring attention");
  const int n = z.n, r = z.r, B = z.B, c = z.c, wq = z.wq, wkv = z.wkv;
  const std::size_t qn = z.qn, kvn = z.kvn, ln = z.ln, blocks = n > 1 ? 8 * kvn : 4 * kvn;
  const std::size_t passed = n > 1 ? 4 * kvn : 0;  // the gradient sum on its way to the next rank
  const std::size_t held = (7 * qn + blocks + 2 * kvn) * sizeof(T) + (2 * ln + 2 * qn + blocks + passed) * sizeof(A);
  const ChargedBytes workspace(MemoryUse::activations, held);
  std::vector<T> Q(2 * qn), dO(2 * qn), O(2 * qn), kv(4 * kvn), next(n > 1 ? 4 * kvn : 0);
  std::vector<A> L(2 * ln);
  detail::gather_kv(k, v, s, z, kv.data());
  for (int j = 0; j < 2; ++j) {
    detail::gather_chunk(q, s.ldq, B, c, wq, j, Q.data() + j * qn);
    detail::gather_chunk(dout, s.ldo, B, c, wq, j, dO.data() + j * qn);
    detail::gather_chunk(out, s.ldo, B, c, wq, j, O.data() + j * qn);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < s.Hq; ++h)
        std::copy_n(lse + (std::size_t(b) * s.Hq + h) * 2 * c + std::size_t(j) * c, c,
                    L.data() + j * ln + (std::size_t(b) * s.Hq + h) * c);
  }
  // dQ sums over the steps; dKV is the gradient of the held block, [dK 0, dK 1, dV 0, dV 1]: this rank's part (mine)
  // plus the part the ranks before it added (in). At the end of each step the sum goes on to the next rank and the
  // part of the next block comes in, in one exchange that runs while the next step computes.
  std::vector<A> dQ(2 * qn, A(0)), mine(4 * kvn), in(n > 1 ? 4 * kvn : 0), sending(n > 1 ? 4 * kvn : 0);
  std::vector<T> dqb(qn), dkb(kvn), dvb(kvn);
  const int to = (r + 1) % n, from = (r + n - 1) % n;
  comm::Handle passing;
  for (int step = 0; step < n; ++step) {
    comm::Handle moving = step + 1 < n ? detail::rotate(cp, kv, next, to, from) : comm::Handle();
    const int src = (r + n - step) % n;
    std::fill(mine.begin(), mine.end(), A(0));
    for (int qi = 0; qi < 2; ++qi)
      for (int kj = 0; kj < 2; ++kj) {
        const auto block = detail::block_of(r, src, n, qi, kj, split);
        if (block == detail::Block::skip) continue;
        const kernels::AttentionShape bs = detail::block_shape(s, z, block);
        kernels::cpu::attention_backward(dO.data() + qi * qn, Q.data() + qi * qn, kv.data() + kj * kvn,
                                         kv.data() + (2 + kj) * kvn, O.data() + qi * qn, L.data() + qi * ln,
                                         dqb.data(), dkb.data(), dvb.data(), bs);
        for (std::size_t e = 0; e < qn; ++e) dQ[qi * qn + e] += static_cast<A>(dqb[e]);
        for (std::size_t e = 0; e < kvn; ++e) {
          mine[kj * kvn + e] += static_cast<A>(dkb[e]);
          mine[(2 + kj) * kvn + e] += static_cast<A>(dvb[e]);
        }
      }
    if (step > 0) {
      passing.wait();
      for (std::size_t e = 0; e < mine.size(); ++e) mine[e] += in[e];
    }
    if (n > 1) {
      sending.swap(mine);
      static_cast<void>(passing = detail::rotate(cp, sending, in, to, from));  // the last one was waited for
    }
    if (step + 1 < n) {
      moving.wait();
      kv.swap(next);
    }
  }
  // The gradient of this rank's own block, summed over every rank, comes back from the rank before.
  if (n > 1) passing.wait();
  const std::vector<A>& total = n > 1 ? in : mine;
  for (int j = 0; j < 2; ++j) {
    detail::scatter_chunk(dQ.data() + j * qn, B, c, wq, j, dq, s.ldq);
    detail::scatter_chunk(total.data() + j * kvn, B, c, wkv, j, dk, s.ldkv);
    detail::scatter_chunk(total.data() + (2 + j) * kvn, B, c, wkv, j, dv, s.ldkv);
  }
}

}  // namespace loom::layers

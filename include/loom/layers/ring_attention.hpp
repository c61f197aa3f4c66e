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
#include <loom/kernels/ops.hpp>
#include <loom/kernels/shape.hpp>
#include <loom/tensor/tensor.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <type_traits>
#include <utility>
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

//! A buffer of ring attention: host memory, or the device's.
template <class U, class Dev>
using RingBuf = std::conditional_t<std::is_same_v<Dev, Host>, std::vector<U>, Tensor<U, Dev>>;
template <class U, class Dev>
RingBuf<U, Dev> ring_buf(std::size_t n) {
  if constexpr (std::is_same_v<Dev, Host>) return std::vector<U>(n);
  else return Tensor<U, Dev>({static_cast<std::int64_t>(n)});
}
//! The workspace's bytes charged to the rank's host-memory ledger: on a device, none (the ledger counts host memory).
template <class Dev>
ChargedBytes host_workspace(std::size_t bytes) {
  return ChargedBytes(MemoryUse::activations, std::is_same_v<Dev, Host> ? bytes : 0);
}
template <class U>
std::span<U> whole(std::vector<U>& b) {
  return b;
}
template <class U, class Dev>
std::span<U> whole(Tensor<U, Dev>& b) {
  return b.span();
}

//! Chunk j (0 or 1) of each of B sequences of 2c rows (stride ld, w elements used) into dst: B x c x w.
template <class Ops, class S, class D>
void gather_chunk(const Ops& ops, const S* src, std::ptrdiff_t ld, int B, int c, int w, int j, D* dst) {
  for (int b = 0; b < B; ++b)
    ops.copy_rows(src + (std::ptrdiff_t(b) * 2 * c + std::ptrdiff_t(j) * c) * ld, ld,
                  dst + std::ptrdiff_t(b) * c * w, std::ptrdiff_t(w), c, w);
}

//! The inverse: src (B x c x w) into chunk j of each sequence of dst (stride ld).
template <class Ops, class S, class D>
void scatter_chunk(const Ops& ops, const S* src, int B, int c, int w, int j, D* dst, std::ptrdiff_t ld) {
  for (int b = 0; b < B; ++b)
    ops.copy_rows(src + std::ptrdiff_t(b) * c * w, std::ptrdiff_t(w),
                  dst + (std::ptrdiff_t(b) * 2 * c + std::ptrdiff_t(j) * c) * ld, ld, c, w);
}

//! Chunk j of a log-sum-exp laid out as B x H x 2c rows, into one of B x H x c; and back.
template <class Ops, class A>
void lse_of_chunk(const Ops& ops, const A* whole, A* chunk, int B, int H, int c, int j) {
  for (int b = 0; b < B; ++b)
    ops.copy_rows(whole + std::ptrdiff_t(b) * H * 2 * c + std::ptrdiff_t(j) * c, std::ptrdiff_t(2) * c,
                  chunk + std::ptrdiff_t(b) * H * c, std::ptrdiff_t(c), H, c);
}
template <class Ops, class A>
void lse_to_chunk(const Ops& ops, const A* chunk, A* whole, int B, int H, int c, int j) {
  for (int b = 0; b < B; ++b)
    ops.copy_rows(chunk + std::ptrdiff_t(b) * H * c, std::ptrdiff_t(c),
                  whole + std::ptrdiff_t(b) * H * 2 * c + std::ptrdiff_t(j) * c, std::ptrdiff_t(2) * c, H, c);
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
template <class Ops, class T>
void gather_kv(const Ops& ops, const T* k, const T* v, const kernels::AttentionShape& s, const ChunkSizes& z, T* kv) {
  for (int j = 0; j < 2; ++j) {
    gather_chunk(ops, k, s.ldkv, z.B, z.c, z.wkv, j, kv + j * z.kvn);
    gather_chunk(ops, v, s.ldkv, z.B, z.c, z.wkv, j, kv + (2 + j) * z.kvn);
  }
}

//! Sends `out` to rank `to` and receives `in` from rank `from`, in one exchange: a hop around the ring.
template <class Comm, class Buf>
comm::Handle rotate(Comm& cp, Buf& out, Buf& in, int to, int from) {
  using U = std::remove_pointer_t<decltype(out.data())>;
  return cp.exchange_async({comm::send_op(std::span<const U>(whole(out)), to), comm::recv_op(whole(in), from)});
}

//! The kernel's shape of a block: a chunk of queries over a chunk of keys, contiguous.
inline kernels::AttentionShape block_shape(const kernels::AttentionShape& s, const ChunkSizes& z, Block block) {
  return {z.B, z.c, s.Hq, s.Hkv, s.D, z.wq, z.wkv, z.wq, s.scale, z.c, block == Block::causal};
}

}  // namespace detail

//! Ring attention forward over the cp group `cp` (a communicator: rank(), size(), exchange_async), on the device of
//! `ops` (kernels::Ops<Dev>: q, k, v, out and lse in its memory). q, k, v, out and lse are this rank's (s.T = 2c
//! local rows per sequence, in zigzag order, or as `split` says; lse: B x Hq x 2c) and s is the local causal
//! self-attention's shape; the result equals causal attention over the whole sequence at these rows. On a device the
//! exchanges are ordered on the stream of `ops` (comm::Frontend::on_stream): a block is sent once the kernels that
//! wrote it are done, and a buffer is received into once the kernels that read it are.
template <class T, class Comm, class Ops>
void ring_attention_forward(Comm& cp, const Ops& ops, const T* q, const T* k, const T* v, T* out, acc_t<T>* lse,
                            const kernels::AttentionShape& s, SeqSplit split = SeqSplit::zigzag) {
  using A = acc_t<T>;
  using Dev = typename Ops::device;
  const detail::ChunkSizes z = detail::chunk_sizes(cp, s, "ring attention");
  const int n = z.n, r = z.r, B = z.B, c = z.c, wq = z.wq;
  const std::size_t qn = z.qn, kvn = z.kvn, ln = z.ln;
  // This rank's query chunks; the held key/value block as [K chunk 0, K chunk 1, V chunk 0, V chunk 1].
  const std::size_t blocks = n > 1 ? 8 * kvn : 4 * kvn;
  const ChargedBytes workspace =
      detail::host_workspace<Dev>((3 * qn + blocks) * sizeof(T) + (2 * qn + 3 * ln) * sizeof(A));
  auto Q = detail::ring_buf<T, Dev>(2 * qn), kv = detail::ring_buf<T, Dev>(4 * kvn),
       next = detail::ring_buf<T, Dev>(n > 1 ? 4 * kvn : 0), Ob = detail::ring_buf<T, Dev>(qn);
  auto O = detail::ring_buf<A, Dev>(2 * qn), L = detail::ring_buf<A, Dev>(2 * ln), Lb = detail::ring_buf<A, Dev>(ln);
  ops.fill(O.data(), 2 * qn, A(0));
  ops.fill(L.data(), 2 * ln, -std::numeric_limits<A>::infinity());
  for (int j = 0; j < 2; ++j) detail::gather_chunk(ops, q, s.ldq, B, c, wq, j, Q.data() + j * qn);
  detail::gather_kv(ops, k, v, s, z, kv.data());
  const int to = (r + 1) % n, from = (r + n - 1) % n;
  // On a device each exchange is ordered on the stream: it sends once the kernels that wrote the block are done and
  // receives once those that read the buffer are, and the kernels after its wait() read what it received.
  const auto ordered = cp.on_stream(kernels::stream_of(ops));
  for (int step = 0; step < n; ++step) {
    // The next block, while this one is computed.
    comm::Handle moving = step + 1 < n ? detail::rotate(cp, kv, next, to, from) : comm::Handle();
    const int src = (r + n - step) % n;
    for (int qi = 0; qi < 2; ++qi)
      for (int kj = 0; kj < 2; ++kj) {
        const auto block = detail::block_of(r, src, n, qi, kj, split);
        if (block == detail::Block::skip) continue;
        const kernels::AttentionShape bs = detail::block_shape(s, z, block);
        ops.attention_forward(Q.data() + qi * qn, kv.data() + kj * kvn, kv.data() + (2 + kj) * kvn, Ob.data(),
                              Lb.data(), bs);
        ops.lse_merge(O.data() + qi * qn, L.data() + qi * ln, Ob.data(), Lb.data(), B, s.Hq, c, s.D,
                      std::ptrdiff_t(wq));
      }
    if (step + 1 < n) {
      moving.wait();
      std::swap(kv, next);
    }
  }
  for (int j = 0; j < 2; ++j) {
    detail::scatter_chunk(ops, O.data() + j * qn, B, c, wq, j, out, s.ldo);
    detail::lse_to_chunk(ops, static_cast<const A*>(L.data() + j * ln), lse, B, s.Hq, c, j);
  }
  ops.synchronize();  // on a device: the buffers go when the function returns
}

//! Ring attention backward: dq, dk, dv (written; strides as q, k, v) of this rank's rows from dout, and the out and
//! lse that ring_attention_forward gave. Collective over `cp`, as forward, on the device of `ops`.
template <class T, class Comm, class Ops>
void ring_attention_backward(Comm& cp, const Ops& ops, const T* dout, const T* q, const T* k, const T* v,
                             const T* out, const acc_t<T>* lse, T* dq, T* dk, T* dv, const kernels::AttentionShape& s,
                             SeqSplit split = SeqSplit::zigzag) {
  using A = acc_t<T>;
  using Dev = typename Ops::device;
  const detail::ChunkSizes z = detail::chunk_sizes(cp, s, "ring attention");
  const int n = z.n, r = z.r, B = z.B, c = z.c, wq = z.wq, wkv = z.wkv;
  const std::size_t qn = z.qn, kvn = z.kvn, ln = z.ln, blocks = n > 1 ? 8 * kvn : 4 * kvn;
  const std::size_t passed = n > 1 ? 4 * kvn : 0;  // the gradient sum on its way to the next rank
  const std::size_t held = (7 * qn + blocks + 2 * kvn) * sizeof(T) + (2 * ln + 2 * qn + blocks + passed) * sizeof(A);
  const ChargedBytes workspace = detail::host_workspace<Dev>(held);
  auto Q = detail::ring_buf<T, Dev>(2 * qn), dO = detail::ring_buf<T, Dev>(2 * qn),
       O = detail::ring_buf<T, Dev>(2 * qn), kv = detail::ring_buf<T, Dev>(4 * kvn),
       next = detail::ring_buf<T, Dev>(n > 1 ? 4 * kvn : 0);
  auto L = detail::ring_buf<A, Dev>(2 * ln);
  detail::gather_kv(ops, k, v, s, z, kv.data());
  for (int j = 0; j < 2; ++j) {
    detail::gather_chunk(ops, q, s.ldq, B, c, wq, j, Q.data() + j * qn);
    detail::gather_chunk(ops, dout, s.ldo, B, c, wq, j, dO.data() + j * qn);
    detail::gather_chunk(ops, out, s.ldo, B, c, wq, j, O.data() + j * qn);
    detail::lse_of_chunk(ops, lse, L.data() + j * ln, B, s.Hq, c, j);
  }
  // dQ sums over the steps; dKV is the gradient of the held block, [dK 0, dK 1, dV 0, dV 1]: this rank's part (mine)
  // plus the part the ranks before it added (in). At the end of each step the sum goes on to the next rank and the
  // part of the next block comes in, in one exchange that runs while the next step computes.
  auto dQ = detail::ring_buf<A, Dev>(2 * qn), mine = detail::ring_buf<A, Dev>(4 * kvn),
       in = detail::ring_buf<A, Dev>(n > 1 ? 4 * kvn : 0), sending = detail::ring_buf<A, Dev>(n > 1 ? 4 * kvn : 0);
  auto dqb = detail::ring_buf<T, Dev>(qn), dkb = detail::ring_buf<T, Dev>(kvn), dvb = detail::ring_buf<T, Dev>(kvn);
  ops.fill(dQ.data(), 2 * qn, A(0));
  const int to = (r + 1) % n, from = (r + n - 1) % n;
  const auto ordered = cp.on_stream(kernels::stream_of(ops));  // as forward's exchanges
  comm::Handle passing;
  for (int step = 0; step < n; ++step) {
    comm::Handle moving = step + 1 < n ? detail::rotate(cp, kv, next, to, from) : comm::Handle();
    const int src = (r + n - step) % n;
    ops.fill(mine.data(), 4 * kvn, A(0));
    for (int qi = 0; qi < 2; ++qi)
      for (int kj = 0; kj < 2; ++kj) {
        const auto block = detail::block_of(r, src, n, qi, kj, split);
        if (block == detail::Block::skip) continue;
        const kernels::AttentionShape bs = detail::block_shape(s, z, block);
        ops.attention_backward(dO.data() + qi * qn, Q.data() + qi * qn, kv.data() + kj * kvn,
                               kv.data() + (2 + kj) * kvn, O.data() + qi * qn, L.data() + qi * ln, dqb.data(),
                               dkb.data(), dvb.data(), bs);
        ops.accumulate_wide(dqb.data(), dQ.data() + qi * qn, qn);
        ops.accumulate_wide(dkb.data(), mine.data() + kj * kvn, kvn);
        ops.accumulate_wide(dvb.data(), mine.data() + (2 + kj) * kvn, kvn);
      }
    if (step > 0) {
      passing.wait();
      ops.accumulate(in.data(), mine.data(), 4 * kvn);
    }
    if (n > 1) {  // ordered after the kernels that compute the sum and read `in`
      std::swap(sending, mine);
      static_cast<void>(passing = detail::rotate(cp, sending, in, to, from));  // the last one was waited for
    }
    if (step + 1 < n) {
      moving.wait();
      std::swap(kv, next);
    }
  }
  // The gradient of this rank's own block, summed over every rank, comes back from the rank before.
  if (n > 1) passing.wait();
  const auto& total = n > 1 ? in : mine;
  for (int j = 0; j < 2; ++j) {
    detail::scatter_chunk(ops, dQ.data() + j * qn, B, c, wq, j, dq, s.ldq);
    detail::scatter_chunk(ops, total.data() + j * kvn, B, c, wkv, j, dk, s.ldkv);
    detail::scatter_chunk(ops, total.data() + (2 + j) * kvn, B, c, wkv, j, dv, s.ldkv);
  }
  ops.synchronize();  // on a device: the buffers go when the function returns
}

//! Ring attention on the host (kernels::Ops<Host>).
template <class T, class Comm>
void ring_attention_forward(Comm& cp, const T* q, const T* k, const T* v, T* out, acc_t<T>* lse,
                            const kernels::AttentionShape& s, SeqSplit split = SeqSplit::zigzag) {
  ring_attention_forward(cp, kernels::Ops<Host>{}, q, k, v, out, lse, s, split);
}
template <class T, class Comm>
void ring_attention_backward(Comm& cp, const T* dout, const T* q, const T* k, const T* v, const T* out,
                             const acc_t<T>* lse, T* dq, T* dk, T* dv, const kernels::AttentionShape& s,
                             SeqSplit split = SeqSplit::zigzag) {
  ring_attention_backward(cp, kernels::Ops<Host>{}, dout, q, k, v, out, lse, dq, dk, dv, s, split);
}

}  // namespace loom::layers

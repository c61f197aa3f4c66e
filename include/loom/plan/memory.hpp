// Memory per rank, by category, of a model trained on a layout: what each rank holds at its peak. Under loom's
// recipe the count follows the declarations loom trains from: the parameter table of each part (each_param walks
// it in models::gpt_param_specs' order, with each parameter's local size on a tensor- and expert-parallel rank),
// the gradient buckets and ZeRO's pieces as train::make_buckets and train::ShardPlan cut them, the activation slots
// each pipeline schedule keeps (pipeline::activation_bound), and the tensors models::GptActivations makes for a slot.
// Under Megatron-LM's recipe it is Korthikanti et al. 2022's formulas. Everything here is constexpr: the same
// arithmetic answers loom-plan at run time and plan::fits at compile time.
#pragma once

#include <loom/layers/moe_router.hpp>
#include <loom/plan/layout.hpp>
#include <loom/plan/model.hpp>
#include <loom/tensor/placement.hpp>

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

namespace loom::plan {

//! Bytes by category, loom-plan's and the ledger's (core/memory.hpp) names: parameters (with ZeRO-3's gathered
//! units), gradients, optimizer (the optimizer's state and fp32 master weights), activations (with the transient
//! workspaces of ring and Ulysses attention), buffers (communication buffers: gradient reductions, gathers, a mixture
//! of experts' all-to-alls), other (RoPE's tables).
struct Bytes {
  double parameters = 0, gradients = 0, optimizer = 0, activations = 0, buffers = 0, other = 0;
  constexpr double total() const { return parameters + gradients + optimizer + activations + buffers + other; }
  //! The training state: parameters, gradients, optimizer.
  constexpr double state() const { return parameters + gradients + optimizer; }
  //! Each category's larger of the two.
  constexpr Bytes max(const Bytes& o) const {
    return {std::max(parameters, o.parameters), std::max(gradients, o.gradients), std::max(optimizer, o.optimizer),
            std::max(activations, o.activations), std::max(buffers, o.buffers), std::max(other, o.other)};
  }
};

//! The most loaded rank's memory: its bytes by category at their peaks, their sum (the peak, which the categories
//! reach together: the last micro-batch's backward), and the pipeline stage it belongs to.
struct Memory {
  Bytes bytes;
  //! What the rank holds between steps (parameters, gradients and optimizer state; nothing else outlives a step):
  //! under ZeRO-3 its chunks of the parameters, from ZeRO-2 on its chunks of the gradients.
  Bytes held;
  double peak = 0;
  int stage = 0;
  //! The largest category's name and bytes.
  constexpr std::pair<std::string_view, double> largest() const {
    std::pair<std::string_view, double> m{"parameters", bytes.parameters};
    auto more = [&](std::string_view n, double b) {
      if (b > m.second) m = {n, b};
    };
    more("gradients", bytes.gradients), more("optimizer", bytes.optimizer), more("activations", bytes.activations);
    more("buffers", bytes.buffers), more("other", bytes.other);
    return m;
  }
};

namespace detail {

//! One parameter of a part's table: its elements on the rank, whether it is an expert's, and the ZeRO-3 unit that
//! holds it (0 the embedding, 1 + i block first + i, then the head: the final norm and lm_head).
struct ParamDecl {
  std::int64_t numel;
  bool expert;
  int unit;
};

//! f(ParamDecl) for each parameter of blocks [first, last) of shape s, with the embedding and the output layer where
//! the part holds them, on tensor-parallel rank tp_rank of tp and expert-parallel rank 0 of ep, in
//! models::gpt_param_specs' order, with the sizes its placements give that rank.
template <class F>
constexpr void each_param(const GptShape& s, int tp, int tp_rank, int first, int last, bool embedding, bool head,
                          int ep, F&& f) {
  const std::int64_t d = s.d_model, hd = s.head_dim();
  const int head_unit = 1 + (last - first);
  auto split = [&](std::int64_t n) { return units_of(n, tp, tp_rank).count; };
  const std::int64_t vocab_rows = split(s.vocab);
  const bool rms = s.norm == models::NormKind::rms;
  auto norm = [&](int unit) {
    f(ParamDecl{d, false, unit});
    if (!rms) f(ParamDecl{d, false, unit});
  };
  auto linear = [&](std::int64_t in, std::int64_t out, bool bias, bool column, int unit, bool expert = false) {
    f(ParamDecl{in * out, expert, unit});
    if (bias) f(ParamDecl{column ? out : d, expert, unit});
  };
  auto mlp = [&](std::int64_t width, int unit) {  // column-parallel up (gate and up), row-parallel down
    const std::int64_t up = (s.gated() ? 2 : 1) * split(width);
    linear(d, up, s.bias, true, unit);
    linear(split(width), d, s.bias, false, unit);
  };
  if (embedding || (s.tied && head)) f(ParamDecl{vocab_rows * d, false, embedding ? 0 : head_unit});
  if (embedding && !s.rope()) f(ParamDecl{std::int64_t{s.max_seq} * d, false, 0});
  for (int l = first; l < last; ++l) {
    const int u = 1 + (l - first);
    norm(u);
    const std::int64_t kv = units_of(s.kv_heads, tp, tp_rank).count, hq = split(s.heads);
    linear(d, (hq + 2 * kv) * hd, s.bias, true, u);
    linear(hq * hd, d, s.bias, false, u);
    norm(u);
    if (!s.moe_block(l)) {
      mlp(s.ffn(), u);
      continue;
    }
    f(ParamDecl{d * s.experts, false, u});
    if (s.shared_experts > 0) mlp(std::int64_t{s.shared_experts} * s.expert_width(), u);
    const std::int64_t w = s.expert_width(), up = (s.gated() ? 2 : 1) * w;
    for (int e = 0; e < s.experts / ep; ++e) {
      f(ParamDecl{d * up, true, u});
      if (s.bias) f(ParamDecl{up, true, u});
      f(ParamDecl{w * d, true, u});
      if (s.bias) f(ParamDecl{d, true, u});
    }
  }
  if (head) {
    norm(head_unit);
    if (!s.tied) f(ParamDecl{vocab_rows * d, false, head_unit});
  }
}
//! The same for blocks [first, last) of a part that holds the embedding with block 0 and the output layer with the
//! last block (loom's parts).
template <class F>
constexpr void each_param(const GptShape& s, int tp, int tp_rank, int first, int last, int ep, F&& f) {
  each_param(s, tp, tp_rank, first, last, first == 0, last == s.layers, ep, static_cast<F&&>(f));
}

//! Elements of a piece of len elements that rank 0 of n owns (ShardPlan: chunks of ceil(len / n)).
constexpr std::int64_t own_of(std::int64_t len, int n) { return n <= 1 ? len : std::min(len, (len + n - 1) / n); }

//! What a part holds on rank 0 of its tensor-, expert- and data-parallel groups (the most loaded: the first ranks
//! take the larger rows of an uneven split, and chunk 0 of every ZeRO piece is whole).
struct PartState {
  std::int64_t params = 0;        //!< elements of the part on the rank
  std::int64_t shard = 0;         //!< elements of its ZeRO shard (params without ZeRO)
  std::int64_t max_chunk = 0;     //!< the largest piece's chunk
  std::int64_t padded_stage = 0;  //!< the largest chunk x (n + 1) of a padded piece (its staging copy)
  std::int64_t gathered = 0;      //!< ZeRO-3: the most elements of others' chunks held at once
  std::int64_t sending = 0;       //!< ZeRO-3: the copies of its own chunks two gathers in flight send
};

//! A gradient bucket of a part: its parameters [first, last) of the part's table.
struct BucketRange {
  std::size_t first, last;
};
//! The buckets the trainer cuts a part's parameters ps into, from the last parameter back: ZeRO-3's by unit
//! (train::unit_buckets_of), the others' of bucket_bytes or more (train::make_buckets); a bucket also ends at the
//! first parameter and where the experts' parameters start or end.
constexpr std::vector<BucketRange> cut_buckets(const std::vector<ParamDecl>& ps, bool by_unit, std::int64_t elem,
                                               std::int64_t bucket_bytes) {
  std::vector<BucketRange> out;
  std::size_t end = ps.size();
  std::int64_t acc = 0;
  for (std::size_t i = ps.size(); i-- > 0;) {
    acc += ps[i].numel * elem;
    const bool edge = i == 0 || ps[i - 1].expert != ps[i].expert;
    if (edge || (by_unit ? ps[i - 1].unit != ps[i].unit : acc >= bucket_bytes))
      out.push_back({i, end}), end = i, acc = 0;
  }
  return out;
}

//! The part's parameters and its pieces under ZeRO: stages 1 and 2 cut the gradient buckets (train::make_buckets:
//! from the last parameter back, a bucket closed when it reaches bucket_bytes, at the first parameter, or where
//! the experts' parameters start or end), stage 3 the units (the embedding, each block, the head; a block's experts
//! a piece of their own). Expert pieces are sharded over the expert-data-parallel ranks, the others over the ZeRO
//! group (train::ShardPlan).
constexpr PartState part_state(const GptShape& s, const Layout& l, int first, int last, std::int64_t elem,
                               std::int64_t bucket_bytes) {
  PartState st;
  std::vector<ParamDecl> ps;
  each_param(s, l.tp, 0, first, last, l.ep, [&](ParamDecl p) { ps.push_back(p), st.params += p.numel; });
  if (l.zero == 0) {
    st.shard = st.params;
    return st;
  }
  const int n = l.zero_ranks(), ne = l.ep > 1 ? l.edp() : n;
  struct Piece {
    std::int64_t len;
    bool expert;
    int unit;
  };
  std::vector<Piece> pieces;
  for (const BucketRange& b : cut_buckets(ps, l.zero == 3, elem, bucket_bytes)) {
    std::int64_t len = 0;
    for (std::size_t i = b.first; i < b.last; ++i) len += ps[i].numel;
    pieces.push_back({len, ps[b.first].expert, l.zero == 3 ? ps[b.first].unit : 0});
  }
  const int units = 2 + (last - first);
  std::vector<std::int64_t> others(static_cast<std::size_t>(units), 0), chunks(static_cast<std::size_t>(units), 0);
  for (const Piece& p : pieces) {
    const int r = p.expert ? ne : n;
    const std::int64_t chunk = (p.len + r - 1) / r, own = own_of(p.len, r);
    st.shard += own;
    st.max_chunk = std::max(st.max_chunk, chunk);
    if (chunk * r != p.len) st.padded_stage = std::max(st.padded_stage, chunk * (r + 1));
    others[static_cast<std::size_t>(p.unit)] += p.len - own;
    chunks[static_cast<std::size_t>(p.unit)] += chunk;
  }
  if (l.zero == 3) {
    // What a step holds gathered at once (train::ShardedParameters): the unit it computes with the next one
    // prefetched, with the embedding and the head besides (the head reads the tied table); under keep, everything.
    // A tied table is read by the head as well: the embedding's unit stays gathered with the head's.
    std::int64_t window = units == 3 ? others[1] : 0, send = units == 3 ? chunks[1] : 0;
    for (std::size_t u = 1; u + 2 < others.size(); ++u) {
      window = std::max(window, others[u] + others[u + 1]);
      send = std::max(send, chunks[u] + chunks[u + 1]);
    }
    if (s.tied) {
      window += others.front() + others.back();
    } else {
      window = std::max({window, others[0] + others[1], others[others.size() - 2] + others.back()});
    }
    st.gathered = l.keep ? st.params - st.shard : window;
    st.sending = l.keep ? 0 : send;
  }
  return st;
}

//! ZeRO-2 and ZeRO-3 over several ranks with one micro-batch and no pipeline (train::ZeroBase): the most gradient
//! elements a rank holds during backward besides its shard. Backward runs in chunks (the head and the final norm,
//! the blocks last first, the embedding); before chunk c the buckets chunk c writes are held whole, and those whose
//! reduce-scatter the chunks up to c - 2 started are released, once read, to their chunk. A bucket starts when it
//! and every bucket before it are complete (the order every rank issues them in). Buckets as the trainer cuts them:
//! ZeRO-2 by bucket_bytes from the last parameter back (train::make_buckets), ZeRO-3 by unit, the last first (a
//! block's experts a bucket of their own); an expert bucket is sharded over the expert-data-parallel ranks.
constexpr std::int64_t backward_held(const GptShape& s, const Layout& l, std::int64_t elem, std::int64_t bucket_bytes) {
  const int L = s.layers, last_chunk = L + 1;
  std::vector<ParamDecl> ps;
  each_param(s, l.tp, 0, 0, L, l.ep, [&](ParamDecl p) { ps.push_back(p); });
  // The chunk that completes each unit: the head's (unit L + 1) first, block u - 1's chunk L + 1 - u, the
  // embedding's (unit 0) last; the tied table is written by the head's chunk as well.
  auto chunk_of = [&](int unit) { return unit == L + 1 ? 0 : unit == 0 ? last_chunk : L + 1 - unit; };
  struct B {
    std::int64_t released;
    int first_write, complete;
  };
  std::vector<B> buckets;
  const int n = l.zero_ranks(), ne = l.ep > 1 ? l.edp() : n;
  for (const BucketRange& r : cut_buckets(ps, l.zero == 3, elem, bucket_bytes)) {
    std::int64_t len = 0;
    int first = last_chunk, complete = 0;
    for (std::size_t i = r.first; i < r.last; ++i) {
      len += ps[i].numel;
      const int c = chunk_of(ps[i].unit);
      first = std::min(first, (s.tied && i == 0) ? 0 : c), complete = std::max(complete, c);
    }
    buckets.push_back({len - own_of(len, ps[r.first].expert ? ne : n), first, complete});
  }
  std::int64_t most = 0;
  for (int c = 0; c <= last_chunk; ++c) {
    std::int64_t held = 0;
    int started = 0;  // the chunk that starts bucket b: when it and every bucket before it are complete
    for (const B& b : buckets) {
      started = std::max(started, b.complete);
      if (b.first_write <= c && started + 2 > c) held += b.released;
    }
    most = std::max(most, held);
  }
  return most;
}

//! A micro-batch on one rank, and the widths its tensors have there.
struct Act {
  std::int64_t N, rows, B, Tl;  //!< tokens of a micro-batch on the rank, its rows (N / tp with sp), sequences, tokens of each
  std::int64_t d, qkv, hq, hd, kv, vocab_rows;
  int tp, cp;
  bool sp, ulysses;
  double T, A;  //!< element and accumulation bytes
  const GptShape* s;
  int ep = 1;         //!< the expert-parallel degree
  int capacity = -1;  //!< assignments an expert takes from each sequence (layers::expert_capacity); -1: dropless

  constexpr std::int64_t up(std::int64_t width) const { return (s->gated() ? 2 : 1) * width / tp; }
  //! A mixture of experts' tokens routed on this rank: rows x top_k.
  constexpr std::int64_t routed() const { return rows * s->top_k; }
  //! The rows this rank sends its experts' ranks and the rows its experts receive (layers::RoutedExperts'
  //! most_sent and most_received): with a capacity, its bound, for which loom makes the buffers; dropless, where
  //! the rows go depends on the router, and a balanced one, each rank receiving what it sends, is assumed.
  constexpr std::int64_t sent() const {
    return capacity < 0 ? routed() : std::min(routed(), B * s->experts * std::int64_t{capacity});
  }
  constexpr std::int64_t received() const {
    return capacity < 0 ? routed() : ep * std::min(routed(), B * (s->experts / ep) * std::int64_t{capacity});
  }
  //! A routed layer's rows that forward keeps (the experts' input, hidden and activated rows, the returned rows)
  //! and backward's (their output and hidden gradients): made with the activations under a capacity, at first use
  //! dropless.
  constexpr double routed_acts() const {
    const std::int64_t w = s->expert_width();
    return T * double(received() * (d + (s->gated() ? 2 : 1) * w + w) + sent() * d);
  }
  constexpr double routed_grads() const {
    return T * double(received() * (d + (s->gated() ? 2 : 1) * s->expert_width()));
  }
  constexpr bool any_dense() const {
    for (int l = 0; l < s->layers; ++l)
      if (!s->moe_block(l)) return true;
    return false;
  }
  constexpr bool any_moe() const { return s->experts > 0; }

  //! GptBlock::make_acts(with_input, keep_core, l): what forward keeps for block l (-1: scratch for any block).
  constexpr double block_acts(bool with_input, bool keep_core, int l) const {
    double b = T * double((with_input ? 4 : 3) * rows * d) + A * double(4 * rows);
    b += T * double(N * qkv) + (sp ? T * double(N * d) : 0);  // attention: q|k|v, the gathered input
    if (keep_core) b += T * double(N * hq * hd) + A * double(B * hq * Tl);
    if (l < 0 ? any_dense() : !s->moe_block(l)) b += T * double(N * up(s->ffn()) + N * s->ffn() / tp) + (sp ? T * double(N * d) : 0);
    if (l < 0 ? any_moe() : s->moe_block(l)) b += moe_acts();
    return b;
  }
  //! GptBlock::make_grads(recompute_core, l): backward's branch gradients.
  constexpr double block_grads(bool recompute_core, int l) const {
    double b = T * double(4 * rows * d) + T * double(N * hq * hd + N * qkv) + (sp ? 2 * T * double(N * d) : 0);
    if (recompute_core) b += T * double(N * hq * hd) + A * double(B * hq * Tl);
    if (l < 0 ? any_dense() : !s->moe_block(l))
      b += T * double(N * up(s->ffn())) + (s->gated() ? T * double(N * s->ffn() / tp) : 0) + (sp ? 2 * T * double(N * d) : 0);
    if (l < 0 ? any_moe() : s->moe_block(l)) b += moe_grads();
    return b;
  }
  //! A mixture of experts' forward: the router's logits (and all of them with sp), the routed rows (routed_acts),
  //! and the shared experts' MLP.
  constexpr double moe_acts() const {
    const std::int64_t w = s->expert_width(), E = s->experts;
    double b = T * double(rows * E + (sp ? N * E : 0)) + routed_acts();
    if (s->shared_experts > 0) {
      const std::int64_t sw = std::int64_t{s->shared_experts} * w;
      b += T * double(N * up(sw) + N * sw / tp) + (sp ? T * double(N * d) : 0);
    }
    return b;
  }
  constexpr double moe_grads() const {
    const std::int64_t w = s->expert_width(), E = s->experts;
    double b = T * double(rows * E + (sp ? N * E : 0)) + routed_grads();
    if (s->shared_experts > 0) {
      const std::int64_t sw = std::int64_t{s->shared_experts} * w;
      b += T * double(N * up(sw)) + (s->gated() ? T * double(N * sw / tp) : 0) + (sp ? 2 * T * double(N * d) : 0);
    }
    return b;
  }
  //! The all-to-alls' send and receive rows (layers::RoutedExperts' scratch) at their most, in backward_input: the
  //! received output gradients, the input gradients computed for them (and, gated, the activation's gradient), the
  //! input gradients returned.
  constexpr double moe_buffers() const {
    if (!any_moe()) return 0;
    return T * double((2 * received() + sent()) * d + (s->gated() ? received() * s->expert_width() : 0));
  }
  //! The transient workspace of ring or Ulysses attention (the larger of forward's and backward's).
  constexpr double cp_workspace() const {
    if (cp == 1) return 0;
    const std::int64_t wq = hq * hd, wkv = kv * hd;
    if (ulysses) {
      const std::int64_t R = B * Tl;
      return T * double(R * (6 * wq + 4 * wkv)) + A * double(3 * R * hq);
    }
    const std::int64_t c = Tl / 2, qn = B * c * wq, kvn = B * c * wkv, ln = B * hq * c, blocks = 8 * kvn;
    const double fwd = T * double(3 * qn + blocks) + A * double(2 * qn + 3 * ln);
    const double bwd = T * double(7 * qn + blocks + 2 * kvn) + A * double(2 * ln + 2 * qn + blocks + 4 * kvn);
    return std::max(fwd, bwd);
  }
};

//! One chunk's activations in loom (models::GptActivations::allocate and split): `slots` slots of blocks
//! [first, last), the scratch the calls share, and with a split backward (zb-h1, zb-v) the branch gradients of the
//! `used` slots the chunk's micro-batches use. A dropless mixture of experts makes its routed rows at first use:
//! those of the used slots alone.
constexpr double loom_chunk_activations(const Act& a, int first, int last, bool head, int slots, int used,
                                        Recompute rc, bool split) {
  const int split_slots = split ? used : 0;
  const double T = a.T, A = a.A;
  const std::int64_t rows = a.rows, N = a.N, d = a.d;
  const bool full = rc == Recompute::full, selective = rc == Recompute::selective;
  double slot = 0;
  double unused = 0;  // of a slot no micro-batch takes: a dropless mixture's routed rows, never made
  if (full) slot += T * double(rows * d * (last - first));
  else
    for (int l = first; l < last; ++l) {
      slot += a.block_acts(true, rc == Recompute::none, l);
      if (a.capacity < 0 && a.s->moe_block(l)) unused += a.routed_acts();
    }
  slot += 2 * T * double(rows * d);
  if (head) slot += T * double(rows * d) + 2 * A * double(rows) + (a.sp ? T * double(N * d) : 0) +
                    T * double(N * a.vocab_rows + N) + 2 * A * double(N);
  double shared = full ? a.block_acts(false, true, -1) + T * double(rows * d) : 0;
  shared += T * double(rows * d) + (a.sp ? 3 * T * double(N * d) : 0) + T * double(N) + a.block_grads(selective, -1);
  // A split backward computes in each slot's gradients: the shared ones never receive a dropless mixture's rows.
  if (split && a.capacity < 0 && a.any_moe()) shared -= a.routed_grads();
  double splits = 0;  // each slot's, made the first time a split backward uses it
  if (split_slots > 0) {
    for (int l = first; l < last; ++l) splits += a.block_grads(selective, l);
    if (head) splits += T * double(rows * d);
  }
  return slots * slot - (slots - std::min(slots, used)) * unused + split_slots * splits + shared;
}

//! Korthikanti et al. 2022's activation bytes of one transformer layer for one micro-batch (16-bit activations):
//! without recomputation sbh(10 + 24/t + 5as/(ht)), with sequence parallelism (sbh/t)(34 + 5as/h); selective
//! recomputation drops the attention core's 5as/h terms; full recomputation keeps the layer's input, 2sbh (/t
//! with sp). s is the rank's share of the sequence under context parallelism. A flash attention keeps no scores.
//! The same count for any block: outside the tensor-parallel region the two norms' inputs, the attention's and the
//! MLP's inputs (8) and, with dropout, its two masks (2); inside, q and the output (4), k and v (4 kv/a), the MLP's
//! hidden rows before and after the activation (4f/h; gated, the gate's and up's and their product's, 6f/h), and the
//! core's softmax (2as/h) and its dropout mask and output (3as/h). GPT's 4h MLP with dropout gives the paper's 10
//! and 24.
constexpr double megatron_layer_activations(const GptShape& g, const Layout& l, double b, double s, Recompute rc,
                                            bool flash, bool dropout = true) {
  const double h = g.d_model, a = g.heads, t = l.tp, f = g.ffn();
  if (rc == Recompute::full) return 2 * s * b * h / (l.sp ? t : 1);
  const double outside = 8 + (dropout ? 2 : 0);
  const double inside = 4 + 4.0 * g.kv_heads / a + (g.gated() ? 6 : 4) * f / h;
  const double core = rc == Recompute::selective || flash ? 0 : (dropout ? 5 : 2) * a * s / h;
  return l.sp ? s * b * h / t * (outside + inside + core) : s * b * h * (outside + (inside + core) / t);
}

//! The first block of pipeline part k of `parts` (k = parts: the end): an even split, the first parts a block more
//! where the layers do not divide (loom's trainer takes such a split as --layer-split).
constexpr int part_first(const GptShape& s, int parts, int k) {
  const int per = s.layers / parts, extra = s.layers % parts;
  return k * per + std::min(k, extra);
}

//! Pipeline part k of `parts`: its blocks [first, last), and whether it holds the embedding and the output layer.
//! part_first's split; with ends_alone (Llama 3's pipeline, under Megatron-LM's recipe), the first part holds the
//! embedding alone and the last the output layer alone, the blocks split over the others.
struct PartSpan {
  int first, last;
  bool embedding, head;
};
constexpr PartSpan part_span(const GptShape& s, int parts, int k, bool ends_alone = false) {
  if (!ends_alone || parts < 3) return {part_first(s, parts, k), part_first(s, parts, k + 1), k == 0, k == parts - 1};
  const int inner = parts - 2;
  auto first = [&](int j) { return part_first(s, inner, std::clamp(j, 0, inner)); };
  return {first(k - 1), first(k), k == 0, k == parts - 1};
}

//! Which part chunk `chunk` of pipeline stage `stage` holds.
constexpr int part_of(const Layout& l, int stage, int chunk) {
  return l.pp > 1 ? pipeline::virtual_stage(l.schedule, l.pp, stage, chunk) : 0;
}

}  // namespace detail

//! The activation slots each chunk's model keeps on each pipeline stage (pipeline::Executor: the most
//! (micro-batch, chunk) pairs the verified schedule holds on the stage, at most the micro-batches; one without a
//! pipeline). The schedule's table is built and verified where it is small enough (up to 64 stages, 20000 actions),
//! else pipeline::activation_bound gives the count.
struct Slots {
  std::vector<int> per_stage;               //!< each chunk's slots on the stage (the executor's capacity)
  std::vector<std::vector<int>> per_chunk;  //!< [stage][chunk]: the most of that chunk's micro-batches held at once
};
constexpr Slots activation_slots(const Layout& l, int micro_batches, bool from_table = true) {
  const int v = l.chunks();
  Slots out{std::vector<int>(static_cast<std::size_t>(l.pp), 1),
            std::vector<std::vector<int>>(static_cast<std::size_t>(l.pp), std::vector<int>(std::size_t(v), 1))};
  if (l.pp == 1) return out;
  const bool table = from_table && l.pp <= pipeline::max_stages && 3.0 * l.pp * micro_batches * v <= 20000 &&
                     pipeline::detail::count_rule(l.schedule, l.pp, micro_batches, v) ==
                         pipeline::detail::CountRule::ok;
  if (table) {
    const pipeline::RuntimeTable t = pipeline::detail::build(l.schedule, l.pp, micro_batches, v);
    const pipeline::VerifyResult r = pipeline::verify(t);
    if (r.ok) {
      for (int s = 0; s < l.pp; ++s) {
        const int cap = std::max(1, std::min(micro_batches, r.peak_held[static_cast<std::size_t>(s)]));
        out.per_stage[std::size_t(s)] = cap;
        // In the table's order, as the executor hands out slots: F takes one of its chunk's, W or BW returns it.
        std::vector<int> held(std::size_t(v), 0), peak(std::size_t(v), 0);
        for (const pipeline::Action& x : t.stage(s)) {
          auto& h = held[std::size_t(x.chunk)];
          if (x.kind == pipeline::Kind::F) peak[std::size_t(x.chunk)] = std::max(peak[std::size_t(x.chunk)], ++h);
          else if (x.kind == pipeline::Kind::W || x.kind == pipeline::Kind::BW) --h;
        }
        for (int c = 0; c < v; ++c) out.per_chunk[std::size_t(s)][std::size_t(c)] = std::min(cap, std::max(1, peak[std::size_t(c)]));
      }
      return out;
    }
  }
  for (int s = 0; s < l.pp; ++s) {
    const int cap =
        std::max(1, std::min(micro_batches, pipeline::activation_bound(l.schedule, l.pp, micro_batches, v, s)));
    out.per_stage[std::size_t(s)] = cap;
    out.per_chunk[std::size_t(s)].assign(std::size_t(v), cap);
  }
  return out;
}

//! The memory of pipeline stage `stage`'s most loaded rank (tensor-, expert- and data-parallel rank 0) for shape s,
//! run r and layout l. The layout must satisfy violation(s, l, r).
constexpr Memory memory_of_stage(const GptShape& s, const Layout& l, const Run& r, int stage, int slots,
                                 const std::vector<int>& chunk_held) {
  Memory m;
  m.stage = stage;
  const double T = bytes_of(r.dtype), A = acc_bytes_of(r.dtype);
  const int chunks = l.chunks(), parts = l.pp * chunks;
  const std::int64_t B = r.micro_batch_size(l.dp), Tl = r.seq / l.cp, N = B * Tl;
  const std::int64_t tp = l.tp;
  detail::Act a{N,     l.sp ? N / tp : N, B, Tl, s.d_model, 0, s.heads / tp, s.head_dim(),
                units_of(s.kv_heads, l.tp, 0).count, units_of(s.vocab, l.tp, 0).count, l.tp, l.cp, l.sp, l.ulysses,
                T,     A,                 &s};
  a.qkv = (a.hq + 2 * a.kv) * a.hd;
  a.ep = l.ep;
  if (s.experts > 0) a.capacity = layers::expert_capacity(int(Tl * l.cp), s.top_k, s.experts, r.capacity_factor);
  const bool split = l.pp > 1 && (l.schedule == Schedule::zero_bubble_h1 || l.schedule == Schedule::zero_bubble_v);
  if (r.recipe == Recipe::megatron) {
    // bf16 parameters, fp32 gradients, fp32 moments and master weights: 18 bytes per parameter, 6 + 12 / dp with the
    // distributed optimizer; activations by the per-layer formula, the stage's in-flight micro-batches of its layers.
    std::int64_t params = 0;
    int layers = 0;  // the stage's blocks
    for (int c = 0; c < chunks; ++c) {
      const detail::PartSpan p = detail::part_span(s, parts, detail::part_of(l, stage, c), r.ends_alone);
      detail::each_param(s, l.tp, 0, p.first, p.last, p.embedding, p.head, l.ep,
                         [&](detail::ParamDecl d) { params += d.numel; });
      layers += p.last - p.first;
    }
    // ZeRO-2 (Llama 3's FSDP, which reduce-scatters the gradients in fp32) keeps a shard of the fp32 gradients.
    const double opt = 12.0 / (l.zero >= 1 ? l.zero_ranks() : 1);
    m.bytes.parameters = 2.0 * double(params);
    m.bytes.gradients = (l.zero >= 2 ? 4.0 / l.zero_ranks() : r.fp16_grads ? 6.0 : 4.0) * double(params);
    m.bytes.optimizer = opt * double(params);
    m.held = {m.bytes.parameters, m.bytes.gradients, m.bytes.optimizer, 0, 0, 0};
    // No schedule holds more than the step's micro-batches (interleaving's warm-up runs them all forward where
    // there are no more of them than stages).
    const double held = l.pp == 1 ? 1
                        : l.schedule == Schedule::gpipe ? double(r.micro_batches)
                        : l.schedule == Schedule::interleaved
                            ? std::min(double(r.micro_batches), (l.pp - stage) * (1.0 + (l.pp - 1.0) / (l.pp * l.v)))
                            : double(std::min(l.pp - stage, r.micro_batches));
    (void)slots;
    m.bytes.activations = held * layers *
                          detail::megatron_layer_activations(s, l, double(B), double(Tl), r.recompute, r.flash,
                                                             r.dropout);
    // Full recomputation keeps each layer's input, and while backward reaches a layer, that layer's activations
    // recomputed whole.
    if (r.recompute == Recompute::full)
      m.bytes.activations +=
          detail::megatron_layer_activations(s, l, double(B), double(Tl), Recompute::none, r.flash, r.dropout);
    m.peak = m.bytes.total();
    return m;
  }
  for (int c = 0; c < chunks; ++c) {
    const int part = detail::part_of(l, stage, c), first = detail::part_first(s, parts, part),
              last = detail::part_first(s, parts, part + 1);
    const detail::PartState st = detail::part_state(s, l, first, last, std::int64_t(T), r.bucket_bytes);
    const double shard = double(st.shard);
    m.bytes.parameters += T * double(l.zero == 3 ? st.shard + st.gathered : st.params);
    // With one micro-batch ZeRO-2 and 3 hold the buckets backward is writing or reducing, else the whole part.
    const bool by_chunks = l.zero >= 2 && l.zero_ranks() > 1 && l.pp == 1 && r.micro_batches == 1;
    m.bytes.gradients += T * double(by_chunks ? st.shard + detail::backward_held(s, l, std::int64_t(T), r.bucket_bytes)
                                              : st.params);
    m.bytes.optimizer += A * shard * ((r.sgd ? 1 : 2) + (r.dtype == Dtype::bf16 ? 1 : 0));
    m.held.parameters += T * double(l.zero == 3 ? st.shard : st.params);
    m.held.gradients += T * double(l.zero >= 2 ? st.shard : st.params);
    const double R = r.dtype == Dtype::bf16 ? A : T;  // reductions of bf16 gradients on the host are widened
    if (l.zero == 3) m.bytes.buffers += R * (shard + double(st.padded_stage)) + T * double(st.sending);
    else if (l.zero > 0)
      m.bytes.buffers += std::max(R * (shard + double(st.padded_stage)), T * double(st.max_chunk + st.padded_stage));
    else if (r.dtype == Dtype::bf16 && l.dp > 1)
      m.bytes.buffers += A * double(st.params);
    m.bytes.activations += detail::loom_chunk_activations(a, first, last, last == s.layers, slots,
                                                          chunk_held[std::size_t(c)], r.recompute, split);
    if (s.rope()) m.bytes.other += 2 * A * double(s.max_seq) * double(s.head_dim() / 2);
  }
  m.held.optimizer = m.bytes.optimizer;
  m.bytes.activations += a.cp_workspace();
  m.bytes.buffers += a.moe_buffers();
  m.peak = m.bytes.total();
  return m;
}

//! Each pipeline stage's memory (its most loaded rank's).
constexpr std::vector<Memory> memory_by_stage(const GptShape& s, const Layout& l, const Run& r,
                                              bool from_table = true) {
  const Slots slots = activation_slots(l, r.micro_batches, from_table);
  std::vector<Memory> out;
  for (int stage = 0; stage < l.pp; ++stage)
    out.push_back(memory_of_stage(s, l, r, stage, slots.per_stage[std::size_t(stage)],
                                  slots.per_chunk[std::size_t(stage)]));
  return out;
}

//! The most loaded rank's memory over the pipeline's stages (of memory_by_stage's); from_table false: the slots by activation_bound alone
//! (a search's speed).
constexpr Memory most_loaded(const std::vector<Memory>& all) {
  Memory best = all.front();
  for (const Memory& m : all)
    if (m.peak > best.peak) best = m;
  return best;
}
constexpr Memory memory(const GptShape& s, const Layout& l, const Run& r, bool from_table = true) {
  return most_loaded(memory_by_stage(s, l, r, from_table));
}

}  // namespace loom::plan

// Step time of a model on a cluster under a layout: each operation's FLOPs and bytes against the device's
// calibrated rates (a roofline per operation class), each collective by the alpha-beta model of its algorithm over
// the links its group spans (NVLink inside a node, the network between nodes), the pipeline bubble of each
// schedule, and what overlaps what (loom averages gradients bucket by bucket during the last micro-batch's
// backward; Megatron-LM's runs of 2021-22 reduced them after it). Then tokens/s and MFU.
#pragma once

#include <loom/plan/cluster.hpp>
#include <loom/plan/layout.hpp>
#include <loom/plan/memory.hpp>

#include <algorithm>
#include <cmath>

namespace loom::plan {

//! What a step costs, seconds, on the slowest pipeline stage, and what follows from it.
struct StepTime {
  double compute = 0;     //!< the stage's forward, backward and recomputation over the step's micro-batches
  double tp_comm = 0;     //!< tensor-parallel collectives (not overlapped)
  double cp_comm = 0;     //!< context parallelism's exposed exchanges
  double ep_comm = 0;     //!< a mixture of experts' all-to-alls
  double pp_comm = 0;     //!< pipeline sends and receives
  double bubble = 0;      //!< the schedule's idle time
  double dp_comm = 0;     //!< the exposed part of the gradient reduction and ZeRO's gathers
  double optimizer = 0;   //!< the optimizer's step
  double step = 0;        //!< the sum
  double tokens_per_s = 0;
  double mfu = 0;         //!< model FLOPs (flops_per_token, no recomputation) over the devices' peak
};

namespace detail {

//! Ring all-reduce of `bytes` over n ranks on link k: 2(n-1) steps of bytes/n.
inline double all_reduce_time(double bytes, int n, const Link& k, double base) {
  if (n <= 1 || bytes <= 0) return 0;
  return base + 2.0 * (n - 1) * k.latency + 2.0 * (n - 1) / n * bytes / k.bandwidth;
}
//! Ring all-gather or reduce-scatter of `bytes` (the whole array) over n ranks.
inline double gather_time(double bytes, int n, const Link& k, double base) {
  if (n <= 1 || bytes <= 0) return 0;
  return base + (n - 1) * k.latency + double(n - 1) / n * bytes / k.bandwidth;
}
//! Pairwise all-to-all of `bytes` a rank sends in all.
inline double all_to_all_time(double bytes, int n, const Link& k, double base) {
  if (n <= 1 || bytes <= 0) return 0;
  return base + (n - 1) * k.latency + double(n - 1) / n * bytes / k.bandwidth;
}

//! The link a group of n ranks, `stride` apart in rank order, spans: inside a node while stride * n divides a node's
//! devices (else some group straddles two nodes: tp6 on nodes of 8). Across nodes, a group with g members in each
//! node crosses between nodes on g devices' network links at once (NCCL's rings and trees use every NIC of a
//! node), up to what the links inside the node carry.
inline Link link_of(const Cluster& c, int stride, int n) {
  if (c.devices_per_node % (stride * n) == 0) return c.intra;
  const int g = std::clamp(c.devices_per_node / std::max(1, stride), 1, n);
  return {std::min(c.intra.bandwidth, c.inter.bandwidth * g), c.inter.latency};
}

}  // namespace detail

//! The step time of shape s, run r, layout l on cluster c.
inline StepTime step_time(const GptShape& s, const Layout& l, const Run& r, const Cluster& shared_or_not) {
  StepTime t;
  Cluster c = shared_or_not;
  if (c.shared_threads > 0 && l.world() > c.shared_threads) {
    // Ranks that outnumber the host's threads take turns: a collective's copies share the threads as the kernels
    // do, and each of its steps waits for the peer's turn.
    const double turns = double(l.world()) / c.shared_threads;
    for (Link* k : {&c.intra, &c.inter}) {
      k->bandwidth /= turns;
      if (c.oversubscribed_latency > 0) k->latency = c.oversubscribed_latency;
    }
  }
  const bool megatron = r.recipe == Recipe::megatron;
  const bool square = megatron && !r.flash;  // attention over the whole s x s square, its softmax in memory
  const double T = megatron ? 2 : bytes_of(r.dtype);
  const Dtype dt = megatron ? Dtype::bf16 : r.dtype;
  const double peak = c.peak(dt);
  double mm = peak * c.matmul_efficiency / c.compute_overhead, at = peak * c.attention_efficiency / c.compute_overhead;
  double bw = c.memory_bandwidth * c.memory_efficiency / c.compute_overhead;
  if (c.shared_threads > 0) {  // ranks on one host divide its threads (threads_per_rank) or take turns on them
    const int H = c.shared_threads, w = l.world();
    const double k = std::max(1, H / w), turns = std::max(1.0, double(w) / H);
    auto rate = [&](double speedup) { return (1 + (k - 1) * (speedup - 1) / std::max(1, H - 1)) / turns; };
    mm *= rate(c.speedup[0]), at *= rate(c.speedup[1]), bw *= rate(c.speedup[2]);
  }
  const int tp = l.tp, cp = l.cp;
  const double B = r.micro_batch_size(l.dp), Tl = double(r.seq) / cp, N = B * Tl, S = r.seq;
  const double d = s.d_model, hd = s.head_dim(), hq = double(s.heads) / tp;
  const double kv = double(units_of(s.kv_heads, tp, 0).count), qkv = (hq + 2 * kv) * hd;
  const double rows = l.sp ? N / tp : N;
  const int m = r.micro_batches;
  const int parts = l.pp * l.chunks();
  const double gemm_ops = 4;  // products per block and pass: launches
  // One block's forward, per micro-batch on this rank.
  constexpr double score_passes = 6;
  auto block_forward = [&](int layer, double& gemm, double& attn, double& mem, double& mem_bwd, double& tpc,
                           double& epc) {
    double flops = 2 * N * d * qkv + 2 * N * hq * hd * d;
    if (s.moe_block(layer)) {
      const double w = s.expert_width(), up = (s.gated() ? 2 : 1) * w, routed = rows * s.top_k;
      flops += 2 * rows * d * s.experts + 2 * routed * (d * up + w * d);
      if (s.shared_experts > 0) {
        const double sw = double(s.shared_experts) * w;
        flops += 2 * N * d * (s.gated() ? 2 : 1) * sw / tp + 2 * N * sw / tp * d;
      }
      epc += 2 * detail::all_to_all_time(routed * d * T, l.ep, detail::link_of(c, tp, l.ep), c.collective_base);
      mem += T * routed * (3 * d + 2 * w), mem_bwd += 2 * T * routed * (3 * d + 2 * w);
    } else {
      const double f = s.ffn() / double(tp);
      flops += 2 * N * d * (s.gated() ? 2 : 1) * f + 2 * N * f * d;
      mem += T * N * (s.gated() ? 3 : 2) * f, mem_bwd += 2 * T * N * (s.gated() ? 3 : 2) * f;
    }
    gemm += flops / mm + gemm_ops * c.launch;
    // Attention's products: causal, flash-style (loom), or the whole square with a memory-bound softmax (Megatron).
    const double keys = square ? S : S / 2;
    const double core = 4 * B * hq * Tl * keys * hd;
    // The square's scores pass through memory six times: written by QK^T, read and written by the masked softmax
    // and by dropout, read by the product with V.
    attn += square ? core / mm + score_passes * B * hq * Tl * S * T / bw : core / at;
    mem += T * rows * d * 10;  // two norms, two residual additions, dropouts: about ten passes over a row
    mem_bwd += T * N * d * 20;  // backward's: with sequence parallelism too (its inputs gathered again, unfused)
    // Tensor parallelism: two all-reduces (or all-gather + reduce-scatter with sp) of N x d.
    tpc += 2 * detail::all_reduce_time(N * d * T, tp, detail::link_of(c, 1, tp), c.collective_base);
  };
  // The slowest stage: the one with the most work (the head's stage, or the embedding's).
  double best = -1;
  double F = 0, Bw = 0, W = 0, tpf = 0, epf = 0, cpf = 0;
  for (int stage = 0; stage < l.pp; ++stage) {
    double gemm = 0, attn = 0, mem = 0, mem_bwd = 0, tpc = 0, epc = 0;
    bool has_head = false;
    for (int k = 0; k < l.chunks(); ++k) {
      const detail::PartSpan p = detail::part_span(s, parts, detail::part_of(l, stage, k), r.ends_alone);
      for (int layer = p.first; layer < p.last; ++layer) block_forward(layer, gemm, attn, mem, mem_bwd, tpc, epc);
      has_head = has_head || p.head;
    }
    double hd_time = 0;
    if (has_head) {
      const double vl = double(units_of(s.vocab, tp, 0).count);
      hd_time = 2 * N * d * vl / mm + 3 * T * N * vl / bw;
    }
    const double fwd = gemm + attn + mem / bw + hd_time;
    if (fwd + tpc + epc <= best) continue;
    best = fwd + tpc + epc;
    // Context parallelism: ring attention passes cp - 1 key/value blocks per layer, overlapped with the blocks'
    // attention; Ulysses four all-to-alls of the layer's q, k, v and output.
    int blocks = 0;
    for (int k = 0; k < l.chunks(); ++k) {
      const detail::PartSpan p = detail::part_span(s, parts, detail::part_of(l, stage, k), r.ends_alone);
      blocks += p.last - p.first;
    }
    double cpc = 0;
    if (cp > 1) {
      const Link lk = detail::link_of(c, tp, cp);
      if (r.cp_all_gather) {  // Llama 3's: k and v all-gathered before attention (their gradients reduce-scattered)
        cpc = blocks * detail::gather_time(2 * B * Tl * cp * kv * hd * T, cp, lk, c.collective_base);
      } else if (l.ulysses) {
        cpc = blocks * 4 * detail::all_to_all_time(N * d / tp * T, cp, lk, c.collective_base);
      } else {
        const double pass = (cp - 1) * (lk.latency + c.collective_base + 2 * B * Tl * kv * hd * T / lk.bandwidth);
        cpc = blocks * std::max(0.0, pass - c.overlap_efficiency * attn / blocks);
      }
    }
    F = fwd, tpf = tpc, epf = epc, cpf = cpc;
    // Backward: the input's gradient (B) and the weights' (W) from the forward's products; attention's backward
    // is 2.5 forwards (2 with the square softmax).
    Bw = gemm + attn * (square ? 2.0 : 2.5) + mem_bwd / bw + hd_time;
    W = gemm + hd_time;
  }
  // Recomputation: full repeats the forward (its collectives too); selective the attention core.
  double rc = 0, rc_tp = 0;
  if (r.recompute == Recompute::full) rc = F, rc_tp = tpf;
  if (r.recompute == Recompute::selective) {
    const double keys = square ? S : S / 2;
    rc = std::ceil(double(s.layers) / parts) * l.chunks() *
         (square ? 4 * B * hq * Tl * keys * hd / mm + score_passes * B * hq * Tl * S * T / bw
                 : 4 * B * hq * Tl * keys * hd / at);
  }
  const double tp_mb = 2 * tpf + rc_tp, cp_mb = 3 * cpf, ep_mb = 2 * epf;
  // Pipeline sends: each tensor-parallel rank sends its slice of the boundary's N x d (with sequence parallelism
  // that is what it holds; without, Megatron's scatter-gather sends a tp-th and gathers the rest over the node's
  // links at the receiver), once forward and once backward per chunk and micro-batch.
  const Link pl = detail::link_of(c, tp * cp * l.dp, 2);
  const double pp_mb =
      l.pp > 1 ? 2.0 * l.chunks() *
                     (pl.latency + c.collective_base + N * d * T / tp / pl.bandwidth +
                      (l.sp ? 0 : detail::gather_time(N * d * T, tp, detail::link_of(c, 1, tp), c.collective_base)))
               : 0;
  const double per_mb = F + Bw + W + rc + tp_mb + cp_mb + ep_mb + pp_mb;
  t.compute = m * (F + Bw + W + rc);
  t.tp_comm = m * tp_mb, t.cp_comm = m * cp_mb, t.ep_comm = m * ep_mb, t.pp_comm = m * pp_mb;
  if (l.pp > 1) {
    const double p1 = l.pp - 1;
    switch (l.schedule) {
      case Schedule::gpipe:
      case Schedule::one_f_one_b: t.bubble = p1 * per_mb; break;
      case Schedule::interleaved: t.bubble = p1 * per_mb / l.v; break;
      case Schedule::zero_bubble_h1: t.bubble = p1 * std::max(0.0, per_mb - 2 * W); break;
      case Schedule::zero_bubble_v: t.bubble = p1 * std::max(0.0, per_mb - 3 * W) / 2; break;
    }
    // Ranks that take turns on a host's threads: a stage that waits gives its turn to the others.
    if (c.shared_threads > 0 && l.world() > c.shared_threads) t.bubble *= double(c.shared_threads) / l.world();
  }
  // Data parallelism: the gradients of the stage's parameters over dp (x cp: the sequence's shards too),
  // all-reduced (ZeRO 0) or reduce-scattered then the parameters all-gathered (ZeRO 1-2; ZeRO 3 gathers each unit
  // before forward and backward as well).
  std::int64_t params = 0;
  for (int k = 0; k < l.chunks(); ++k) {
    const detail::PartSpan p = detail::part_span(s, parts, detail::part_of(l, 0, k), r.ends_alone);
    detail::each_param(s, tp, 0, p.first, p.last, p.embedding, p.head, l.ep,
                       [&](detail::ParamDecl d) { params += d.numel; });
  }
  const int dpn = l.dp * cp;
  const Link dl = detail::link_of(c, tp, dpn);
  const double gbytes = double(params) * (megatron ? (r.fp16_grads ? 2 : 4) : T);
  double dp = 0;
  if (l.zero == 0) dp = detail::all_reduce_time(gbytes, dpn, dl, c.collective_base);
  else dp = detail::gather_time(gbytes, dpn, dl, c.collective_base) +
            detail::gather_time(double(params) * T, dpn, dl, c.collective_base) * (l.zero == 3 ? 3 : 1);
  // loom starts each bucket's reduction as backward completes it: what the last micro-batch's backward hides (under
  // Megatron-LM's recipe where its run overlapped them).
  const double hidden =
      megatron && !r.overlap_grad_reduce ? 0 : c.overlap_efficiency * (Bw + W) * (l.zero == 3 ? m : 1);
  t.dp_comm = std::max(0.0, dp - hidden);
  const double shard = double(params) / (l.zero >= 1 ? l.zero_ranks() : 1);
  // The update's passes over the shard (and, in loom, the gradients zeroed and their norm taken: two passes more).
  t.optimizer = shard * (megatron ? 4 * 4 + 2 + 4 : (r.sgd ? 3 : 5) * double(acc_bytes_of(r.dtype)) + 4 * T) / bw;
  t.step = t.compute + t.tp_comm + t.cp_comm + t.ep_comm + t.pp_comm + t.bubble + t.dp_comm + t.optimizer;
  const double tokens = double(r.batch) * r.seq;
  t.tokens_per_s = tokens / t.step;
  const double devices = c.shared_threads > 0 ? c.shared_threads : l.world();  // a shared host's peak is its own
  t.mfu = t.tokens_per_s * s.flops_per_token(r.seq) / (devices * peak);
  return t;
}

}  // namespace loom::plan

// loom/pipeline/detail/build.hpp (private; include <loom/pipeline/schedule.hpp>): how the tables are made. First
// the order of compute actions on each stage, which is the schedule proper; then the sends and receives, placed by
// running that order in unit time and pairing each transfer at the first moment both of its stages are between
// two actions, so that no send ever waits for its receive and the exchanges reproduce the step the compute order
// would take with free, buffered communication.
#pragma once

#ifndef LOOM_PIPELINE_SCHEDULE_INTERNAL
#error "loom/pipeline/detail/build.hpp is private: include <loom/pipeline/schedule.hpp>"
#endif

namespace loom::pipeline::detail {

// The count rules of make_schedule and make_schedule_checked, checked in this order.
enum class CountRule {
  ok,
  stages,
  micro_batches,
  chunks_not_interleaved,
  chunks_zb_v,
  chunks_interleaved,
  interleaved_too_few,
  interleaved_not_multiple,
  group_not_interleaved,
  group_not_multiple
};

// group: the interleaved order's micro-batches in a row (0 or p: Megatron-LM's groups of p, whose rules are m >= p
// and a multiple of p; another: a multiple of it).
constexpr CountRule count_rule(Schedule s, int p, int m, int v, int group = 0) {
  if (p < 1 || p > max_stages) return CountRule::stages;
  if (m < 1) return CountRule::micro_batches;
  if (group != 0 && (s != Schedule::interleaved || group < 1)) return CountRule::group_not_interleaved;
  if (s == Schedule::zero_bubble_v) return v == 1 || v == 2 ? CountRule::ok : CountRule::chunks_zb_v;
  if (s != Schedule::interleaved) return v == 1 ? CountRule::ok : CountRule::chunks_not_interleaved;
  if (v < 2) return CountRule::chunks_interleaved;
  if (group != 0 && group != p) return m % group == 0 ? CountRule::ok : CountRule::group_not_multiple;
  if (m < p) return CountRule::interleaved_too_few;
  if (m % p != 0) return CountRule::interleaved_not_multiple;
  return CountRule::ok;
}

struct Step {
  Kind kind;
  int micro;
  int chunk;
};
using Order = std::vector<std::vector<Step>>;

// GPipe: all forwards, then all backwards.
constexpr void order_gpipe(std::vector<Step>& q, int m) {
  for (int i = 0; i < m; ++i) q.push_back({Kind::F, i, 0});
  for (int i = 0; i < m; ++i) q.push_back({Kind::BW, i, 0});
}

// 1F1B (PipeDream-flush): P - s - 1 warm-up forwards, then one forward and one backward in turn, then the
// remaining backwards. Stage s never holds more than P - s micro-batches.
constexpr void order_1f1b(std::vector<Step>& q, int P, int m, int s) {
  const int warm = std::min(P - s - 1, m);
  for (int i = 0; i < warm; ++i) q.push_back({Kind::F, i, 0});
  for (int i = 0; i < m - warm; ++i) {
    q.push_back({Kind::F, warm + i, 0});
    q.push_back({Kind::BW, i, 0});
  }
  for (int i = m - warm; i < m; ++i) q.push_back({Kind::BW, i, 0});
}

// Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's order): the k-th forward of a stage is micro-batch
// (k / Gv)·G + k % G on chunk (k % Gv) / G, so groups of G micro-batches (G = P; Llama 3's and Megatron-Core's
// schedule lets G differ) pass through chunk 0, then chunk 1, ...; backwards take the same micro-batches through the
// chunks in reverse. Warm-up: 2(P - s - 1) + (v - 1)G forwards. (Megatron-LM runs all forwards first when m == P;
// the general warm-up is used here, which holds fewer.) Below P, a group comes back to stage 0 before the stage
// has room for it, and the order can wait on itself (place_exchanges says so).
constexpr void order_interleaved(std::vector<Step>& q, int P, int m, int v, int s, int G) {
  const int total = m * v;
  const int round = G * v;
  auto micro = [&](int k) { return (k / round) * G + k % G; };
  auto fchunk = [&](int k) { return (k % round) / G; };
  auto bchunk = [&](int k) { return v - 1 - (k % round) / G; };
  const int warm = std::min(2 * (P - s - 1) + (v - 1) * G, total);
  for (int k = 0; k < warm; ++k) q.push_back({Kind::F, micro(k), fchunk(k)});
  for (int i = 0; i < total - warm; ++i) {
    q.push_back({Kind::F, micro(warm + i), fchunk(warm + i)});
    q.push_back({Kind::BW, micro(i), bchunk(i)});
  }
  for (int i = total - warm; i < total; ++i) q.push_back({Kind::BW, micro(i), bchunk(i)});
}

// ZB-H1 (Qi et al. 2023): 1F1B with the backward split, and stage s running each W s micro-batches after its B.
// The delay lets the input gradients run down the pipeline without waiting for weight gradients; the W's held
// back fill the tail, where 1F1B idles. Activations in flight are 1F1B's (P - s); F-to-W, every stage holds P.
constexpr void order_zb_h1(std::vector<Step>& q, int P, int m, int s) {
  const int warm = std::min(P - s - 1, m);
  int next_w = 0;
  auto weights_up_to = [&](int last) {
    for (; next_w <= last; ++next_w) q.push_back({Kind::W, next_w, 0});
  };
  for (int i = 0; i < warm; ++i) q.push_back({Kind::F, i, 0});
  for (int i = 0; i < m - warm; ++i) {
    q.push_back({Kind::F, warm + i, 0});
    q.push_back({Kind::B, i, 0});
    weights_up_to(i - s);
  }
  for (int i = m - warm; i < m; ++i) {
    q.push_back({Kind::B, i, 0});
    weights_up_to(i - s);
  }
  weights_up_to(m - 1);
}

// ZB-V (Qi et al. 2023, section 6): chunk 0 holds part s, chunk 1 part 2P-1-s. Warm-up: 2(P - s) - 1 forwards of
// chunk 0, then s pairs (F chunk 1, F chunk 0), then P - s triples F B W of chunk 1. Steady state: F B W of chunk 0
// then F B W of chunk 1. Cool-down: s pairs (B chunk 0, B chunk 1), P - s pairs (B chunk 0, W chunk 0), then the
// remaining W's. The pattern is written for n = max(m, 2P - 1) micro-batches; with fewer, the actions of the
// missing ones are left out, which keeps the order of the others.
constexpr void order_zb_v(std::vector<Step>& q, int P, int m, int s) {
  const int n = std::max(m, 2 * P - 1);
  int f[2] = {0, 0}, b[2] = {0, 0}, w[2] = {0, 0};
  auto add = [&](Kind k, int* counter, int c) {
    const int micro = counter[c]++;
    if (micro < m) q.push_back({k, micro, c});
  };
  auto fwd = [&](int c) { add(Kind::F, f, c); };
  auto in_grad = [&](int c) { add(Kind::B, b, c); };
  auto weight = [&](int c) { add(Kind::W, w, c); };
  auto fbw = [&](int c) {
    fwd(c);
    in_grad(c);
    weight(c);
  };
  for (int i = 0; i < 2 * (P - s) - 1; ++i) fwd(0);
  for (int i = 0; i < s; ++i) {
    fwd(1);
    fwd(0);
  }
  for (int i = 0; i < P - s; ++i) fbw(1);
  while (f[1] < f[0] || f[0] < n) {
    if (f[0] < n) fwd(0);
    in_grad(0);
    weight(0);
    fbw(1);
  }
  for (int i = 0; i < s; ++i) {
    in_grad(0);
    in_grad(1);
  }
  for (int i = 0; i < P - s; ++i) {
    in_grad(0);
    weight(0);
  }
  while (w[1] < b[1]) weight(1);
  while (w[0] < b[0]) weight(0);
}

constexpr Order compute_order(Schedule sched, int P, int m, int v, int group = 0) {
  Order o(static_cast<std::size_t>(P));
  for (int s = 0; s < P; ++s) {
    auto& q = o[static_cast<std::size_t>(s)];
    q.reserve(static_cast<std::size_t>(m * v * 3));
    switch (sched) {
      case Schedule::gpipe: order_gpipe(q, m); break;
      case Schedule::one_f_one_b: order_1f1b(q, P, m, s); break;
      case Schedule::interleaved: order_interleaved(q, P, m, v, s, group > 0 ? group : P); break;
      case Schedule::zero_bubble_h1: order_zb_h1(q, P, m, s); break;
      case Schedule::zero_bubble_v: order_zb_v(q, P, m, s); break;
    }
  }
  return o;
}

// The length of stage s's list, counted without building: per (micro-batch, chunk) its compute actions (F and
// BW, or F, B and W) and a send and a receive on each side whose neighbouring part lives on another stage.
constexpr int stage_length(Schedule sched, int P, int m, int chunks, int s) {
  const int K = P * chunks;
  const bool split = sched == Schedule::zero_bubble_h1 || sched == Schedule::zero_bubble_v;
  int n = 0;
  for (int c = 0; c < chunks; ++c) {
    const int k = virtual_stage(sched, P, s, c);
    n += split ? 3 : 2;
    if (k > 0 && stage_chunk(sched, P, k - 1).stage != s) n += 2;
    if (k + 1 < K && stage_chunk(sched, P, k + 1).stage != s) n += 2;
  }
  return n * m;
}

// The longest stage list: the N of make_schedule's Table<P, N>.
constexpr int capacity(Schedule sched, int P, int m, int v) {
  int most = 1;
  for (int s = 0; s < P; ++s) most = std::max(most, stage_length(sched, P, m, chunks_per_stage(sched, v), s));
  return most;
}

// Runs the compute order in unit time (F = B = W = 1, BW = 2) and writes each stage's list as it goes. At every
// moment t, a transfer whose producer has finished is paired if both its stages are between actions at t (done
// with one, not started on the next, or waiting); a stage starts its next action when that action's inputs are
// paired, and otherwise waits. Since a send is only placed where its receiver meets it, no send waits, and a
// receiver waits only while its producer's stage is busy, which buffered communication could not avoid either.
// Both stages of a pair append the two operations at the same moment, so their order agrees on every channel.
constexpr RuntimeTable place_exchanges(Schedule sched, int P, int m, int v, const Order& order) {
  const int K = P * v;
  const auto P_ = static_cast<std::size_t>(P);
  RuntimeTable t;
  t.actions.resize(P_);
  // Lists are filled in place (std::vector growth is costly in constant evaluation) and trimmed at the end.
  std::vector<int> filled(P_, 0);
  for (int s = 0; s < P; ++s) t.actions[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(stage_length(sched, P, m, v, s)));
  auto append = [&](int s, Action a) {
    const auto su = static_cast<std::size_t>(s);
    if (filled[su] == static_cast<int>(t.actions[su].size())) throw Error("loom: internal: a stage list outgrew its length");
    t.actions[su][static_cast<std::size_t>(filled[su]++)] = a;
  };
  t.micro_batches = m;
  t.chunks = v;
  t.schedule = sched;
  struct Transfer {
    int from, to;
    Kind send, recv;
    int micro, from_chunk, to_chunk, to_vstage;
  };
  std::vector<Transfer> pending;
  pending.reserve(P_ * 4);
  std::vector<char> act(static_cast<std::size_t>(m * K), 0), grad(static_cast<std::size_t>(m * K), 0);
  auto flag = [&](std::vector<char>& f, int micro, int k) -> char& { return f[static_cast<std::size_t>(micro * K + k)]; };
  std::vector<int> next(P_, 0), free_at(P_, 0);
  int now = 0;
  for (;;) {
    std::size_t kept = 0;  // the unpaired transfers move up, in order (cheaper than erasing one at a time)
    for (std::size_t i = 0; i < pending.size(); ++i) {
      const Transfer x = pending[i];
      if (free_at[static_cast<std::size_t>(x.from)] <= now && free_at[static_cast<std::size_t>(x.to)] <= now) {
        append(x.from, {x.send, x.micro, x.from_chunk, x.to});
        append(x.to, {x.recv, x.micro, x.to_chunk, x.from});
        flag(x.recv == Kind::recv_act ? act : grad, x.micro, x.to_vstage) = 1;
      } else {
        pending[kept++] = x;
      }
    }
    pending.resize(kept);
    bool finished = pending.empty();
    for (int s = 0; s < P; ++s) {
      const auto su = static_cast<std::size_t>(s);
      const auto& q = order[su];
      if (next[su] == static_cast<int>(q.size())) continue;
      finished = false;
      if (free_at[su] > now) continue;
      const Step a = q[static_cast<std::size_t>(next[su])];
      const int k = virtual_stage(sched, P, s, a.chunk);
      const bool forward = a.kind == Kind::F;
      const bool ready = forward ? k == 0 || flag(act, a.micro, k)
                                 : a.kind == Kind::W || k == K - 1 || flag(grad, a.micro, k);
      if (!ready) continue;
      append(s, {a.kind, a.micro, a.chunk, -1});
      ++next[su];
      free_at[su] = now + (a.kind == Kind::BW ? 2 : 1);
      if (a.kind == Kind::W) continue;
      const int to = forward ? k + 1 : k - 1;  // the part that consumes what this action makes
      if (to < 0 || to >= K) continue;
      const StageChunk h = stage_chunk(sched, P, to);
      if (h.stage == s) {  // stays on this stage: ready once the action ends, and nothing else runs here before
        flag(forward ? act : grad, a.micro, to) = 1;
      } else {
        pending.push_back({s, h.stage, forward ? Kind::send_act : Kind::send_grad,
                           forward ? Kind::recv_act : Kind::recv_grad, a.micro, a.chunk, h.chunk, to});
      }
    }
    if (finished) break;
    int later = now;
    for (int f : free_at)
      if (f > now && (later == now || f < later)) later = f;
    if (later == now) throw Error("loom: the pipeline's compute order waits on itself (a deadlock)");
    now = later;
  }
  for (std::size_t s = 0; s < P_; ++s) t.actions[s].resize(static_cast<std::size_t>(filled[s]));
  return t;
}

constexpr RuntimeTable build(Schedule sched, int P, int m, int v, int group = 0) {
  const int chunks = chunks_per_stage(sched, v);
  RuntimeTable t = place_exchanges(sched, P, m, chunks, compute_order(sched, P, m, chunks, group));
  t.group = group;
  return t;
}

template <int P, int N>
constexpr Table<P, N> to_table(const RuntimeTable& r) {
  Table<P, N> t{};
  t.micro_batches = r.micro_batches;
  t.chunks = r.chunks;
  t.schedule = r.schedule;
  t.group = r.group;
  for (std::size_t s = 0; s < static_cast<std::size_t>(P); ++s) {
    const auto& list = r.actions[s];
    if (static_cast<int>(list.size()) > N) throw Error("loom: internal: a stage list outgrew its capacity");
    for (std::size_t i = 0; i < list.size(); ++i) t.actions[s][i] = list[i];
    t.length[s] = static_cast<int>(list.size());
  }
  return t;
}

}  // namespace loom::pipeline::detail

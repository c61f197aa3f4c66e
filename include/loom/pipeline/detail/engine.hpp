// loom/pipeline/detail/engine.hpp (private; include <loom/pipeline/schedule.hpp>): the run of a table under the
// executor's semantics, which both verify() and simulate() use: static checks of every action and of the order of
// each pair of stages' exchanges, then a timed run in which compute actions take their cost and a batch of
// exchanges completes when the last of its peers has issued the matching batch.
#pragma once

#ifndef LOOM_PIPELINE_SCHEDULE_INTERNAL
#error "loom/pipeline/detail/engine.hpp is private: include <loom/pipeline/schedule.hpp>"
#endif

namespace loom::pipeline::detail {

struct Fault {
  Problem problem = Problem::none;
  int stage = -1;
  int index = -1;
  int micro = -1;
  int chunk = -1;
};

struct RunResult {
  Fault fault;
  std::vector<int> peak_in_flight;
  std::vector<int> peak_held;
  std::vector<double> busy;
  double makespan = 0;
};

// What has happened to one (micro-batch, virtual stage).
struct Progress {
  bool f = false;
  bool b = false;     // B or BW done
  bool w = false;     // W or BW done
  bool bw = false;    // done as BW (no separate W may follow)
  bool act = false;   // its input activation received
  bool grad = false;  // its output gradient received
};

constexpr double idle_share(const std::vector<double>& busy, double makespan) {
  if (makespan <= 0 || busy.empty()) return 0;
  double sum = 0;
  for (double b : busy) sum += b;
  return 1 - sum / (static_cast<double>(busy.size()) * makespan);
}

constexpr double idle_ratio(const std::vector<double>& busy, double makespan) {
  double sum = 0;
  for (double b : busy) sum += b;
  if (sum <= 0) return 0;
  return (static_cast<double>(busy.size()) * makespan - sum) / sum;
}

constexpr double cost_of(Kind k, const Costs& c) {
  switch (k) {
    case Kind::F: return c.f;
    case Kind::B: return c.b;
    case Kind::W: return c.w;
    case Kind::BW: return c.b + c.w;
    default: return 0;
  }
}

constexpr bool chunks_fit(Schedule s, int v) {
  if (s == Schedule::zero_bubble_v) return v == 2;
  if (s == Schedule::interleaved) return v >= 1;
  return v == 1;
}

// record(stage, index, start, end) is called once for every action the run completes.
template <class T, class Record>
constexpr RunResult run(const T& t, const Costs& costs, Record&& record) {
  RunResult out;
  const int P = t.stage_count();
  const int m = t.micro_batches;
  const int v = t.chunks;
  const Schedule sched = t.schedule;
  auto fail = [&](Problem p, int s, int i, int micro, int chunk) {
    out.fault = {p, s, i, micro, chunk};
    return out;
  };
  if (P < 1 || m < 1 || v < 1 || !chunks_fit(sched, v)) return fail(Problem::shape, -1, -1, -1, -1);
  const int K = P * v;
  const auto P_ = static_cast<std::size_t>(P);
  out.peak_in_flight.assign(P_, 0);
  out.peak_held.assign(P_, 0);
  out.busy.assign(P_, 0.0);
  auto vs = [&](int s, int c) { return virtual_stage(sched, P, s, c); };
  auto holder = [&](int k) { return stage_chunk(sched, P, k).stage; };
  auto len = [&](int s) { return static_cast<int>(t.stage(s).size()); };
  auto at = [&](int s, int i) -> const Action& { return t.stage(s)[static_cast<std::size_t>(i)]; };

  // 1. Every action on its own: fields in range, exchanges with the stage that holds the neighbouring part.
  for (int s = 0; s < P; ++s) {
    for (int i = 0; i < len(s); ++i) {
      const Action& a = at(s, i);
      if (a.micro < 0 || a.micro >= m || a.chunk < 0 || a.chunk >= v) return fail(Problem::bad_action, s, i, a.micro, a.chunk);
      if (is_compute(a.kind)) {
        if (a.peer != -1) return fail(Problem::bad_action, s, i, a.micro, a.chunk);
        continue;
      }
      if (a.peer < 0 || a.peer >= P || a.peer == s) return fail(Problem::bad_action, s, i, a.micro, a.chunk);
      const int k = vs(s, a.chunk);
      const bool toward_next = a.kind == Kind::send_act || a.kind == Kind::recv_grad;  // the peer holds k + 1
      const int other = toward_next ? k + 1 : k - 1;
      if (other < 0 || other >= K || holder(other) != a.peer) return fail(Problem::wrong_peer, s, i, a.micro, a.chunk);
    }
  }

  // 2. Between each ordered pair of stages, the k-th send meets the k-th receive: same kind, micro-batch, and the
  // receiving chunk holds the neighbouring part. mate[s][i] is the index of the counterpart on the peer.
  std::vector<std::vector<int>> mate(P_);
  for (int s = 0; s < P; ++s) mate[static_cast<std::size_t>(s)].assign(static_cast<std::size_t>(len(s)), -1);
  {
    std::vector<std::vector<int>> sends(P_ * P_), recvs(P_ * P_);
    for (int s = 0; s < P; ++s)
      for (int i = 0; i < len(s); ++i) {
        const Action& a = at(s, i);
        if (is_send(a.kind)) sends[static_cast<std::size_t>(s * P + a.peer)].push_back(i);
        if (is_recv(a.kind)) recvs[static_cast<std::size_t>(a.peer * P + s)].push_back(i);
      }
    for (int from = 0; from < P; ++from)
      for (int to = 0; to < P; ++to) {
        const auto& ss = sends[static_cast<std::size_t>(from * P + to)];
        const auto& rr = recvs[static_cast<std::size_t>(from * P + to)];
        const std::size_t n = std::min(ss.size(), rr.size());
        for (std::size_t q = 0; q < n; ++q) {
          const Action& a = at(from, ss[q]);
          const Action& b = at(to, rr[q]);
          const bool act = a.kind == Kind::send_act;
          const bool same = (act ? b.kind == Kind::recv_act : b.kind == Kind::recv_grad) && a.micro == b.micro &&
                            vs(to, b.chunk) == vs(from, a.chunk) + (act ? 1 : -1);
          if (!same) return fail(Problem::crossed, from, ss[q], a.micro, a.chunk);
          mate[static_cast<std::size_t>(from)][static_cast<std::size_t>(ss[q])] = rr[q];
          mate[static_cast<std::size_t>(to)][static_cast<std::size_t>(rr[q])] = ss[q];
        }
        if (ss.size() > n) return fail(Problem::unmatched, from, ss[n], at(from, ss[n]).micro, at(from, ss[n]).chunk);
        if (rr.size() > n) return fail(Problem::unmatched, to, rr[n], at(to, rr[n]).micro, at(to, rr[n]).chunk);
      }
  }

  // 3. Batches: batch_end[s][i] is one past the maximal run of exchanges that contains action i.
  std::vector<std::vector<int>> batch_end(P_);
  for (int s = 0; s < P; ++s) {
    auto& e = batch_end[static_cast<std::size_t>(s)];
    e.assign(static_cast<std::size_t>(len(s)), 0);
    for (int i = len(s) - 1; i >= 0; --i) {
      if (is_compute(at(s, i).kind)) continue;
      const bool next_exchange = i + 1 < len(s) && !is_compute(at(s, i + 1).kind);
      e[static_cast<std::size_t>(i)] = next_exchange ? e[static_cast<std::size_t>(i + 1)] : i + 1;
    }
  }

  // 4. The run. Compute actions go as far as their stage's list allows; then every stage that reached a batch
  // issues it, and a batch whose every operation's counterpart has been issued completes at the latest issue time.
  std::vector<Progress> progress(static_cast<std::size_t>(m) * static_cast<std::size_t>(K));
  auto prog = [&](int micro, int k) -> Progress& {
    return progress[static_cast<std::size_t>(micro) * static_cast<std::size_t>(K) + static_cast<std::size_t>(k)];
  };
  std::vector<int> pc(P_, 0), in_flight(P_, 0), held(P_, 0);
  std::vector<double> clock(P_, 0.0);
  std::vector<char> issued(P_, 0);
  std::vector<std::vector<double>> issue_time(P_);
  for (int s = 0; s < P; ++s) issue_time[static_cast<std::size_t>(s)].assign(static_cast<std::size_t>(len(s)), 0.0);

  for (;;) {
    bool moved = false;
    for (int s = 0; s < P; ++s) {
      const auto su = static_cast<std::size_t>(s);
      while (pc[su] < len(s) && is_compute(at(s, pc[su]).kind)) {
        const int i = pc[su];
        const Action& a = at(s, i);
        const int k = vs(s, a.chunk);
        Progress& g = prog(a.micro, k);
        switch (a.kind) {
          case Kind::F: {
            if (g.f) return fail(Problem::duplicate, s, i, a.micro, a.chunk);
            const bool have = k == 0 || (holder(k - 1) == s ? prog(a.micro, k - 1).f : g.act);
            if (!have) return fail(Problem::input_missing, s, i, a.micro, a.chunk);
            g.f = true;
            ++in_flight[su];
            ++held[su];
            break;
          }
          case Kind::B:
          case Kind::BW: {
            if (!g.f) return fail(Problem::out_of_order, s, i, a.micro, a.chunk);
            if (g.b) return fail(Problem::duplicate, s, i, a.micro, a.chunk);
            const bool have = k == K - 1 || (holder(k + 1) == s ? prog(a.micro, k + 1).b : g.grad);
            if (!have) return fail(Problem::gradient_missing, s, i, a.micro, a.chunk);
            g.b = true;
            --in_flight[su];
            if (a.kind == Kind::BW) {
              g.w = g.bw = true;
              --held[su];
            }
            break;
          }
          default: {  // W
            if (g.w) return fail(Problem::duplicate, s, i, a.micro, a.chunk);
            if (!g.b || g.bw) return fail(Problem::out_of_order, s, i, a.micro, a.chunk);
            g.w = true;
            --held[su];
            break;
          }
        }
        out.peak_in_flight[su] = std::max(out.peak_in_flight[su], in_flight[su]);
        out.peak_held[su] = std::max(out.peak_held[su], held[su]);
        const double c = cost_of(a.kind, costs);
        record(s, i, clock[su], clock[su] + c);
        clock[su] += c;
        out.busy[su] += c;
        ++pc[su];
        moved = true;
      }
      if (pc[su] < len(s) && !issued[su]) {
        issued[su] = 1;
        moved = true;
        for (int j = pc[su]; j < batch_end[su][static_cast<std::size_t>(pc[su])]; ++j) {
          const Action& a = at(s, j);
          const Progress& g = prog(a.micro, vs(s, a.chunk));
          issue_time[su][static_cast<std::size_t>(j)] = clock[su];
          if ((a.kind == Kind::send_act && !g.f) || (a.kind == Kind::send_grad && !g.b))
            return fail(Problem::out_of_order, s, j, a.micro, a.chunk);
          if ((a.kind == Kind::recv_act && g.act) || (a.kind == Kind::recv_grad && g.grad))
            return fail(Problem::duplicate, s, j, a.micro, a.chunk);
        }
      }
    }

    // A counterpart is issued when its stage has passed it or is waiting on the batch that holds it.
    auto counterpart_issued = [&](int s, int j) {
      const int r = at(s, j).peer;
      const auto ru = static_cast<std::size_t>(r);
      const int q = mate[static_cast<std::size_t>(s)][static_cast<std::size_t>(j)];
      return q < pc[ru] || (issued[ru] && q < batch_end[ru][static_cast<std::size_t>(pc[ru])]);
    };
    for (int s = 0; s < P; ++s) {
      const auto su = static_cast<std::size_t>(s);
      if (!issued[su]) continue;
      const int first = pc[su];
      const int last = batch_end[su][static_cast<std::size_t>(first)];
      bool complete = true;
      double done = clock[su];
      for (int j = first; j < last && complete; ++j) {
        complete = counterpart_issued(s, j);
        if (complete) {
          const Action& a = at(s, j);
          const double other = issue_time[static_cast<std::size_t>(a.peer)]
                                         [static_cast<std::size_t>(mate[su][static_cast<std::size_t>(j)])];
          done = std::max(done, other);
        }
      }
      if (!complete) continue;
      for (int j = first; j < last; ++j) {
        const Action& a = at(s, j);
        Progress& g = prog(a.micro, vs(s, a.chunk));
        if (a.kind == Kind::recv_act) g.act = true;
        if (a.kind == Kind::recv_grad) g.grad = true;
        record(s, j, issue_time[su][static_cast<std::size_t>(j)], done);
      }
      pc[su] = last;
      clock[su] = done;
      issued[su] = 0;
      moved = true;
    }

    bool finished = true;
    for (int s = 0; s < P; ++s) finished = finished && pc[static_cast<std::size_t>(s)] == len(s);
    if (finished) break;
    if (!moved) {
      for (int s = 0; s < P; ++s) {
        const auto su = static_cast<std::size_t>(s);
        if (pc[su] == len(s)) continue;
        for (int j = pc[su]; j < batch_end[su][static_cast<std::size_t>(pc[su])]; ++j)
          if (!counterpart_issued(s, j)) return fail(Problem::deadlock, s, j, at(s, j).micro, at(s, j).chunk);
      }
      return fail(Problem::deadlock, -1, -1, -1, -1);  // not reached: a stuck stage has an unmet exchange
    }
  }
  for (double c : clock) out.makespan = std::max(out.makespan, c);

  // 5. Everything ran once, and no stage held more than its bound.
  for (int k = 0; k < K; ++k)
    for (int micro = 0; micro < m; ++micro) {
      const Progress& g = prog(micro, k);
      if (!g.f || !g.b || !g.w) {
        const StageChunk h = stage_chunk(sched, P, k);
        return fail(Problem::incomplete, h.stage, -1, micro, h.chunk);
      }
    }
  for (int s = 0; s < P; ++s)
    if (out.peak_in_flight[static_cast<std::size_t>(s)] > activation_bound(sched, P, m, v, s))
      return fail(Problem::over_bound, s, -1, -1, -1);
  return out;
}

}  // namespace loom::pipeline::detail

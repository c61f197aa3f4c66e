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
//
// Constant evaluation is slow, and every std::vector or std::span subscript is a checked call there, so the run
// keeps its state in flat arrays reached through raw pointers: action i of stage s is entry first[s] + i.
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

  std::vector<int> first_v(P_ + 1, 0);
  std::vector<const Action*> list_v(P_);
  for (int s = 0; s < P; ++s) {
    const std::span<const Action> l = t.stage(s);
    list_v[static_cast<std::size_t>(s)] = l.data();
    first_v[static_cast<std::size_t>(s) + 1] = first_v[static_cast<std::size_t>(s)] + static_cast<int>(l.size());
  }
  const int* const first = first_v.data();
  const Action* const* const list = list_v.data();
  const int total = first[P];
  auto len = [&](int s) { return first[s + 1] - first[s]; };
  auto at = [&](int s, int i) -> const Action& { return list[s][i]; };

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
  // receiving chunk holds the neighbouring part. mate[first[s] + i] is the counterpart's index on the peer.
  std::vector<int> mate_v(static_cast<std::size_t>(total), -1);
  int* const mate = mate_v.data();
  {
    // The sends of channel a -> b in order at sends[send_first[a*P + b] ...], its receives likewise: a counting
    // sort, so that no vector grows.
    const int channels = P * P;
    std::vector<int> send_first_v(static_cast<std::size_t>(channels) + 1, 0), recv_first_v(send_first_v);
    int* const send_first = send_first_v.data();
    int* const recv_first = recv_first_v.data();
    for (int s = 0; s < P; ++s)
      for (int i = 0; i < len(s); ++i) {
        const Action& a = at(s, i);
        if (is_send(a.kind)) ++send_first[s * P + a.peer + 1];
        if (is_recv(a.kind)) ++recv_first[a.peer * P + s + 1];
      }
    for (int c = 0; c < channels; ++c) {
      send_first[c + 1] += send_first[c];
      recv_first[c + 1] += recv_first[c];
    }
    std::vector<int> sends_v(static_cast<std::size_t>(send_first[channels])), recvs_v(static_cast<std::size_t>(recv_first[channels]));
    std::vector<int> send_fill_v(send_first_v), recv_fill_v(recv_first_v);
    int* const sends = sends_v.data();
    int* const recvs = recvs_v.data();
    int* const send_fill = send_fill_v.data();
    int* const recv_fill = recv_fill_v.data();
    for (int s = 0; s < P; ++s)
      for (int i = 0; i < len(s); ++i) {
        const Action& a = at(s, i);
        if (is_send(a.kind)) sends[send_fill[s * P + a.peer]++] = i;
        if (is_recv(a.kind)) recvs[recv_fill[a.peer * P + s]++] = i;
      }
    for (int from = 0; from < P; ++from)
      for (int to = 0; to < P; ++to) {
        const int c = from * P + to;
        const int* const ss = sends + send_first[c];
        const int* const rr = recvs + recv_first[c];
        const int ns = send_first[c + 1] - send_first[c], nr = recv_first[c + 1] - recv_first[c];
        const int n = ns < nr ? ns : nr;
        for (int q = 0; q < n; ++q) {
          const Action& a = at(from, ss[q]);
          const Action& b = at(to, rr[q]);
          const bool act = a.kind == Kind::send_act;
          const bool same = (act ? b.kind == Kind::recv_act : b.kind == Kind::recv_grad) && a.micro == b.micro &&
                            vs(to, b.chunk) == vs(from, a.chunk) + (act ? 1 : -1);
          if (!same) return fail(Problem::crossed, from, ss[q], a.micro, a.chunk);
          mate[first[from] + ss[q]] = rr[q];
          mate[first[to] + rr[q]] = ss[q];
        }
        if (ns > n) return fail(Problem::unmatched, from, ss[n], at(from, ss[n]).micro, at(from, ss[n]).chunk);
        if (nr > n) return fail(Problem::unmatched, to, rr[n], at(to, rr[n]).micro, at(to, rr[n]).chunk);
      }
  }

  // 3. Batches: batch_end[first[s] + i] is one past the maximal run of exchanges that contains action i.
  std::vector<int> batch_end_v(static_cast<std::size_t>(total), 0);
  int* const batch_end = batch_end_v.data();
  for (int s = 0; s < P; ++s)
    for (int i = len(s) - 1; i >= 0; --i) {
      if (is_compute(at(s, i).kind)) continue;
      const bool next_exchange = i + 1 < len(s) && !is_compute(at(s, i + 1).kind);
      batch_end[first[s] + i] = next_exchange ? batch_end[first[s] + i + 1] : i + 1;
    }

  // 4. The run. Compute actions go as far as their stage's list allows; then every stage that reached a batch
  // issues it, and a batch whose every operation's counterpart has been issued completes at the latest issue time.
  std::vector<Progress> progress_v(static_cast<std::size_t>(m) * static_cast<std::size_t>(K));
  Progress* const progress = progress_v.data();
  auto prog = [&](int micro, int k) -> Progress& { return progress[micro * K + k]; };
  std::vector<int> pc_v(P_, 0), in_flight_v(P_, 0), held_v(P_, 0), peak_v(P_, 0), peak_held_v(P_, 0);
  std::vector<double> clock_v(P_, 0.0), busy_v(P_, 0.0), issue_time_v(static_cast<std::size_t>(total), 0.0);
  std::vector<char> issued_v(P_, 0);
  int* const pc = pc_v.data();
  int* const in_flight = in_flight_v.data();
  int* const held = held_v.data();
  int* const peak = peak_v.data();
  int* const peak_held = peak_held_v.data();
  double* const clock = clock_v.data();
  double* const busy = busy_v.data();
  double* const issue_time = issue_time_v.data();
  char* const issued = issued_v.data();

  // A counterpart is issued when its stage has passed it or is waiting on the batch that holds it.
  auto counterpart_issued = [&](int s, int j) {
    const int r = at(s, j).peer;
    const int q = mate[first[s] + j];
    return q < pc[r] || (issued[r] && q < batch_end[first[r] + pc[r]]);
  };

  for (;;) {
    bool moved = false;
    for (int s = 0; s < P; ++s) {
      while (pc[s] < len(s) && is_compute(at(s, pc[s]).kind)) {
        const int i = pc[s];
        const Action& a = at(s, i);
        const int k = vs(s, a.chunk);
        Progress& g = prog(a.micro, k);
        switch (a.kind) {
          case Kind::F: {
            if (g.f) return fail(Problem::duplicate, s, i, a.micro, a.chunk);
            const bool have = k == 0 || (holder(k - 1) == s ? prog(a.micro, k - 1).f : g.act);
            if (!have) return fail(Problem::input_missing, s, i, a.micro, a.chunk);
            g.f = true;
            ++in_flight[s];
            ++held[s];
            break;
          }
          case Kind::B:
          case Kind::BW: {
            if (!g.f) return fail(Problem::out_of_order, s, i, a.micro, a.chunk);
            if (g.b) return fail(Problem::duplicate, s, i, a.micro, a.chunk);
            const bool have = k == K - 1 || (holder(k + 1) == s ? prog(a.micro, k + 1).b : g.grad);
            if (!have) return fail(Problem::gradient_missing, s, i, a.micro, a.chunk);
            g.b = true;
            --in_flight[s];
            if (a.kind == Kind::BW) {
              g.w = g.bw = true;
              --held[s];
            }
            break;
          }
          default: {  // W
            if (g.w) return fail(Problem::duplicate, s, i, a.micro, a.chunk);
            if (!g.b || g.bw) return fail(Problem::out_of_order, s, i, a.micro, a.chunk);
            g.w = true;
            --held[s];
            break;
          }
        }
        if (in_flight[s] > peak[s]) peak[s] = in_flight[s];
        if (held[s] > peak_held[s]) peak_held[s] = held[s];
        const double c = cost_of(a.kind, costs);
        record(s, i, clock[s], clock[s] + c);
        clock[s] += c;
        busy[s] += c;
        ++pc[s];
        moved = true;
      }
      if (pc[s] < len(s) && !issued[s]) {
        issued[s] = 1;
        moved = true;
        for (int j = pc[s]; j < batch_end[first[s] + pc[s]]; ++j) {
          const Action& a = at(s, j);
          const Progress& g = prog(a.micro, vs(s, a.chunk));
          issue_time[first[s] + j] = clock[s];
          if ((a.kind == Kind::send_act && !g.f) || (a.kind == Kind::send_grad && !g.b))
            return fail(Problem::out_of_order, s, j, a.micro, a.chunk);
          if ((a.kind == Kind::recv_act && g.act) || (a.kind == Kind::recv_grad && g.grad))
            return fail(Problem::duplicate, s, j, a.micro, a.chunk);
        }
      }
    }

    for (int s = 0; s < P; ++s) {
      if (!issued[s]) continue;
      const int begin = pc[s];
      const int end = batch_end[first[s] + begin];
      bool complete = true;
      double done = clock[s];
      for (int j = begin; j < end && complete; ++j) {
        complete = counterpart_issued(s, j);
        if (complete) {
          const int r = at(s, j).peer;
          const double other = issue_time[first[r] + mate[first[s] + j]];
          if (other > done) done = other;
        }
      }
      if (!complete) continue;
      for (int j = begin; j < end; ++j) {
        const Action& a = at(s, j);
        Progress& g = prog(a.micro, vs(s, a.chunk));
        if (a.kind == Kind::recv_act) g.act = true;
        if (a.kind == Kind::recv_grad) g.grad = true;
        record(s, j, issue_time[first[s] + j], done);
      }
      pc[s] = end;
      clock[s] = done;
      issued[s] = 0;
      moved = true;
    }

    bool finished = true;
    for (int s = 0; s < P; ++s) finished = finished && pc[s] == len(s);
    if (finished) break;
    if (!moved) {
      for (int s = 0; s < P; ++s) {
        if (pc[s] == len(s)) continue;
        for (int j = pc[s]; j < batch_end[first[s] + pc[s]]; ++j)
          if (!counterpart_issued(s, j)) return fail(Problem::deadlock, s, j, at(s, j).micro, at(s, j).chunk);
      }
      return fail(Problem::deadlock, -1, -1, -1, -1);  // not reached: a stuck stage has an unmet exchange
    }
  }
  for (int s = 0; s < P; ++s) {
    const auto su = static_cast<std::size_t>(s);
    out.makespan = std::max(out.makespan, clock[s]);
    out.peak_in_flight[su] = peak[s];
    out.peak_held[su] = peak_held[s];
    out.busy[su] = busy[s];
  }

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
    if (peak[s] > activation_bound(sched, P, m, v, s, t.group)) return fail(Problem::over_bound, s, -1, -1, -1);
  return out;
}

}  // namespace loom::pipeline::detail

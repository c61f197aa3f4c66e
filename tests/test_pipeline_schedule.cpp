// Tests of loom/pipeline/schedule.hpp. The schedules' facts (verified, activation bounds, bubbles in unit time) are
// static_asserts over every schedule for p in {2, 4} and m in {p, 2p, 3p}; the run-time cases sweep wider, check
// the verifier against broken tables, and time tables with unequal costs.
#include <algorithm>
#include <string>
#include <vector>

#include <loom/pipeline/schedule.hpp>

#include "catch.hpp"

namespace {

namespace pl = loom::pipeline;
using loom::Schedule;
using pl::Action;
using pl::Kind;
using pl::Problem;

constexpr bool near(double a, double b) { return (a > b ? a - b : b - a) < 1e-9; }

// ---- where the model parts live -----------------------------------------------------------------------------------
static_assert(pl::virtual_stage(Schedule::one_f_one_b, 4, 2, 0) == 2);
static_assert(pl::virtual_stage(Schedule::interleaved, 4, 1, 0) == 1);
static_assert(pl::virtual_stage(Schedule::interleaved, 4, 1, 1) == 5);  // Megatron-LM: chunk·p + stage
static_assert(pl::virtual_stage(Schedule::interleaved, 4, 3, 2) == 11);
static_assert(pl::virtual_stage(Schedule::zero_bubble_v, 4, 0, 1) == 7);  // stage 0 holds the first and last part
static_assert(pl::virtual_stage(Schedule::zero_bubble_v, 4, 3, 0) == 3);  // the turn of the V is on stage 3
static_assert(pl::virtual_stage(Schedule::zero_bubble_v, 4, 3, 1) == 4);
static_assert(pl::stage_chunk(Schedule::zero_bubble_v, 4, 4) == pl::StageChunk{3, 1});
static_assert(pl::stage_chunk(Schedule::interleaved, 4, 6) == pl::StageChunk{2, 1});
static_assert(pl::chunks_per_stage(Schedule::zero_bubble_v, 1) == 2);
static_assert(pl::chunks_per_stage(Schedule::interleaved, 3) == 3);
static_assert(pl::chunks_per_stage(Schedule::gpipe, 1) == 1);

constexpr bool inverse_holds(Schedule s, int P, int v) {
  for (int st = 0; st < P; ++st)
    for (int c = 0; c < v; ++c)
      if (pl::stage_chunk(s, P, pl::virtual_stage(s, P, st, c)) != pl::StageChunk{st, c}) return false;
  for (int k = 0; k < P * v; ++k) {
    const auto h = pl::stage_chunk(s, P, k);
    if (pl::virtual_stage(s, P, h.stage, h.chunk) != k) return false;
  }
  return true;
}
static_assert(inverse_holds(Schedule::interleaved, 4, 3));
static_assert(inverse_holds(Schedule::zero_bubble_v, 4, 2));
static_assert(inverse_holds(Schedule::zero_bubble_v, 1, 2));
static_assert(inverse_holds(Schedule::one_f_one_b, 8, 1));

// ---- every table verifies and holds exactly its bound --------------------------------------------------------------
template <Schedule S, int P, int M, int V = 1>
constexpr bool verified_at_bound() {
  constexpr auto t = pl::make_schedule<S, P, M, V>();
  const pl::VerifyResult r = pl::verify(t);
  if (!r.ok) return false;
  for (int s = 0; s < P; ++s)
    if (r.peak_in_flight[static_cast<std::size_t>(s)] != pl::activation_bound(S, P, M, t.chunks, s)) return false;
  return true;
}

template <Schedule S, int V = 1>
constexpr bool all_verified() {
  return verified_at_bound<S, 2, 2, V>() && verified_at_bound<S, 2, 4, V>() && verified_at_bound<S, 2, 6, V>() &&
         verified_at_bound<S, 4, 4, V>() && verified_at_bound<S, 4, 8, V>() && verified_at_bound<S, 4, 12, V>();
}
static_assert(all_verified<Schedule::gpipe>());
static_assert(all_verified<Schedule::one_f_one_b>());
static_assert(all_verified<Schedule::interleaved, 2>());
static_assert(all_verified<Schedule::interleaved, 3>());
static_assert(all_verified<Schedule::zero_bubble_h1>());
static_assert(all_verified<Schedule::zero_bubble_v>());

// A larger table stays within GCC's default constant-evaluation budget (-fconstexpr-ops-limit): the builder and
// the verifier must stay cheap enough for the tables a program instantiates.
static_assert(pl::make_schedule<Schedule::interleaved, 8, 32, 4>().capacity() == 32 * 4 * 6);

// The published bounds, spelled out for p = 4.
static_assert(pl::verify(pl::make_schedule<Schedule::gpipe, 4, 8>()).peak_in_flight[3] == 8);
static_assert(pl::verify(pl::make_schedule<Schedule::one_f_one_b, 4, 8>()).peak_in_flight[0] == 4);
static_assert(pl::verify(pl::make_schedule<Schedule::one_f_one_b, 4, 8>()).peak_in_flight[3] == 1);
// Interleaved, v = 2: 2(p-1) + (v-1)p + 1 = 11 chunk activations on stage 0, 11/(v·p) = 1 + (p-1)/(p·v) of 1F1B's.
static_assert(pl::verify(pl::make_schedule<Schedule::interleaved, 4, 8, 2>()).peak_in_flight[0] == 11);
static_assert(pl::verify(pl::make_schedule<Schedule::zero_bubble_h1, 4, 8>()).peak_in_flight[0] == 4);
// ZB-H1 keeps each stage's W's back by s micro-batches: F-to-W, every stage holds p, 1F1B's stage 0.
static_assert(pl::verify(pl::make_schedule<Schedule::zero_bubble_h1, 4, 8>()).peak_held[3] == 4);
// ZB-V: 2p half-size chunk activations on every stage, p full stages' worth, 1F1B's peak.
static_assert(pl::verify(pl::make_schedule<Schedule::zero_bubble_v, 4, 8>()).peak_in_flight[0] == 8);
static_assert(pl::verify(pl::make_schedule<Schedule::zero_bubble_v, 4, 8>()).peak_in_flight[3] == 8);

// ---- bubbles in unit time: F = B = W = 1, so BW = 2 ----------------------------------------------------------------
template <Schedule S, int P, int M, int V = 1>
constexpr pl::Timeline<P, decltype(pl::make_schedule<S, P, M, V>())::capacity()> timeline(pl::Costs c = {}) {
  return pl::simulate(pl::make_schedule<S, P, M, V>(), c);
}

// GPipe and 1F1B: (p-1)/(m+p-1) of the step.
template <Schedule S, int P, int M>
constexpr bool flush_bubble() {
  return near(timeline<S, P, M>().bubble, double(P - 1) / double(M + P - 1));
}
static_assert(flush_bubble<Schedule::gpipe, 2, 2>() && flush_bubble<Schedule::gpipe, 2, 4>() &&
              flush_bubble<Schedule::gpipe, 2, 6>() && flush_bubble<Schedule::gpipe, 4, 4>() &&
              flush_bubble<Schedule::gpipe, 4, 8>() && flush_bubble<Schedule::gpipe, 4, 12>());
static_assert(flush_bubble<Schedule::one_f_one_b, 2, 2>() && flush_bubble<Schedule::one_f_one_b, 2, 4>() &&
              flush_bubble<Schedule::one_f_one_b, 2, 6>() && flush_bubble<Schedule::one_f_one_b, 4, 4>() &&
              flush_bubble<Schedule::one_f_one_b, 4, 8>() && flush_bubble<Schedule::one_f_one_b, 4, 12>());
static_assert(near(timeline<Schedule::one_f_one_b, 4, 8>().bubble, 3.0 / 11.0));
static_assert(timeline<Schedule::one_f_one_b, 4, 8>().makespan == 33);

// Interleaved: (p-1)/(v·m) of the ideal step.
template <int P, int M, int V>
constexpr bool interleaved_bubble() {
  return near(timeline<Schedule::interleaved, P, M, V>().bubble_ratio, double(P - 1) / double(V * M));
}
static_assert(interleaved_bubble<2, 2, 2>() && interleaved_bubble<2, 4, 2>() && interleaved_bubble<2, 6, 2>() &&
              interleaved_bubble<4, 4, 2>() && interleaved_bubble<4, 8, 2>() && interleaved_bubble<4, 12, 2>());
static_assert(interleaved_bubble<2, 2, 3>() && interleaved_bubble<2, 4, 3>() && interleaved_bubble<2, 6, 3>() &&
              interleaved_bubble<4, 4, 3>() && interleaved_bubble<4, 8, 3>() && interleaved_bubble<4, 12, 3>());

// ZB-H1: (p-1)(F+B-W) = p-1 units per stage, a third of 1F1B's (p-1)(F+B+W), at equal costs and m >= p.
template <int P, int M>
constexpr bool zb_h1_bubble() {
  const double ideal = 3.0 * M;
  const double zb = timeline<Schedule::zero_bubble_h1, P, M>().makespan - ideal;
  const double flush = timeline<Schedule::one_f_one_b, P, M>().makespan - ideal;
  return zb == P - 1 && flush == 3 * (P - 1);
}
static_assert(zb_h1_bubble<2, 2>() && zb_h1_bubble<2, 4>() && zb_h1_bubble<2, 6>() && zb_h1_bubble<4, 4>() &&
              zb_h1_bubble<4, 8>() && zb_h1_bubble<4, 12>());

// ZB-V, with a chunk's F = B = W = 1: for m >= 2p-1 the step is 6m + p - 1, the least any schedule can take, since
// the last stage cannot start before p-1 forwards have reached it. That is (p-1)/(6m) of the ideal, a sixth of
// 1F1B's bubble on the same model (a 1F1B stage is two chunks: costs 2, 2, 2). With m = p < 2p-1 the warm-up is
// short and the bubble larger: 2 units for p = 2, 6 for p = 4.
template <int P, int M>
constexpr double zb_v_bubble_units() {
  return timeline<Schedule::zero_bubble_v, P, M>().makespan - 6.0 * M;
}
static_assert(zb_v_bubble_units<2, 4>() == 1 && zb_v_bubble_units<2, 6>() == 1);
static_assert(zb_v_bubble_units<4, 8>() == 3 && zb_v_bubble_units<4, 12>() == 3);
static_assert(zb_v_bubble_units<2, 2>() == 2 && zb_v_bubble_units<4, 4>() == 6);
static_assert(near(timeline<Schedule::zero_bubble_v, 4, 8>().bubble_ratio, 3.0 / 48.0));

// What the paper calls zero bubble: no stage idles between its first and its last action. Stage s runs from s to
// 6m + s, a parallelogram; only the stagger at the ends is left.
template <int P, int M>
constexpr bool zb_v_parallelogram() {
  const auto tl = timeline<Schedule::zero_bubble_v, P, M>();
  const auto t = pl::make_schedule<Schedule::zero_bubble_v, P, M>();
  for (int s = 0; s < P; ++s) {
    double first = -1, last = 0;
    const auto list = t.stage(s);
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (!pl::is_compute(list[i].kind)) continue;
      if (first < 0) first = tl.stage(s)[i].start;
      last = tl.stage(s)[i].end;
    }
    if (first != s || last != 6 * M + s || tl.busy[static_cast<std::size_t>(s)] != 6 * M) return false;
  }
  return true;
}
static_assert(zb_v_parallelogram<2, 4>() && zb_v_parallelogram<4, 8>() && zb_v_parallelogram<4, 12>());
static_assert(timeline<Schedule::one_f_one_b, 4, 8>(pl::Costs{2, 2, 2}).makespan - 48 == 6 * 3);

// ---- a hand-written table, checked at compile time -----------------------------------------------------------------
constexpr Action F(int m) { return {Kind::F, m, 0, -1}; }
constexpr Action BW(int m) { return {Kind::BW, m, 0, -1}; }
constexpr Action send_act(int m, int to) { return {Kind::send_act, m, 0, to}; }
constexpr Action recv_act(int m, int from) { return {Kind::recv_act, m, 0, from}; }
constexpr Action send_grad(int m, int to) { return {Kind::send_grad, m, 0, to}; }
constexpr Action recv_grad(int m, int from) { return {Kind::recv_grad, m, 0, from}; }

constexpr auto two_stage_gpipe = pl::make_table<2, 8>(
    Schedule::gpipe, 2, 1,
    {{F(0), send_act(0, 1), F(1), send_act(1, 1), recv_grad(0, 1), BW(0), recv_grad(1, 1), BW(1)},
     {recv_act(0, 0), F(0), recv_act(1, 0), F(1), BW(0), send_grad(0, 0), BW(1), send_grad(1, 0)}});
constexpr auto checked = pl::checked_schedule<two_stage_gpipe>();
static_assert(checked.length[1] == 8 && pl::verify(checked).peak_in_flight[1] == 2);

// ---- run-time sweep ------------------------------------------------------------------------------------------------
struct Case {
  Schedule s;
  int p, m, v;
};

std::vector<Case> sweep() {
  std::vector<Case> cases;
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::interleaved, Schedule::zero_bubble_h1,
                     Schedule::zero_bubble_v})
    for (int p = 1; p <= 8; ++p)
      for (int m = 1; m <= 3 * p + 1; ++m) {
        if (s == Schedule::interleaved) {
          if (m % p != 0) continue;
          for (int v = 2; v <= 4; ++v) cases.push_back({s, p, m, v});
        } else {
          cases.push_back({s, p, m, 1});
        }
      }
  return cases;
}

std::string name(const Case& c) {
  return std::string(loom::describe_schedule(c.s)) + " p=" + std::to_string(c.p) + " m=" + std::to_string(c.m) +
         " v=" + std::to_string(c.v);
}

TEST_CASE("every schedule verifies, holds its bound and has its bubble", "[pipeline]") {
  for (const Case& c : sweep()) {
    INFO(name(c));
    const pl::RuntimeTable t = pl::make_schedule_checked(c.s, c.p, c.m, c.v);
    const pl::VerifyResult r = pl::verify(t);
    REQUIRE(r.ok);
    for (int s = 0; s < c.p; ++s) CHECK(r.peak_in_flight[s] == pl::activation_bound(c.s, c.p, c.m, t.chunks, s));

    // One F and one backward per (micro-batch, virtual stage), each on the stage that holds it.
    const int K = c.p * t.chunks;
    std::vector<int> forwards(static_cast<std::size_t>(c.m * K)), backwards(static_cast<std::size_t>(c.m * K));
    for (int s = 0; s < c.p; ++s)
      for (const Action& a : t.stage(s)) {
        const int k = pl::virtual_stage(c.s, c.p, s, a.chunk);
        if (a.kind == Kind::F) ++forwards[static_cast<std::size_t>(a.micro * K + k)];
        if (a.kind == Kind::B || a.kind == Kind::BW) ++backwards[static_cast<std::size_t>(a.micro * K + k)];
      }
    CHECK(std::count(forwards.begin(), forwards.end(), 1) == c.m * K);
    CHECK(std::count(backwards.begin(), backwards.end(), 1) == c.m * K);

    const pl::RuntimeTimeline tl = pl::simulate(t);
    REQUIRE(tl.completed);
    CHECK(tl.makespan == r.makespan);
    const double per_stage = 3.0 * c.m * t.chunks;
    switch (c.s) {
      case Schedule::gpipe:
      case Schedule::one_f_one_b: CHECK(tl.bubble == Approx(double(c.p - 1) / (c.m + c.p - 1))); break;
      case Schedule::interleaved: CHECK(tl.bubble_ratio == Approx(double(c.p - 1) / (c.v * c.m))); break;
      case Schedule::zero_bubble_h1:
        if (c.m >= c.p) CHECK(tl.makespan == per_stage + c.p - 1);
        break;
      case Schedule::zero_bubble_v:
        if (c.m >= 2 * c.p - 1) CHECK(tl.makespan == per_stage + c.p - 1);
        break;
    }
    if (c.p == 1) {  // nothing to exchange with
      for (const Action& a : t.stage(0)) CHECK(pl::is_compute(a.kind));
      CHECK(tl.bubble == 0);
    }
  }
}

template <Schedule S, int P, int M, int V = 1>
void check_same_as_constexpr() {
  constexpr auto ct = pl::make_schedule<S, P, M, V>();
  const pl::RuntimeTable rt = pl::make_schedule_checked(S, P, M, V);
  CHECK(rt.micro_batches == ct.micro_batches);
  CHECK(rt.chunks == ct.chunks);
  for (int s = 0; s < P; ++s) {
    const auto a = ct.stage(s);
    const auto b = rt.stage(s);
    CHECK(std::equal(a.begin(), a.end(), b.begin(), b.end()));
  }
}

TEST_CASE("the run-time tables are the compile-time ones", "[pipeline]") {
  check_same_as_constexpr<Schedule::gpipe, 4, 8>();
  check_same_as_constexpr<Schedule::one_f_one_b, 4, 2>();
  check_same_as_constexpr<Schedule::interleaved, 4, 8, 2>();
  check_same_as_constexpr<Schedule::zero_bubble_h1, 2, 6>();
  check_same_as_constexpr<Schedule::zero_bubble_v, 4, 12>();
  check_same_as_constexpr<Schedule::zero_bubble_v, 4, 12, 2>();
}

TEST_CASE("tables complete under any costs, and the timing respects every dependency", "[pipeline]") {
  const pl::Costs costs[] = {{1, 2, 0.5}, {1.3, 2.1, 0.7}, {3, 1, 1}, {1, 1, 4}};
  for (const Case& c : sweep()) {
    if (c.p > 4 || c.m > 2 * c.p) continue;
    const pl::RuntimeTable t = pl::make_schedule_checked(c.s, c.p, c.m, c.v);
    for (const pl::Costs& cost : costs) {
      INFO(name(c) << " costs " << cost.f << "," << cost.b << "," << cost.w);
      const pl::RuntimeTimeline tl = pl::simulate(t, cost);
      REQUIRE(tl.completed);
      const int K = c.p * t.chunks;
      // End time of F and of B/BW per (micro, virtual stage).
      std::vector<double> f_end(static_cast<std::size_t>(c.m * K)), b_end(static_cast<std::size_t>(c.m * K));
      for (int s = 0; s < c.p; ++s) {
        double last = 0;
        const auto list = t.stage(s);
        for (std::size_t i = 0; i < list.size(); ++i) {
          const pl::Slot slot = tl.stage(s)[i];
          // One action at a time, in list order (the exchanges of one batch are issued together).
          if (pl::is_compute(list[i].kind)) CHECK(slot.start >= last);
          last = std::max(last, slot.end);
          const int k = pl::virtual_stage(c.s, c.p, s, list[i].chunk);
          const auto at = static_cast<std::size_t>(list[i].micro * K + k);
          if (list[i].kind == Kind::F) f_end[at] = slot.end;
          if (list[i].kind == Kind::B || list[i].kind == Kind::BW) b_end[at] = slot.end;
        }
      }
      for (int s = 0; s < c.p; ++s) {
        const auto list = t.stage(s);
        for (std::size_t i = 0; i < list.size(); ++i) {
          const int k = pl::virtual_stage(c.s, c.p, s, list[i].chunk);
          const double start = tl.stage(s)[i].start;
          if (list[i].kind == Kind::F && k > 0) CHECK(start >= f_end[static_cast<std::size_t>(list[i].micro * K + k - 1)]);
          if ((list[i].kind == Kind::B || list[i].kind == Kind::BW) && k < K - 1)
            CHECK(start >= b_end[static_cast<std::size_t>(list[i].micro * K + k + 1)]);
        }
      }
      double busy = 0;
      for (double b : tl.busy) busy += b;
      const double work = c.m * t.chunks * (cost.f + cost.b + cost.w);
      CHECK(busy == Approx(work * c.p));
      CHECK(tl.makespan >= work - 1e-9);
    }
  }
}

// ---- the verifier against broken tables ----------------------------------------------------------------------------
pl::RuntimeTable one_f_one_b_2x2() { return pl::make_schedule_checked(Schedule::one_f_one_b, 2, 2); }

int find(const pl::RuntimeTable& t, int s, Kind k, int micro) {
  const auto list = t.stage(s);
  for (std::size_t i = 0; i < list.size(); ++i)
    if (list[i].kind == k && list[i].micro == micro) return static_cast<int>(i);
  return -1;
}

TEST_CASE("the verifier names a crossed send/recv and a missing receive", "[pipeline]") {
  pl::RuntimeTable t = one_f_one_b_2x2();
  REQUIRE(pl::verify(t).ok);

  pl::RuntimeTable crossed = t;  // stage 1 receives micro-batch 1's activation where it expects micro-batch 0's
  auto& s1 = crossed.actions[1];
  std::swap(s1[static_cast<std::size_t>(find(crossed, 1, Kind::recv_act, 0))].micro,
            s1[static_cast<std::size_t>(find(crossed, 1, Kind::recv_act, 1))].micro);
  pl::VerifyResult r = pl::verify(crossed);
  CHECK_FALSE(r.ok);
  CHECK(r.problem == Problem::crossed);
  CHECK(r.stage == 0);
  CHECK(r.index == find(crossed, 0, Kind::send_act, 0));
  CHECK(r.micro == 0);

  pl::RuntimeTable missing = t;
  missing.actions[1].erase(missing.actions[1].begin() + find(missing, 1, Kind::recv_act, 1));
  r = pl::verify(missing);
  CHECK(r.problem == Problem::unmatched);
  CHECK(r.stage == 0);
  CHECK(r.micro == 1);
}

TEST_CASE("the verifier finds a deadlock and says which stage waits", "[pipeline]") {
  // Stage 0 waits for micro-batch 0's gradient before it sends micro-batch 0's activation, with a forward between
  // the two, so they are two batches.
  const auto t = pl::make_table<2, 8>(
      Schedule::gpipe, 2, 1,
      {{F(0), recv_grad(0, 1), F(1), send_act(0, 1), send_act(1, 1), BW(0), recv_grad(1, 1), BW(1)},
       {recv_act(0, 0), F(0), BW(0), send_grad(0, 0), recv_act(1, 0), F(1), BW(1), send_grad(1, 0)}});
  const pl::VerifyResult r = pl::verify(t);
  CHECK(r.problem == Problem::deadlock);
  CHECK(r.stage == 0);
  CHECK(r.index == 1);
  CHECK(r.micro == 0);
  CHECK_FALSE(pl::simulate(t).completed);

  // The same exchanges in one batch complete: the batch issues the send and the receive together.
  const auto fine = pl::make_table<2, 8>(
      Schedule::gpipe, 2, 1,
      {{F(0), F(1), recv_grad(0, 1), send_act(0, 1), send_act(1, 1), BW(0), recv_grad(1, 1), BW(1)},
       {recv_act(0, 0), F(0), BW(0), send_grad(0, 0), recv_act(1, 0), F(1), BW(1), send_grad(1, 0)}});
  CHECK(pl::verify(fine).ok);
}

TEST_CASE("the verifier checks inputs, order, repeats, completeness, peers and bounds", "[pipeline]") {
  const pl::RuntimeTable t = one_f_one_b_2x2();

  pl::RuntimeTable late = t;  // stage 1 runs F1 before receiving its activation
  {
    auto& l = late.actions[1];
    const auto i = find(late, 1, Kind::recv_act, 1), j = find(late, 1, Kind::F, 1);
    REQUIRE(i < j);
    const Action a = l[static_cast<std::size_t>(i)];
    l.erase(l.begin() + i);
    l.insert(l.begin() + j, a);  // now just after F1
  }
  pl::VerifyResult r = pl::verify(late);
  CHECK(r.problem == Problem::input_missing);
  CHECK(r.stage == 1);
  CHECK(r.micro == 1);

  pl::RuntimeTable early = t;  // stage 0 runs BW0 before its gradient arrives
  {
    auto& l = early.actions[0];
    const auto i = find(early, 0, Kind::BW, 0);
    const Action a = l[static_cast<std::size_t>(i)];
    l.erase(l.begin() + i);
    l.insert(l.begin() + find(early, 0, Kind::recv_grad, 0), a);
  }
  r = pl::verify(early);
  CHECK(r.problem == Problem::gradient_missing);
  CHECK(r.stage == 0);

  pl::RuntimeTable twice = t;
  twice.actions[1].push_back({Kind::F, 0, 0, -1});
  CHECK(pl::verify(twice).problem == Problem::duplicate);

  pl::RuntimeTable zb = pl::make_schedule_checked(Schedule::zero_bubble_h1, 2, 2);
  zb.actions[1].erase(zb.actions[1].begin() + find(zb, 1, Kind::W, 1));
  r = pl::verify(zb);
  CHECK(r.problem == Problem::incomplete);
  CHECK(r.stage == 1);
  CHECK(r.micro == 1);

  pl::RuntimeTable w_first = pl::make_schedule_checked(Schedule::zero_bubble_h1, 2, 2);
  {
    auto& l = w_first.actions[0];
    const auto i = find(w_first, 0, Kind::W, 0);
    const Action a = l[static_cast<std::size_t>(i)];
    l.erase(l.begin() + i);
    l.insert(l.begin(), a);
  }
  CHECK(pl::verify(w_first).problem == Problem::out_of_order);

  pl::RuntimeTable four = pl::make_schedule_checked(Schedule::one_f_one_b, 4, 4);
  four.actions[1][static_cast<std::size_t>(find(four, 1, Kind::send_act, 0))].peer = 3;  // skips stage 2
  r = pl::verify(four);
  CHECK(r.problem == Problem::wrong_peer);
  CHECK(r.stage == 1);

  pl::RuntimeTable gpipe_as_1f1b = pl::make_schedule_checked(Schedule::gpipe, 2, 4);
  gpipe_as_1f1b.schedule = Schedule::one_f_one_b;  // 1F1B's stage 1 holds one micro-batch, GPipe's four
  r = pl::verify(gpipe_as_1f1b);
  CHECK(r.problem == Problem::over_bound);
  CHECK(r.stage == 0);

  pl::RuntimeTable two_chunks = t;
  two_chunks.chunks = 2;
  CHECK(pl::verify(two_chunks).problem == Problem::shape);

  pl::RuntimeTable self = t;
  self.actions[0][static_cast<std::size_t>(find(self, 0, Kind::send_act, 0))].peer = 0;
  CHECK(pl::verify(self).problem == Problem::bad_action);
}

TEST_CASE("make_schedule_checked names the rule and the counts", "[pipeline]") {
  auto message = [](Schedule s, int p, int m, int v) -> std::string {
    try {
      (void)pl::make_schedule_checked(s, p, m, v);
    } catch (const loom::Error& e) {
      return e.what();
    }
    return "";
  };
  const std::string multiple = message(Schedule::interleaved, 4, 6, 2);
  CHECK(multiple.find("loom: the interleaved schedule needs the micro-batch count to be a multiple") == 0);
  CHECK(multiple.find("m = 6, p = 4") != std::string::npos);
  CHECK(message(Schedule::interleaved, 4, 2, 2).find("at least as many micro-batches as stages, got m = 2, p = 4") !=
        std::string::npos);
  CHECK(message(Schedule::interleaved, 4, 8, 1).find("v >= 2") != std::string::npos);
  CHECK(message(Schedule::one_f_one_b, 4, 0, 1).find("got m = 0") != std::string::npos);
  CHECK(message(Schedule::gpipe, 4, 8, 2).find("got v = 2") != std::string::npos);
  CHECK(message(Schedule::zero_bubble_v, 4, 8, 3).find("got v = 3") != std::string::npos);
  CHECK(message(Schedule::one_f_one_b, 0, 4, 1).find("got p = 0") != std::string::npos);
  CHECK(message(Schedule::one_f_one_b, 2, 1, 1).empty());  // fewer micro-batches than stages is fine for 1F1B
}

}  // namespace

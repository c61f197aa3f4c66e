// Tests of loom/pipeline/schedule.hpp. The schedules' facts (verified, activation bounds, bubbles in unit time) are
// static_asserts over every schedule for p in {2, 4} and m in {p, 2p, 3p}; the run-time cases sweep wider, check
// the verifier against broken tables, and time tables with unequal costs.
#include <algorithm>
#include <span>
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
    // The step in unit time from the published bubbles (ANCHORS.md), for simulate and verify alike. GPipe and 1F1B:
    // the bubble is (p-1)/(m+p-1) of the step, so the step is 3(m + p - 1). Interleaved: (p-1)/(v m) of the ideal
    // 3 m v, so 3(m v + p - 1). ZB-H1 with m >= p and ZB-V with m >= 2p - 1: p - 1 units over the ideal 3 m v (v = 2
    // for ZB-V's two chunks). Fewer micro-batches leave those two a longer warm-up, which no formula gives.
    const double per_stage = 3.0 * c.m * t.chunks;
    double step = -1;
    switch (c.s) {
      case Schedule::gpipe:
      case Schedule::one_f_one_b:
        step = 3.0 * (c.m + c.p - 1);
        CHECK(tl.bubble == Approx(double(c.p - 1) / (c.m + c.p - 1)));
        break;
      case Schedule::interleaved:
        step = 3.0 * (c.m * c.v + c.p - 1);
        CHECK(tl.bubble_ratio == Approx(double(c.p - 1) / (c.v * c.m)));
        break;
      case Schedule::zero_bubble_h1:
        if (c.m >= c.p) step = per_stage + c.p - 1;
        break;
      case Schedule::zero_bubble_v:
        if (c.m >= 2 * c.p - 1) step = per_stage + c.p - 1;
        break;
    }
    if (step >= 0) {
      CHECK(tl.makespan == step);
      CHECK(r.makespan == step);
    }
    if (c.p == 1) {  // nothing to exchange with
      for (const Action& a : t.stage(0)) CHECK(pl::is_compute(a.kind));
      CHECK(tl.bubble == 0);
    }
  }
}

// ---- tables worked out by hand -------------------------------------------------------------------------------------
// Each list below was written by hand from the schedule's order of compute actions and the rule that places the
// exchanges: run in unit time (F = B = W = 1, BW = 2), a transfer is placed at the first moment both its stages are
// between actions (after the one that produced it), on both stages, before whatever action starts at that moment;
// transfers waiting at one moment are placed in the order they were produced. The compile-time table and the
// run-time one must both be this list.

//! "F0", "BW1c1", "send_act0>1" (to stage 1), "recv_grad2c0<1" (from stage 1); chunks printed when there are two.
std::string text(std::span<const Action> list, bool chunks) {
  std::string out;
  for (const Action& a : list) {
    if (!out.empty()) out += ' ';
    out += pl::describe(a.kind);
    out += std::to_string(a.micro);
    if (chunks) out.append("c").append(std::to_string(a.chunk));
    if (pl::is_send(a.kind)) out.append(">").append(std::to_string(a.peer));
    if (pl::is_recv(a.kind)) out.append("<").append(std::to_string(a.peer));
  }
  return out;
}

template <Schedule S, int P, int M, int V = 1>
void check_hand_table(const std::vector<std::string>& stages) {
  constexpr auto ct = pl::make_schedule<S, P, M, V>();
  const pl::RuntimeTable rt = pl::make_schedule_checked(S, P, M, V);
  REQUIRE(rt.stage_count() == P);
  REQUIRE(stages.size() == static_cast<std::size_t>(P));
  for (int s = 0; s < P; ++s) {
    INFO("stage " << s);
    CHECK(text(ct.stage(s), ct.chunks > 1) == stages[static_cast<std::size_t>(s)]);
    CHECK(text(rt.stage(s), rt.chunks > 1) == stages[static_cast<std::size_t>(s)]);
  }
}

TEST_CASE("the tables for two stages are the ones worked out by hand", "[pipeline]") {
  // GPipe, m = 2: both forwards, then both backwards. Step 9 = 3(m + p - 1).
  check_hand_table<Schedule::gpipe, 2, 2>({
      "F0 send_act0>1 F1 send_act1>1 recv_grad0<1 BW0 recv_grad1<1 BW1",
      "recv_act0<0 F0 recv_act1<0 F1 BW0 send_grad0>0 BW1 send_grad1>0",
  });
  // 1F1B, m = 3: stage 0 warms up with p - 1 = 1 extra forward (F0 F1 BW0 F2 BW1 BW2), stage 1 alternates from the
  // start (F0 BW0 F1 BW1 F2 BW2). Step 12.
  check_hand_table<Schedule::one_f_one_b, 2, 3>({
      "F0 send_act0>1 F1 send_act1>1 recv_grad0<1 BW0 F2 recv_grad1<1 send_act2>1 BW1 recv_grad2<1 BW2",
      "recv_act0<0 F0 recv_act1<0 BW0 send_grad0>0 F1 BW1 send_grad1>0 recv_act2<0 F2 BW2 send_grad2>0",
  });
  // ZB-H1, m = 2: 1F1B with B and W apart, stage s holding each W back s micro-batches (stage 1: F0 B0 F1 B1 W0
  // W1). Step 7 = 3m + p - 1.
  check_hand_table<Schedule::zero_bubble_h1, 2, 2>({
      "F0 send_act0>1 F1 send_act1>1 recv_grad0<1 B0 W0 recv_grad1<1 B1 W1",
      "recv_act0<0 F0 recv_act1<0 B0 send_grad0>0 F1 B1 send_grad1>0 W0 W1",
  });
  // Interleaved, m = 2, v = 2: parts 0, 1, 2, 3 on stages 0, 1, 0, 1. Stage 0 warms up with 2(p - 1) + (v - 1)p = 4
  // forwards (all of them), stage 1 with 2. Step 15 = 3(m v + p - 1).
  check_hand_table<Schedule::interleaved, 2, 2, 2>({
      "F0c0 send_act0c0>1 F1c0 send_act1c0>1 recv_act0c1<1 F0c1 send_act0c1>1 recv_act1c1<1 F1c1 send_act1c1>1 "
      "recv_grad0c1<1 BW0c1 send_grad0c1>1 recv_grad1c1<1 BW1c1 send_grad1c1>1 recv_grad0c0<1 BW0c0 recv_grad1c0<1 "
      "BW1c0",
      "recv_act0c0<0 F0c0 recv_act1c0<0 send_act0c0>0 F1c0 recv_act0c1<0 send_act1c0>0 F0c1 recv_act1c1<0 BW0c1 "
      "send_grad0c1>0 F1c1 BW1c1 recv_grad0c0<0 send_grad1c1>0 BW0c0 recv_grad1c0<0 send_grad0c0>0 BW1c0 "
      "send_grad1c0>0",
  });
  // ZB-V, m = 3 = 2p - 1: parts 0, 1, 2, 3 on stages 0, 1, 1, 0 (the V), F, B and W of a chunk one unit each.
  // Stage 0: 3 forwards of chunk 0, 2 triples F B W of chunk 1, then B W of chunk 0 and F B W of chunk 1, then
  // B W of chunk 0 twice. Stage 1: F of chunk 0, F of chunk 1 and of chunk 0, a triple of chunk 1, F B W of chunk 0
  // and of chunk 1, B of chunk 0 and of chunk 1, B W of chunk 0, the W's left. Step 19 = 6m + p - 1.
  check_hand_table<Schedule::zero_bubble_v, 2, 3>({
      "F0c0 send_act0c0>1 F1c0 send_act1c0>1 F2c0 send_act2c0>1 recv_act0c1<1 F0c1 B0c1 send_grad0c1>1 "
      "recv_act1c1<1 W0c1 F1c1 B1c1 send_grad1c1>1 W1c1 recv_grad0c0<1 B0c0 W0c0 recv_act2c1<1 F2c1 B2c1 "
      "send_grad2c1>1 W2c1 recv_grad1c0<1 B1c0 W1c0 recv_grad2c0<1 B2c0 W2c0",
      "recv_act0c0<0 F0c0 recv_act1c0<0 F0c1 recv_act2c0<0 send_act0c1>0 F1c0 F1c1 recv_grad0c1<0 send_act1c1>0 "
      "B0c1 W0c1 F2c0 recv_grad1c1<0 B0c0 send_grad0c0>0 W0c0 F2c1 send_act2c1>0 B1c1 W1c1 recv_grad2c1<0 B1c0 "
      "send_grad1c0>0 B2c1 B2c0 send_grad2c0>0 W1c0 W2c1 W2c0",
  });
  CHECK(pl::simulate(pl::make_schedule<Schedule::gpipe, 2, 2>()).makespan == 9);
  CHECK(pl::simulate(pl::make_schedule<Schedule::one_f_one_b, 2, 3>()).makespan == 12);
  CHECK(pl::simulate(pl::make_schedule<Schedule::zero_bubble_h1, 2, 2>()).makespan == 7);
  CHECK(pl::simulate(pl::make_schedule<Schedule::interleaved, 2, 2, 2>()).makespan == 15);
  CHECK(pl::simulate(pl::make_schedule<Schedule::zero_bubble_v, 2, 3>()).makespan == 19);
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

TEST_CASE("interleaved in groups: p in a row is Megatron-LM's order, more holds more, fewer may wait on itself",
          "[pipeline]") {
  auto peaks = [](const pl::RuntimeTable& t) {
    const pl::VerifyResult r = pl::verify(t);
    REQUIRE(r.ok);
    return std::vector<int>(r.peak_in_flight.begin(), r.peak_in_flight.begin() + t.stage_count());
  };
  // Groups of p: the same table as without a group.
  const pl::RuntimeTable plain = pl::make_schedule_checked(Schedule::interleaved, 4, 16, 2);
  const pl::RuntimeTable of_p = pl::make_schedule_checked(Schedule::interleaved, 4, 16, 2, 4);
  for (int s = 0; s < 4; ++s) {
    const auto a = plain.stage(s), b = of_p.stage(s);
    CHECK(std::equal(a.begin(), a.end(), b.begin(), b.end()));
  }
  // Groups of 2p: 2(p - s - 1) + (v - 1)G + 1 in flight, G = 8 (stage 0: 6 + 8 + 1), and the same step time here.
  const pl::RuntimeTable of_8 = pl::make_schedule_checked(Schedule::interleaved, 4, 16, 2, 8);
  CHECK(of_8.group == 8);
  CHECK(peaks(of_8) == std::vector<int>{15, 13, 11, 9});
  CHECK(peaks(plain) == std::vector<int>{11, 9, 7, 5});
  CHECK(pl::simulate(of_8).makespan >= pl::simulate(plain).makespan);
  // Fewer than p: here fewer in flight for a longer step (p = 4, v = 3, m = 12, groups of 3) ...
  const pl::RuntimeTable of_3 = pl::make_schedule_checked(Schedule::interleaved, 4, 12, 3, 3);
  const pl::RuntimeTable of_4 = pl::make_schedule_checked(Schedule::interleaved, 4, 12, 3);
  CHECK(peaks(of_3) == std::vector<int>{13, 11, 9, 7});
  CHECK(peaks(of_4) == std::vector<int>{15, 13, 11, 9});
  CHECK(pl::simulate(of_3).makespan == 177);
  CHECK(pl::simulate(of_4).makespan == 117);
  // ... and for Llama 3 405B's pipeline on 8,192 GPUs (16 stages, 8 chunks, 32 micro-batches) a wait on itself for
  // every group below 16.
  for (const int g : {1, 2, 4, 8}) {
    INFO("groups of " << g);
    try {
      (void)pl::make_schedule_checked(Schedule::interleaved, 16, 32, 8, g);
      FAIL("no deadlock reported");
    } catch (const loom::Error& e) {
      CHECK(std::string(e.what()).find("waits on itself") != std::string::npos);
      CHECK(std::string(e.what()).find("in groups of " + std::to_string(g)) != std::string::npos);
    }
  }
  CHECK(peaks(pl::make_schedule_checked(Schedule::interleaved, 16, 32, 8))[1] == 141);
  // The rules: a multiple of the group, and the interleaved schedule's alone.
  CHECK_THROWS_WITH(pl::make_schedule_checked(Schedule::interleaved, 4, 12, 2, 8),
                    Catch::Contains("needs a multiple of 8, got m = 12"));
  CHECK_THROWS_WITH(pl::make_schedule_checked(Schedule::one_f_one_b, 4, 8, 1, 4),
                    Catch::Contains("the interleaved schedule's"));
}

}  // namespace

// loom/pipeline/schedule.hpp: pipeline schedules as constexpr tables (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V),
// one list of actions per stage with its sends and receives in the order they are issued, and the constexpr
// verifier and timing simulation that prove a table cannot hang and say what it costs.
//
// The contract between a table and the executor that runs it:
//
// * Stage s runs stage(s) from front to back. Compute actions (F, B, W, BW) run one at a time.
// * A maximal run of consecutive send/recv actions is issued as ONE batched exchange, which completes only when
//   every operation in it has met its counterpart on the peer (a rendezvous: a send is not buffered, it waits for
//   the receive). Operations between the same two stages match in order: the k-th send from a to b meets the k-th
//   receive at b from a, and the two carry the same value (kind, micro-batch, virtual stage).
// * `chunk` is always the chunk of the stage that owns the action: on a send, the chunk that produced the value;
//   on a receive, the chunk that will consume it.
// * Inputs: F of virtual stage k > 0 needs the activation of (micro, k) received (or, when virtual stage k-1 is on
//   the same stage, computed there). B and BW of the last virtual stage need only its F (the loss); those of other
//   virtual stages need the gradient received (or computed locally, by B/BW of k+1). W needs B of the same
//   (micro, chunk). Values that stay on one stage (ZB-V's turn at the last stage, any p = 1 pipeline) have no
//   send/recv at all.
//
// make_schedule<S, P, M, V>() builds a table at compile time and refuses to compile one that fails verify();
// make_schedule_checked(s, p, m, v) builds the same table at run time and throws loom::Error on bad counts.
#pragma once

#include <loom/config/options.hpp>
#include <loom/core/error.hpp>

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom::pipeline {

// ---- actions ---------------------------------------------------------------------------------------------------

//! F forward; BW full backward (input and weight gradient); B input gradient only; W weight gradient only.
//! send_act/recv_act move a forward activation to the next virtual stage, send_grad/recv_grad move an input
//! gradient to the previous one.
enum class Kind : std::uint8_t { F, B, W, BW, send_act, recv_act, send_grad, recv_grad };

[[nodiscard]] constexpr bool is_compute(Kind k) noexcept {
  return k == Kind::F || k == Kind::B || k == Kind::W || k == Kind::BW;
}
[[nodiscard]] constexpr bool is_send(Kind k) noexcept { return k == Kind::send_act || k == Kind::send_grad; }
[[nodiscard]] constexpr bool is_recv(Kind k) noexcept { return k == Kind::recv_act || k == Kind::recv_grad; }

//! "F", "B", "W", "BW", "send_act", "recv_act", "send_grad", "recv_grad".
[[nodiscard]] constexpr std::string_view describe(Kind k) noexcept {
  switch (k) {
    case Kind::F: return "F";
    case Kind::B: return "B";
    case Kind::W: return "W";
    case Kind::BW: return "BW";
    case Kind::send_act: return "send_act";
    case Kind::recv_act: return "recv_act";
    case Kind::send_grad: return "send_grad";
    case Kind::recv_grad: return "recv_grad";
  }
  return "?";
}

//! One entry of a stage's list.
struct Action {
  Kind kind = Kind::F;  //!< what to do
  int micro = 0;        //!< the micro-batch, 0 .. m-1
  int chunk = 0;        //!< this stage's model chunk, 0 .. v-1 (see virtual_stage)
  int peer = -1;        //!< the other stage of a send/recv; -1 on compute actions
  friend constexpr bool operator==(const Action&, const Action&) = default;
};

// ---- where the model parts live ----------------------------------------------------------------------------------

//! Model chunks per stage: 2 for zb-v whatever v says, v for interleaved, 1 for the others.
[[nodiscard]] constexpr int chunks_per_stage(Schedule s, int v) noexcept {
  return s == Schedule::zero_bubble_v ? 2 : s == Schedule::interleaved ? v : 1;
}

//! The model part (virtual stage, 0 .. P*v-1, in forward order) that chunk `chunk` of stage `stage` holds.
//! Interleaved (and every one-chunk schedule): part chunk*P + stage, Megatron-LM's assignment, so the forward pass
//! loops over the stages v times. ZB-V: a V, part `stage` going down (chunk 0) and part 2P-1-stage coming back up
//! (chunk 1), so stage P-1 holds parts P-1 and P and stage 0 holds the first and the last part.
[[nodiscard]] constexpr int virtual_stage(Schedule s, int P, int stage, int chunk) noexcept {
  if (s == Schedule::zero_bubble_v) return chunk == 0 ? stage : 2 * P - 1 - stage;
  return chunk * P + stage;
}

//! A stage and one of its chunks.
struct StageChunk {
  int stage = 0;
  int chunk = 0;
  friend constexpr bool operator==(const StageChunk&, const StageChunk&) = default;
};

//! The inverse of virtual_stage: which stage and chunk hold model part `vstage`.
[[nodiscard]] constexpr StageChunk stage_chunk(Schedule s, int P, int vstage) noexcept {
  if (s == Schedule::zero_bubble_v) return vstage < P ? StageChunk{vstage, 0} : StageChunk{2 * P - 1 - vstage, 1};
  return {vstage % P, vstage / P};
}

// ---- tables ------------------------------------------------------------------------------------------------------

//! A schedule for P stages with room for N actions per stage. make_schedule picks N as the longest stage's list.
//! `schedule` names the placement of chunks (virtual_stage) and the activation bound the verifier holds it to.
template <int P, int N>
struct Table {
  static_assert(P >= 1 && N >= 1, "loom: a pipeline table has at least one stage and room for one action");
  std::array<std::array<Action, N>, P> actions{};  //!< stage s runs actions[s][0 .. length[s]-1]
  std::array<int, P> length{};                     //!< actions per stage
  int micro_batches = 0;                           //!< m
  int chunks = 1;                                  //!< v: model chunks per stage
  Schedule schedule = Schedule::one_f_one_b;       //!< the schedule the table implements
  int group = 0;  //!< interleaved: micro-batches a chunk runs in a row (0: P, Megatron-LM's order)

  [[nodiscard]] static constexpr int stage_count() noexcept { return P; }
  [[nodiscard]] static constexpr int capacity() noexcept { return N; }
  //! The actions of stage s, in the order the stage issues them.
  [[nodiscard]] constexpr std::span<const Action> stage(int s) const {
    return {actions[static_cast<std::size_t>(s)].data(), static_cast<std::size_t>(length[static_cast<std::size_t>(s)])};
  }
};

//! The same schedule with run-time sizes (std::vector, usable in constant expressions as a temporary): what
//! make_schedule_checked returns when p, m or v are only known at run time.
struct RuntimeTable {
  std::vector<std::vector<Action>> actions;  //!< one list per stage
  int micro_batches = 0;
  int chunks = 1;
  Schedule schedule = Schedule::one_f_one_b;
  int group = 0;  //!< interleaved: micro-batches a chunk runs in a row (0: the stage count)

  [[nodiscard]] constexpr int stage_count() const noexcept { return static_cast<int>(actions.size()); }
  [[nodiscard]] constexpr std::span<const Action> stage(int s) const { return actions[static_cast<std::size_t>(s)]; }
};

//! Table<P, N> or RuntimeTable: what verify and simulate accept.
template <class T>
concept ScheduleTable = requires(const T& t, int s) {
  { t.stage(s) } -> std::convertible_to<std::span<const Action>>;
  { t.stage_count() } -> std::convertible_to<int>;
  { t.micro_batches } -> std::convertible_to<int>;
  { t.chunks } -> std::convertible_to<int>;
  { t.schedule } -> std::convertible_to<Schedule>;
  { t.group } -> std::convertible_to<int>;
};

//! A hand-written table: one brace list of actions per stage (tests, and tables from elsewhere). Throws, and so
//! fails to compile in a constant expression, when a list does not fit.
template <int P, int N>
[[nodiscard]] constexpr Table<P, N> make_table(Schedule schedule, int micro_batches, int chunks,
                                               std::initializer_list<std::initializer_list<Action>> stages) {
  Table<P, N> t{};
  t.micro_batches = micro_batches;
  t.chunks = chunks;
  t.schedule = schedule;
  if (static_cast<int>(stages.size()) > P) throw Error("loom: make_table: more stage lists than stages");
  int s = 0;
  for (const auto& list : stages) {
    if (static_cast<int>(list.size()) > N) throw Error("loom: make_table: a stage list is longer than the capacity");
    int i = 0;
    for (const Action& a : list) t.actions[static_cast<std::size_t>(s)][static_cast<std::size_t>(i++)] = a;
    t.length[static_cast<std::size_t>(s++)] = i;
  }
  return t;
}

// ---- bounds ------------------------------------------------------------------------------------------------------

//! The most pipeline stages verify() reports on (VerifyResult keeps fixed-size arrays).
inline constexpr int max_stages = 64;

//! The most activations stage s of a schedule holds at once, counted in (micro-batch, chunk) pairs whose F is done
//! and whose B/BW is not; v is the table's chunk count.
//!   gpipe       m·v                                all micro-batches before the first backward
//!   1f1b, zb-h1 min(P - s, m)                      PipeDream-flush: P - s - 1 warm-up forwards, then one more
//!   interleaved min(2(P - s - 1) + (v - 1)G + 1, m·v)   Megatron-LM's warm-up count plus one, for groups of G
//!                                                  micro-batches a chunk runs in a row (group; 0: G = P)
//!   zb-v        min(2P, 2m, m + s + 1)             2P chunk activations = P stage activations, 1F1B's peak; fewer
//!                                                  when m < 2P - 1 leaves the warm-up short
[[nodiscard]] constexpr int activation_bound(Schedule sched, int P, int m, int v, int s, int group = 0) noexcept {
  switch (sched) {
    case Schedule::gpipe: return m * v;
    case Schedule::one_f_one_b:
    case Schedule::zero_bubble_h1: return std::min(P - s, m);
    case Schedule::interleaved: return std::min(2 * (P - s - 1) + (v - 1) * (group > 0 ? group : P) + 1, m * v);
    case Schedule::zero_bubble_v: return std::min({2 * P, 2 * m, m + s + 1});
  }
  return 0;
}

// ---- verification and timing -------------------------------------------------------------------------------------

//! Compute costs per action in any time unit; BW costs b + w; exchanges take no time.
struct Costs {
  double f = 1;  //!< F
  double b = 1;  //!< B (input gradient)
  double w = 1;  //!< W (weight gradient)
};

//! The first thing wrong with a table.
enum class Problem : std::uint8_t {
  none,
  shape,             //!< stage, micro-batch or chunk count does not fit the table's schedule
  bad_action,        //!< micro-batch, chunk or peer out of range; a compute action with a peer; a send to itself
  wrong_peer,        //!< a send/recv names a stage that does not hold the neighbouring virtual stage
  unmatched,         //!< a send or receive with no counterpart on its peer
  crossed,           //!< the k-th send from a to b and the k-th receive at b from a carry different values
  input_missing,     //!< F before its activation was received (or computed on this stage)
  gradient_missing,  //!< B/BW before its output gradient was received (or computed on this stage)
  out_of_order,      //!< B/BW before F, W before B or after BW, a send of a value not yet computed
  duplicate,         //!< a compute action or a receive given twice
  deadlock,          //!< every unfinished stage waits on an exchange that can never complete
  incomplete,        //!< a (micro-batch, virtual stage) never gets its F and its backward
  over_bound,        //!< more activations in flight than activation_bound allows
};

//! What the problem means, in words (the text of the static_assert that reports it).
[[nodiscard]] constexpr std::string_view describe(Problem p) noexcept {
  switch (p) {
    case Problem::none: return "no problem";
    case Problem::shape: return "its stage, micro-batch or chunk count does not fit its schedule";
    case Problem::bad_action: return "an action has a micro-batch, chunk or peer out of range";
    case Problem::wrong_peer: return "a send or receive names a stage that does not hold the neighbouring virtual stage";
    case Problem::unmatched: return "a send or receive has no counterpart on its peer";
    case Problem::crossed:
      return "a send meets a receive of another kind, micro-batch or virtual stage (crossed send/recv)";
    case Problem::input_missing: return "a forward runs before its activation is received";
    case Problem::gradient_missing: return "a backward runs before its output gradient is received";
    case Problem::out_of_order: return "actions out of order (B before F, W before B, a send before its value exists)";
    case Problem::duplicate: return "an action or a receive is repeated";
    case Problem::deadlock: return "it deadlocks: every unfinished stage waits on an exchange that never completes";
    case Problem::incomplete: return "a micro-batch misses its forward or backward on some virtual stage";
    case Problem::over_bound: return "more activations in flight than its schedule's bound";
  }
  return "?";
}

//! What verify() found: ok, or the first problem and where; and what the table costs.
struct VerifyResult {
  bool ok = false;
  Problem problem = Problem::none;
  int stage = -1;  //!< the stage of the first problem (-1: the whole table)
  int index = -1;  //!< its position in that stage's list (-1: found after the run)
  int micro = -1;  //!< its micro-batch
  int chunk = -1;  //!< its chunk
  std::array<int, max_stages> peak_in_flight{};  //!< per stage: most (micro, chunk) with F done and B/BW not
  std::array<int, max_stages> peak_held{};       //!< per stage: most (micro, chunk) with F done and W/BW not
  double makespan = 0;  //!< step time with the costs given to verify
  double bubble = 0;    //!< idle share of the step, 1 - busy / (P · makespan)
  constexpr explicit operator bool() const noexcept { return ok; }
};

//! When one action ran: compute actions from start to end; a send/recv from when its exchange was issued to
//! when it completed.
struct Slot {
  double start = 0;
  double end = 0;
};

//! The step as simulate() timed it, for a Table<P, N>.
template <int P, int N>
struct Timeline {
  std::array<std::array<Slot, N>, P> slots{};  //!< slots[s][i]: action i of stage s
  std::array<int, P> length{};
  std::array<double, P> busy{};  //!< compute time per stage
  double makespan = 0;           //!< end of the last action
  double bubble = 0;             //!< idle share of the step: 1 - Σ busy / (P · makespan)
  double bubble_ratio = 0;       //!< idle time over compute time: (P · makespan - Σ busy) / Σ busy
  bool completed = false;        //!< false when the table deadlocks (or fails verify in another way)
  [[nodiscard]] constexpr std::span<const Slot> stage(int s) const {
    return {slots[static_cast<std::size_t>(s)].data(), static_cast<std::size_t>(length[static_cast<std::size_t>(s)])};
  }
};

//! The step as simulate() timed it, for a RuntimeTable.
struct RuntimeTimeline {
  std::vector<std::vector<Slot>> slots;
  std::vector<double> busy;
  double makespan = 0;
  double bubble = 0;
  double bubble_ratio = 0;
  bool completed = false;
  [[nodiscard]] constexpr std::span<const Slot> stage(int s) const { return slots[static_cast<std::size_t>(s)]; }
};

}  // namespace loom::pipeline

#define LOOM_PIPELINE_SCHEDULE_INTERNAL
#include <loom/pipeline/detail/build.hpp>
#include <loom/pipeline/detail/engine.hpp>
#undef LOOM_PIPELINE_SCHEDULE_INTERNAL

namespace loom::pipeline {

//! Runs the table under the exchange semantics above and proves: every send meets exactly one receive of the same
//! kind, micro-batch and virtual stage, in the same order on both sides; no stage waits forever; every micro-batch
//! gets F, then B and W (or BW), exactly once on every virtual stage, each after its inputs; no stage holds more
//! activations than activation_bound. The result names the first problem, or gives the peaks and the step time
//! for `costs`. The run does not depend on the costs: a table that completes does so for any costs.
template <ScheduleTable T>
[[nodiscard]] constexpr VerifyResult verify(const T& table, Costs costs = {}) {
  VerifyResult r;
  if (table.stage_count() > max_stages) {
    r.problem = Problem::shape;
    return r;
  }
  auto run = detail::run(table, costs, [](int, int, double, double) {});
  r.problem = run.fault.problem;
  r.stage = run.fault.stage;
  r.index = run.fault.index;
  r.micro = run.fault.micro;
  r.chunk = run.fault.chunk;
  r.ok = r.problem == Problem::none;
  for (std::size_t s = 0; s < run.peak_in_flight.size(); ++s) {
    r.peak_in_flight[s] = run.peak_in_flight[s];
    r.peak_held[s] = run.peak_held[s];
  }
  r.makespan = run.makespan;
  r.bubble = detail::idle_share(run.busy, run.makespan);
  return r;
}

//! verify() for a compile-time table (at most max_stages stages).
template <int P, int N>
[[nodiscard]] constexpr VerifyResult verify(const Table<P, N>& table, Costs costs = {}) {
  static_assert(P <= max_stages, "loom: verify reports on at most 64 pipeline stages");
  return verify<Table<P, N>>(table, costs);
}

//! Times every action of the table with `costs` under the exchange semantics above (exchanges take no time, but a
//! batch waits for its peers): per-stage start and end of every action, the makespan and the bubble.
template <int P, int N>
[[nodiscard]] constexpr Timeline<P, N> simulate(const Table<P, N>& table, Costs costs = {}) {
  Timeline<P, N> tl;
  tl.length = table.length;
  auto run = detail::run(table, costs, [&](int s, int i, double start, double end) {
    tl.slots[static_cast<std::size_t>(s)][static_cast<std::size_t>(i)] = {start, end};
  });
  tl.completed = run.fault.problem == Problem::none;
  for (std::size_t s = 0; s < run.busy.size(); ++s) tl.busy[s] = run.busy[s];
  tl.makespan = run.makespan;
  tl.bubble = detail::idle_share(run.busy, run.makespan);
  tl.bubble_ratio = detail::idle_ratio(run.busy, run.makespan);
  return tl;
}

//! simulate() for a run-time table.
[[nodiscard]] constexpr RuntimeTimeline simulate(const RuntimeTable& table, Costs costs = {}) {
  RuntimeTimeline tl;
  tl.slots.resize(table.actions.size());
  for (std::size_t s = 0; s < table.actions.size(); ++s) tl.slots[s].resize(table.actions[s].size());
  auto run = detail::run(table, costs, [&](int s, int i, double start, double end) {
    tl.slots[static_cast<std::size_t>(s)][static_cast<std::size_t>(i)] = {start, end};
  });
  tl.completed = run.fault.problem == Problem::none;
  tl.busy = run.busy;
  tl.makespan = run.makespan;
  tl.bubble = detail::idle_share(run.busy, run.makespan);
  tl.bubble_ratio = detail::idle_ratio(run.busy, run.makespan);
  return tl;
}

namespace detail {
// Each rule of a failed verification is its own static_assert, so the compiler prints the rule; the template
// arguments (problem, stage, index in the stage's list, micro-batch, chunk) print where it was found.
template <Problem Pr, int Stage, int Index, int Micro, int Chunk>
struct TableVerified {
  static_assert(Pr != Problem::shape, "loom: pipeline table: its stage, micro-batch or chunk count does not fit its schedule");
  static_assert(Pr != Problem::bad_action, "loom: pipeline table: an action has a micro-batch, chunk or peer out of range");
  static_assert(Pr != Problem::wrong_peer,
                "loom: pipeline table: a send or receive names a stage that does not hold the neighbouring virtual stage");
  static_assert(Pr != Problem::unmatched, "loom: pipeline table: a send or receive has no counterpart on its peer");
  static_assert(Pr != Problem::crossed,
                "loom: pipeline table: a send meets a receive of another kind, micro-batch or virtual stage (crossed "
                "send/recv)");
  static_assert(Pr != Problem::input_missing, "loom: pipeline table: a forward runs before its activation is received");
  static_assert(Pr != Problem::gradient_missing,
                "loom: pipeline table: a backward runs before its output gradient is received");
  static_assert(Pr != Problem::out_of_order,
                "loom: pipeline table: actions out of order (B before F, W before B, a send before its value exists)");
  static_assert(Pr != Problem::duplicate, "loom: pipeline table: an action or a receive is repeated");
  static_assert(Pr != Problem::deadlock,
                "loom: pipeline table deadlocks: every unfinished stage waits on an exchange that never completes");
  static_assert(Pr != Problem::incomplete,
                "loom: pipeline table: a micro-batch misses its forward or backward on some virtual stage");
  static_assert(Pr != Problem::over_bound, "loom: pipeline table: more activations in flight than its schedule's bound");
  static constexpr bool value = true;
};
}  // namespace detail

//! A hand-written (or imported) table, verified at compile time: `constexpr auto t = checked_schedule<table>();`
//! does not compile when verify(table) finds a problem, and the message names it.
template <auto T>
  requires ScheduleTable<decltype(T)>
[[nodiscard]] constexpr auto checked_schedule() {
  constexpr VerifyResult r = verify(T);
  static_assert(detail::TableVerified<r.problem, r.stage, r.index, r.micro, r.chunk>::value);
  return T;
}

//! The table of schedule S for P stages and M micro-batches (V chunks per stage for interleaved; zb-v always has
//! two, V may stay 1), verified at compile time. Rules, each a static_assert with its own message:
//! P >= 1; M >= 1; V = 1 except for interleaved (V >= 2) and zb-v (V = 1 or 2); interleaved needs M >= P and
//! M % P == 0 (micro-batches go through the stages in groups of P, Megatron-LM's order). 1F1B and ZB-H1 also run
//! with M < P (fewer warm-up forwards); ZB-V needs M >= 2P - 1 to reach its small bubble but runs with fewer.
template <Schedule S, int P, int M, int V = 1>
[[nodiscard]] constexpr auto make_schedule() {
  static_assert(P >= 1, "loom: a pipeline needs at least one stage (P >= 1)");
  static_assert(P <= max_stages, "loom: a pipeline schedule has at most 64 stages");
  static_assert(M >= 1, "loom: a pipeline schedule needs at least one micro-batch (M >= 1)");
  static_assert(S == Schedule::interleaved || S == Schedule::zero_bubble_v || V == 1,
                "loom: only the interleaved schedule takes V > 1 chunks per stage (gpipe, 1f1b and zb-h1 take one)");
  static_assert(S != Schedule::zero_bubble_v || V == 1 || V == 2, "loom: zb-v has two chunks per stage (V = 2 or 1)");
  static_assert(S != Schedule::interleaved || V >= 2, "loom: the interleaved schedule needs V >= 2 chunks per stage");
  static_assert(S != Schedule::interleaved || M >= P,
                "loom: the interleaved schedule needs at least as many micro-batches as stages (M >= P)");
  static_assert(S != Schedule::interleaved || M % P == 0,
                "loom: the interleaved schedule needs the micro-batch count to be a multiple of the stage count "
                "(M % P == 0)");
  if constexpr (detail::count_rule(S, P, M, V) == detail::CountRule::ok) {
    constexpr int N = detail::capacity(S, P, M, V);
    constexpr Table<P, N> table = detail::to_table<P, N>(detail::build(S, P, M, V));
    constexpr VerifyResult r = verify(table);
    static_assert(detail::TableVerified<r.problem, r.stage, r.index, r.micro, r.chunk>::value);
    return table;
  } else {
    return Table<P, 1>{};
  }
}

//! make_schedule for counts known only at run time: throws loom::Error naming the rule and the values when the
//! counts do not fit the schedule (the same rules as make_schedule), and verifies the table it returns.
//! `group` (interleaved only; 0: p, Megatron-LM's order): the micro-batches a chunk runs in a row, as Llama 3's
//! schedule and Megatron-Core's microbatch_group_size_per_vp_stage let one choose; m must be a multiple of it. More
//! than p holds more in flight; fewer can wait on itself, which throws.
[[nodiscard]] inline RuntimeTable make_schedule_checked(Schedule s, int p, int m, int v = 1, int group = 0) {
  const std::string name(describe_schedule(s));
  switch (detail::count_rule(s, p, m, v, group)) {
    case detail::CountRule::ok: break;
    case detail::CountRule::stages:
      throw Error(loom::detail::cat("loom: a pipeline needs 1 to ", max_stages, " stages, got p = ", p));
    case detail::CountRule::micro_batches:
      throw Error(loom::detail::cat("loom: the ", name, " schedule needs at least one micro-batch, got m = ", m));
    case detail::CountRule::chunks_not_interleaved:
      throw Error(loom::detail::cat("loom: the ", name, " schedule takes one chunk per stage, got v = ", v,
                                    " (only interleaved takes v > 1)"));
    case detail::CountRule::chunks_zb_v:
      throw Error(loom::detail::cat("loom: zb-v has two chunks per stage, got v = ", v));
    case detail::CountRule::chunks_interleaved:
      throw Error(loom::detail::cat("loom: the interleaved schedule needs v >= 2 chunks per stage, got v = ", v));
    case detail::CountRule::interleaved_too_few:
      throw Error(loom::detail::cat("loom: the interleaved schedule needs at least as many micro-batches as stages, "
                                    "got m = ", m, ", p = ", p));
    case detail::CountRule::interleaved_not_multiple:
      throw Error(loom::detail::cat("loom: the interleaved schedule needs the micro-batch count to be a multiple of "
                                    "the stage count, got m = ", m, ", p = ", p));
    case detail::CountRule::group_not_interleaved:
      throw Error(loom::detail::cat("loom: a group of micro-batches run in a row is the interleaved schedule's, at "
                                    "least 1; got ", group, " for ", name));
    case detail::CountRule::group_not_multiple:
      throw Error(loom::detail::cat("loom: the interleaved schedule in groups of ", group, " micro-batches needs a "
                                    "multiple of ", group, ", got m = ", m));
  }
  const std::string groups = group ? loom::detail::cat(", in groups of ", group) : std::string();
  RuntimeTable t;
  try {
    t = detail::build(s, p, m, v, group == p ? 0 : group);
  } catch (const Error& e) {
    std::string_view why = e.what();
    if (why.starts_with("loom: ")) why.remove_prefix(6);
    throw Error(loom::detail::cat("loom: the ", name, " schedule for p = ", p, ", m = ", m, ", v = ", v, groups,
                                  ": ", why));
  }
  const VerifyResult r = verify(t);
  if (!r.ok)
    throw Error(loom::detail::cat("loom: the ", name, " table for p = ", p, ", m = ", m, ", v = ", v, groups,
                                  " fails verification: ", describe(r.problem), " (stage ", r.stage, ", action ",
                                  r.index, ", micro-batch ", r.micro, ", chunk ", r.chunk, ")"));
  return t;
}

}  // namespace loom::pipeline

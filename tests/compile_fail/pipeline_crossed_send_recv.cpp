// expect: loom: pipeline table: a send meets a receive of another kind, micro-batch or virtual stage (crossed send/recv)
// Stage 0 sends micro-batch 0's activation, then micro-batch 1's; stage 1 receives them the other way round.
#include <loom/pipeline/schedule.hpp>

using namespace loom::pipeline;
using loom::Schedule;

constexpr Action F(int m) { return {Kind::F, m, 0, -1}; }
constexpr Action BW(int m) { return {Kind::BW, m, 0, -1}; }

constexpr auto table = make_table<2, 8>(
    Schedule::gpipe, 2, 1,
    {{F(0), F(1), {Kind::send_act, 0, 0, 1}, {Kind::send_act, 1, 0, 1}, {Kind::recv_grad, 0, 0, 1}, BW(0),
      {Kind::recv_grad, 1, 0, 1}, BW(1)},
#ifdef LOOM_FAIL
     {{Kind::recv_act, 1, 0, 0}, {Kind::recv_act, 0, 0, 0},
#else
     {{Kind::recv_act, 0, 0, 0}, {Kind::recv_act, 1, 0, 0},
#endif
      F(0), F(1), BW(0), {Kind::send_grad, 0, 0, 0}, BW(1), {Kind::send_grad, 1, 0, 0}}});

constexpr auto checked = checked_schedule<table>();
int main() { return checked.length[0] == 8 ? 0 : 1; }

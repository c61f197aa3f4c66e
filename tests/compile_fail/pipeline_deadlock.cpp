// expect: loom: pipeline table deadlocks: every unfinished stage waits on an exchange that never completes
// Stage 0 waits for micro-batch 0's gradient before it sends micro-batch 0's activation: with a forward between
// the two they are separate exchanges, and stage 1 cannot produce the gradient without the activation.
#include <loom/pipeline/schedule.hpp>

using namespace loom::pipeline;
using loom::Schedule;

constexpr Action F(int m) { return {Kind::F, m, 0, -1}; }
constexpr Action BW(int m) { return {Kind::BW, m, 0, -1}; }

constexpr auto table = make_table<2, 8>(
    Schedule::gpipe, 2, 1,
#ifdef LOOM_FAIL
    {{F(0), {Kind::recv_grad, 0, 0, 1}, F(1), {Kind::send_act, 0, 0, 1}, {Kind::send_act, 1, 0, 1}, BW(0),
#else
    {{F(0), F(1), {Kind::recv_grad, 0, 0, 1}, {Kind::send_act, 0, 0, 1}, {Kind::send_act, 1, 0, 1}, BW(0),
#endif
      {Kind::recv_grad, 1, 0, 1}, BW(1)},
     {{Kind::recv_act, 0, 0, 0}, F(0), BW(0), {Kind::send_grad, 0, 0, 0}, {Kind::recv_act, 1, 0, 0}, F(1), BW(1),
      {Kind::send_grad, 1, 0, 0}}});

constexpr auto checked = checked_schedule<table>();
int main() { return checked.length[0] == 8 ? 0 : 1; }

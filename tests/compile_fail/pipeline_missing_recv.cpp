// expect: loom: pipeline table: a send or receive has no counterpart on its peer
// Stage 1 forgets to receive micro-batch 1's activation: stage 0's second send would wait forever.
#include <loom/pipeline/schedule.hpp>

using namespace loom::pipeline;
using loom::Schedule;

constexpr Action F(int m) { return {Kind::F, m, 0, -1}; }
constexpr Action BW(int m) { return {Kind::BW, m, 0, -1}; }

constexpr auto table = make_table<2, 8>(
    Schedule::gpipe, 2, 1,
    {{F(0), {Kind::send_act, 0, 0, 1}, F(1), {Kind::send_act, 1, 0, 1}, {Kind::recv_grad, 0, 0, 1}, BW(0),
      {Kind::recv_grad, 1, 0, 1}, BW(1)},
     {{Kind::recv_act, 0, 0, 0}, F(0),
#ifndef LOOM_FAIL
      {Kind::recv_act, 1, 0, 0},
#endif
      F(1), BW(0), {Kind::send_grad, 0, 0, 0}, BW(1), {Kind::send_grad, 1, 0, 0}}});

constexpr auto checked = checked_schedule<table>();
int main() { return checked.length[1] == 8 ? 0 : 1; }

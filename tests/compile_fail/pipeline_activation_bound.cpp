// expect: loom: pipeline table: more activations in flight than its schedule's bound
// GPipe's table (every forward before any backward) labelled 1F1B: its stage 0 holds all 3 micro-batches, where
// 1F1B allows p - 0 = 2.
#include <loom/pipeline/schedule.hpp>

using namespace loom::pipeline;
using loom::Schedule;

#ifdef LOOM_FAIL
constexpr Schedule label = Schedule::one_f_one_b;
#else
constexpr Schedule label = Schedule::gpipe;
#endif

constexpr auto table = [] {
  auto t = make_schedule<Schedule::gpipe, 2, 3>();
  t.schedule = label;
  return t;
}();
constexpr auto checked = checked_schedule<table>();
int main() { return checked.micro_batches == 3 ? 0 : 1; }

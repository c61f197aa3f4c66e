// expect: loom: only the interleaved schedule takes V > 1 chunks per stage (gpipe, 1f1b and zb-h1 take one)
#include <loom/pipeline/schedule.hpp>

#ifdef LOOM_FAIL
constexpr loom::Schedule schedule = loom::Schedule::one_f_one_b;
#else
constexpr loom::Schedule schedule = loom::Schedule::interleaved;
#endif
constexpr auto table = loom::pipeline::make_schedule<schedule, 4, 8, 2>();
int main() { return table.chunks == 2 ? 0 : 1; }

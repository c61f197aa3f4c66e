// expect: loom: the interleaved schedule needs at least as many micro-batches as stages (M >= P)
#include <loom/pipeline/schedule.hpp>

#ifdef LOOM_FAIL
constexpr int micro_batches = 2;
#else
constexpr int micro_batches = 4;
#endif
constexpr auto table = loom::pipeline::make_schedule<loom::Schedule::interleaved, 4, micro_batches, 2>();
int main() { return table.micro_batches == micro_batches ? 0 : 1; }

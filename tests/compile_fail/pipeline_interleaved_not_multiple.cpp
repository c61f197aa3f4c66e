// expect: loom: the interleaved schedule needs the micro-batch count to be a multiple of the stage count (M % P == 0)
#include <loom/pipeline/schedule.hpp>

#ifdef LOOM_FAIL
constexpr int micro_batches = 6;
#else
constexpr int micro_batches = 8;
#endif
constexpr auto table = loom::pipeline::make_schedule<loom::Schedule::interleaved, 4, micro_batches, 2>();
int main() { return table.micro_batches == micro_batches ? 0 : 1; }

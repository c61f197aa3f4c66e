// expect: loom: a pipeline schedule needs at least one micro-batch (M >= 1)
// Fewer micro-batches than stages is fine for 1F1B (stage s warms up with min(p - s - 1, m) forwards); none is not.
#include <loom/pipeline/schedule.hpp>

#ifdef LOOM_FAIL
constexpr int micro_batches = 0;
#else
constexpr int micro_batches = 1;
#endif
constexpr auto table = loom::pipeline::make_schedule<loom::Schedule::one_f_one_b, 4, micro_batches>();
int main() { return table.micro_batches == micro_batches ? 0 : 1; }

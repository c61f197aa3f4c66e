// expect: loom: with sequence parallelism max_seq must be divisible by TP
#include <loom/models/gpt.hpp>

constexpr loom::models::GptShape shape{1, 4, 4, 16, 32, 6};
#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::TP<4, loom::SequenceParallel>>;  // 6 positions over 4 ranks
#else
using Cfg = loom::Parallel<loom::TP<2, loom::SequenceParallel>>;
#endif
static_assert(loom::models::Gpt<shape, float, Cfg>::sequence_parallel);
int main() {}

// expect: loom: SequenceParallel is an option of TP
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::TP<2>, loom::CP<2, loom::SequenceParallel>>;
#else
using C = loom::Parallel<loom::TP<2, loom::SequenceParallel>, loom::CP<2>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

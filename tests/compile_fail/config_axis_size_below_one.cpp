// expect: loom: an axis size must be at least 1
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::TP<2>, loom::DP<0>>;
#else
using C = loom::Parallel<loom::TP<2>, loom::DP<1>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

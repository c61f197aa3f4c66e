// expect: loom: an axis is given more than once in Parallel<...>
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::TP<2>, loom::DP<2>, loom::TP<2>>;
#else
using C = loom::Parallel<loom::TP<2>, loom::DP<2>, loom::PP<2>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

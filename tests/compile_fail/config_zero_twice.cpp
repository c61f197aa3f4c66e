// expect: loom: an axis is given two options of the same family
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::DP<2, loom::ZeRO<1>, loom::ZeRO<2>>>;
#else
using C = loom::Parallel<loom::DP<2, loom::ZeRO<2>>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

// expect: loom: EP must divide DP*CP
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::DP<4>, loom::CP<2>, loom::EP<3>>;
#else
using C = loom::Parallel<loom::DP<4>, loom::CP<2>, loom::EP<8>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

// expect: loom: ZeRO<k> needs k in 0..3
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::DP<8, loom::ZeRO<4>>>;
#else
using C = loom::Parallel<loom::DP<8, loom::ZeRO<3>>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

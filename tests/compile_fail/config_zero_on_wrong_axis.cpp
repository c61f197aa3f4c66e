// expect: loom: ZeRO<k> is an option of DP
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::TP<2, loom::ZeRO<1>>, loom::DP<2>>;
#else
using C = loom::Parallel<loom::TP<2>, loom::DP<2, loom::ZeRO<1>>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

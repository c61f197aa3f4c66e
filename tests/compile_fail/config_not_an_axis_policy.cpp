// expect: loom: a type given to Parallel<...> is not an axis policy
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::TP<2>, loom::ZeRO<1>>;
#else
using C = loom::Parallel<loom::TP<2>, loom::DP<1, loom::ZeRO<1>>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

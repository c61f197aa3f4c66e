// expect: loom: a type given as an option of an axis is not a loom option
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::TP<2, loom::DP<2>>>;
#else
using C = loom::Parallel<loom::TP<2>, loom::DP<2>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

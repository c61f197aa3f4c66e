// expect: loom: Interleaved<v> is an option of PP
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::DP<2, loom::Interleaved<2>>, loom::PP<2>>;
#else
using C = loom::Parallel<loom::DP<2>, loom::PP<2, loom::Interleaved<2>>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

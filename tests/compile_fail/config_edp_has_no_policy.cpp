// expect: loom: edp has no policy of its own
#include <loom/config.hpp>
using C = loom::Parallel<loom::DP<4>, loom::EP<2>>;
#ifdef LOOM_FAIL
using P = C::policy<loom::Axis::edp>;
#else
using P = C::policy<loom::Axis::ep>;
#endif
static_assert(P::size == 2);
int main() {}

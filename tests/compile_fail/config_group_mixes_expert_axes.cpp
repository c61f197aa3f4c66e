// expect: loom: a group cannot mix ep/edp with cp/dp
#include <loom/config.hpp>
using C = loom::Parallel<loom::TP<2>, loom::DP<4>, loom::EP<2>>;
#ifdef LOOM_FAIL
constexpr auto g = C::group<loom::Axis::ep, loom::Axis::dp>(0);
#else
constexpr auto g = C::group<loom::Axis::ep, loom::Axis::tp>(0);
#endif
static_assert(g[0] == 0);
int main() {}

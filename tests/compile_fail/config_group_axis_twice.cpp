// expect: loom: an axis is listed more than once in group<...>
#include <loom/config.hpp>
using C = loom::Parallel<loom::TP<2>, loom::DP<4>>;
#ifdef LOOM_FAIL
constexpr int i = C::group_index<loom::Axis::dp, loom::Axis::tp, loom::Axis::dp>(3);
#else
constexpr int i = C::group_index<loom::Axis::dp, loom::Axis::tp>(3);
#endif
static_assert(i == 0);
int main() {}

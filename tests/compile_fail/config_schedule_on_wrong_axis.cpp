// expect: loom: a pipeline schedule (GPipe, OneFOneB, ZeroBubbleH1, ZeroBubbleV) is an option of PP
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::DP<2, loom::ZeroBubbleH1>, loom::PP<2>>;
#else
using C = loom::Parallel<loom::DP<2>, loom::PP<2, loom::ZeroBubbleH1>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

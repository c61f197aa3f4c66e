// expect: loom: KeepGathered keeps ZeRO-3's gathered parameters, so it goes with DP<n, ZeRO<3>>
#include <loom/config.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::DP<4, loom::ZeRO<2>, loom::KeepGathered>>;
#else
using Cfg = loom::Parallel<loom::DP<4, loom::ZeRO<3>, loom::KeepGathered>>;
#endif
static_assert(Cfg::keep_gathered);
int main() {}

// expect: loom: ZeRO<3> under pipeline parallelism needs DP<n, ZeRO<3>, KeepGathered>
#include <loom/config.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::PP<2, loom::GPipe>, loom::DP<2, loom::ZeRO<3>>>;
#else
using Cfg = loom::Parallel<loom::PP<2, loom::GPipe>, loom::DP<2, loom::ZeRO<3>, loom::KeepGathered>>;
#endif
static_assert(Cfg::zero_stage == 3 && Cfg::name() == "pp2.gpipe.dp2.zero3.keep");
int main() {}

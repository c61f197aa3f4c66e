// expect: loom: HybridShard<s> needs s to divide the data-parallel size n
#include <loom/config.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::DP<8, loom::ZeRO<3>, loom::HybridShard<3>>>;
#else
using Cfg = loom::Parallel<loom::DP<8, loom::ZeRO<3>, loom::HybridShard<4>>>;
#endif
static_assert(Cfg::shard_group == 4 && Cfg::name() == "dp8.zero3.shard4");
int main() {}

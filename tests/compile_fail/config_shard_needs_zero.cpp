// expect: loom: HybridShard<s> shards ZeRO's state over groups of s data-parallel ranks: it needs DP<n, ZeRO<k>>
#include <loom/config.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::DP<4, loom::HybridShard<2>>>;
#else
using Cfg = loom::Parallel<loom::DP<4, loom::ZeRO<1>, loom::HybridShard<2>>>;
#endif
static_assert(Cfg::shard_group == 2);
int main() {}

// expect: loom: DP<n, ZeRO<k>, HybridShard<s>> with EP<m> (m > 1) is not implemented yet
#include <loom/comm/local.hpp>
#include <loom/train/trainer.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::DP<4, loom::ZeRO<1>, loom::HybridShard<2>>, loom::EP<2>>;
#else
using Cfg = loom::Parallel<loom::DP<4, loom::ZeRO<1>, loom::HybridShard<2>>, loom::EP<1>>;
#endif
// What a trainer takes from the layout, for rank ctx.
[[maybe_unused]] auto rank_of(loom::Context<Cfg, loom::comm::Local>& ctx) { return loom::train::rank_in_layout(ctx); }
int main() {}

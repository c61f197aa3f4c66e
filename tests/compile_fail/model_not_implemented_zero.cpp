// expect: loom: DP<n, ZeRO<k>> with k > 0 (sharded data parallelism) is not implemented yet
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::DP<2, loom::ZeRO<1>>>;
#else
using Cfg = loom::Parallel<loom::DP<2, loom::ZeRO<0>>>;
#endif
// The model part of the layout, which trainers declare their models with.
static_assert(std::is_same_v<loom::models::ModelLayout<Cfg>, loom::Parallel<>>);
int main() {}

// expect: loom: DP<n, ZeRO<3>> (sharded parameters, FSDP) is not implemented yet
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::DP<2, loom::ZeRO<3>>>;
#else
using Cfg = loom::Parallel<loom::DP<2, loom::ZeRO<2>>>;
#endif
// The model part of the layout, which trainers declare their models with: ZeRO<2> does not change the model.
static_assert(std::is_same_v<loom::models::ModelLayout<Cfg>, loom::Parallel<>>);
int main() {}

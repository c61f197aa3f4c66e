// expect: loom: the experts must be divisible by EP
#include <loom/models/gpt.hpp>

constexpr loom::models::GptShape shape{1, 2, 2, 8, 16, 8, 0, 6, 2};
#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::DP<4>, loom::EP<4>>;  // 6 experts over 4 ranks
#else
using Cfg = loom::Parallel<loom::DP<4>, loom::EP<2>>;
#endif
static_assert(loom::models::Gpt<shape, float, loom::models::ModelLayout<Cfg>>::ep_size > 1);
int main() {}

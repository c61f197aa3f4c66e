// expect: loom: the experts must be divisible by EP
#include <loom/models/gpt.hpp>

constexpr loom::models::GptShape shape{1, 2, 2, 8, 16, 8, 0, 6, 2};
#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::DP<4>, loom::EP<4>>;  // 6 experts over 4 ranks
#else
using Cfg = loom::Parallel<loom::DP<4>, loom::EP<2>>;
#endif
// The rules a trainer checks for a shape on the whole layout.
static_assert(loom::models::LayoutRules<shape, Cfg>::ok);
int main() {}

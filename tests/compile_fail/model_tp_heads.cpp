// expect: loom: heads must be divisible by TP
#include <loom/models/gpt.hpp>

constexpr loom::models::GptShape shape{1, 6, 6, 24, 32, 8};
#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::TP<4>>;  // 6 heads over 4 ranks
#else
using Cfg = loom::Parallel<loom::TP<2>>;
#endif
static_assert(loom::models::Gpt<shape, float, Cfg>::tp_size > 1);
int main() {}

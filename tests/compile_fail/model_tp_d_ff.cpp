// expect: loom: d_ff must be divisible by TP
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
constexpr loom::models::GptShape shape{1, 8, 8, 32, 32, 8, 100};  // an MLP of 100 features over 8 ranks
#else
constexpr loom::models::GptShape shape{1, 8, 8, 32, 32, 8, 104};
#endif
static_assert(loom::models::Gpt<shape, float, loom::Parallel<loom::TP<8>>>::tp_size == 8);
int main() {}

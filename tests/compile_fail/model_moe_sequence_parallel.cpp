// expect: loom: a mixture-of-experts model routes whole sequences on a rank
#include <loom/models/gpt.hpp>

constexpr loom::models::GptShape shape{1, 2, 2, 8, 16, 8, 0, 4, 2};
#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::TP<2, loom::SequenceParallel>>;  // each rank would route a share of a sequence
#else
using Cfg = loom::Parallel<loom::TP<2>>;
#endif
static_assert(loom::models::Gpt<shape, float, Cfg>::tp_size == 2);
int main() {}

// expect: loom: CP<n, Ulysses> needs each tensor-parallel rank's heads (heads / TP) divisible by n
#include <loom/models/gpt.hpp>

constexpr loom::models::GptShape shape{1, 4, 4, 16, 16, 16};
#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::TP<2>, loom::CP<4, loom::Ulysses>>;  // 2 heads per tp rank over 4 cp ranks
#else
using Cfg = loom::Parallel<loom::TP<2>, loom::CP<4>>;  // ring attention takes any number of heads
#endif
static_assert(loom::models::Gpt<shape, float, loom::models::ModelLayout<Cfg>>::cp_size == 4);
int main() {}

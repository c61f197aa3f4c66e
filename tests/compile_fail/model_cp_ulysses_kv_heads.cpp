// expect: loom: CP<n, Ulysses> needs each tensor-parallel rank's key/value heads divisible by n
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
constexpr loom::models::GptShape shape{1, 4, 1, 16, 16, 16};  // multi-query attention: one kv head
#else
constexpr loom::models::GptShape shape{1, 4, 2, 16, 16, 16};
#endif
using Cfg = loom::Parallel<loom::CP<2, loom::Ulysses>>;
static_assert(loom::models::Gpt<shape, float, loom::models::ModelLayout<Cfg>>::cp_size == 2);
int main() {}

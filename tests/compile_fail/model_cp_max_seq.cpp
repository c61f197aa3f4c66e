// expect: loom: CP<n> cuts each sequence into 2n chunks: max_seq must be at least 2n
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
constexpr loom::models::GptShape shape{1, 2, 2, 8, 16, 6};
#else
constexpr loom::models::GptShape shape{1, 2, 2, 8, 16, 8};
#endif
using Cfg = loom::Parallel<loom::CP<4>>;
static_assert(loom::models::Gpt<shape, float, loom::models::ModelLayout<Cfg>>::cp_size == 4);
int main() {}

// expect: loom: CP<n> with n > 1 (context parallelism) is not implemented yet
#include <loom/models/gpt.hpp>

constexpr loom::models::GptShape shape{1, 2, 2, 8, 16, 8};
#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::CP<2>>;
#else
using Cfg = loom::Parallel<loom::CP<1>>;
#endif
// A model declared with the whole layout.
static_assert(loom::models::Gpt<shape, float, Cfg>::tp_size == 1);
int main() {}

// expect: loom: the vocabulary must have at least TP entries
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
constexpr loom::models::GptShape shape{1, 4, 4, 16, 3, 8};  // 3 entries over 4 ranks
#else
constexpr loom::models::GptShape shape{1, 4, 4, 16, 5, 8};  // 5 entries: 2, 2, 1, 0 rows
#endif
static_assert(loom::models::Gpt<shape, float, loom::Parallel<loom::TP<4>>>::tp_size == 4);
int main() {}

// expect: loom: kv_heads and TP must divide one another
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
constexpr loom::models::GptShape shape{1, 12, 3, 48, 32, 8};  // 3 kv heads over 4 ranks: neither split nor shared
#else
constexpr loom::models::GptShape shape{1, 12, 2, 48, 32, 8};  // 2 kv heads, each shared by 2 of the 4 ranks
#endif
static_assert(loom::models::Gpt<shape, float, loom::Parallel<loom::TP<4>>>::tp_size == 4);
int main() {}

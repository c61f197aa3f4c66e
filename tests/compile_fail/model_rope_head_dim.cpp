// expect: loom: rotary positions need an even head_dim
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
constexpr loom::models::GptShape shape = loom::models::llama3_spec({1, 4, 4, 20, 32, 8, 40});  // heads of 5
#else
constexpr loom::models::GptShape shape = loom::models::llama3_spec({1, 4, 4, 24, 32, 8, 40});  // heads of 6
#endif
static_assert(loom::models::Gpt<shape, float>::tp_size == 1);
int main() {}

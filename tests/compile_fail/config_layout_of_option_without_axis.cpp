// expect: loom: LayoutOf: zeroK, keep and shardS are options of data parallelism and need dpN, N >= 2
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::LayoutOf<"tp4.zero1">;
#else
using C = loom::LayoutOf<"tp4.dp2.zero1">;
#endif
static_assert(C::world_size >= 4);
int main() {}

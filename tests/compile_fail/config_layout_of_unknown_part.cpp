// expect: loom: LayoutOf: a part of the name is not one of tpN, sp, cpN, ring, ulysses, ppN, gpipe, 1f1b, zb-h1
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::LayoutOf<"tp2.xp4.dp2">;
#else
using C = loom::LayoutOf<"tp2.pp4.dp2">;
#endif
static_assert(C::world_size == 16);
int main() {}

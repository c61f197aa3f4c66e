// expect: loom: Ring and Ulysses are options of CP
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::TP<2, loom::Ulysses>, loom::CP<2>>;
#else
using C = loom::Parallel<loom::TP<2>, loom::CP<2, loom::Ulysses>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

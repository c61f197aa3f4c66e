// expect: loom: an axis is given two options of the same family
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::CP<2, loom::Ring, loom::Ulysses>>;
#else
using C = loom::Parallel<loom::CP<2, loom::Ulysses>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

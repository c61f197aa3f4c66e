// expect: loom: Interleaved<v> needs v >= 1
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::PP<4, loom::Interleaved<0>>>;
#else
using C = loom::Parallel<loom::PP<4, loom::Interleaved<1>>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

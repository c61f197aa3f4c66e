// expect: loom: an axis is given two options of the same family
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::PP<4, loom::OneFOneB, loom::Interleaved<2>, loom::ZeroBubbleV>>;
#else
using C = loom::Parallel<loom::PP<4, loom::OneFOneB, loom::Interleaved<2>>>;
#endif
static_assert(C::world_size >= 1);
int main() {}

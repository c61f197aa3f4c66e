// expect: loom: Interleaved<v> with v > 1 goes with 1F1B (interleaved 1F1B) or, with v = 2, ZeroBubbleV
#include <loom/config.hpp>
#ifdef LOOM_FAIL
using C = loom::Parallel<loom::PP<4, loom::GPipe, loom::Interleaved<2>>>;  // GPipe has no table with two chunks
#else
using C = loom::Parallel<loom::PP<4, loom::OneFOneB, loom::Interleaved<2>>>;
#endif
static_assert(C::schedule == loom::Schedule::interleaved);
int main() {}

// expect: loom: a model on a CUDA device supports ep = 1 only
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::DP<2>, loom::EP<2>>;  // routing and dispatch run on the host
#else
using Cfg = loom::Parallel<loom::DP<2>, loom::EP<1>>;
#endif
static_assert(loom::models::DeviceRules<loom::Cuda, Cfg>::ok);
int main() {}

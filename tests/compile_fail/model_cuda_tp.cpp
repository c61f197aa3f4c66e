// expect: loom: a model on a CUDA device supports tp = 1 only
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::TP<2>>;  // the tensor-parallel collectives take host memory
#else
using Cfg = loom::Parallel<loom::DP<2>>;  // other axes replicate the model: each rank's is on its device
#endif
static_assert(loom::models::DeviceRules<loom::Cuda, Cfg>::ok);
static_assert(loom::models::DeviceRules<loom::Host, loom::Parallel<loom::TP<2>>>::ok);
int main() {}

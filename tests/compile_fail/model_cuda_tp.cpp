// expect: loom: a model on a CUDA device supports tensor parallelism without sequence parallelism only
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::TP<2, loom::SequenceParallel>>;  // the replicated parameters' gradients: host memory
#else
using Cfg = loom::Parallel<loom::TP<2>, loom::DP<2>>;  // tensor parallelism's collectives take device memory
#endif
static_assert(loom::models::DeviceRules<loom::Cuda, Cfg>::ok);
static_assert(loom::models::DeviceRules<loom::Host, loom::Parallel<loom::TP<2, loom::SequenceParallel>>>::ok);
int main() {}

// expect: loom: a model on a CUDA device supports cp = 1 only
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::CP<2>>;  // ring and Ulysses attention run on the host
#else
using Cfg = loom::Parallel<loom::CP<1, loom::Ulysses>>;
#endif
static_assert(loom::models::DeviceRules<loom::Cuda, Cfg>::ok);
static_assert(std::is_same_v<loom::models::ModelLayout<Cfg>, loom::Parallel<>>);
int main() {}

// expect: loom: a model on a CUDA device takes ring attention for context parallelism
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::CP<2, loom::Ulysses>>;  // Ulysses' all-to-alls and reorders run on the host
#else
using Cfg = loom::Parallel<loom::CP<2>>;  // ring attention runs on the device
#endif
static_assert(loom::models::DeviceRules<loom::Cuda, Cfg>::ok);
int main() {}

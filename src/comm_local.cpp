// loom::cpu_kernels: the Local backend's collectives instantiated once for every element type, for programs built
// with LOOM_EXTERN_KERNELS, which declares them extern in <loom/comm/local.hpp>.
#undef LOOM_EXTERN_KERNELS
#include <loom/comm/local.hpp>

namespace loom::comm {
LOOM_LOCAL_COMM_TYPES(LOOM_LOCAL_COMM_EXECUTE)
}  // namespace loom::comm

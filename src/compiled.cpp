// loom::cpu_kernels: the one definition of each function that <loom/core/compiled.hpp> marks LOOM_COMPILED (the
// Local backend's waiting, matching and messages), and the Local backend's collectives instantiated for every
// element type, for programs built with LOOM_EXTERN_KERNELS, which declares them in <loom/comm/local.hpp>.
#undef LOOM_EXTERN_KERNELS
#define LOOM_COMPILED_HERE 1
#include <loom/comm/local.hpp>

namespace loom::comm {
LOOM_LOCAL_COMM_TYPES(LOOM_LOCAL_COMM_EXECUTE)
}  // namespace loom::comm

// loom::cpu_kernels: the CPU kernels instantiated for one storage type (one file per type, so that they build in
// parallel), for programs built with LOOM_EXTERN_KERNELS, which declares them extern in <loom/kernels/cpu/ops.hpp>.
// Linking loom::cpu_kernels sets that definition; loom stays header-only without it.
#undef LOOM_EXTERN_KERNELS
#define LOOM_BUILDING_KERNELS 1
#include <loom/kernels/cpu/instantiate.hpp>
#include <loom/kernels/cpu/ops.hpp>

namespace loom::kernels::cpu {
LOOM_CPU_KERNELS_FOR(, float)
}  // namespace loom::kernels::cpu

// loom::cuda_kernels: the CUDA kernels' entry points instantiated for one storage type (one file per type, so that
// they build in parallel), for programs built with LOOM_EXTERN_CUDA_KERNELS (linking loom::cuda_kernels sets it),
// which then include <loom/kernels/cuda/device_ops.hpp> from any compiler and compile no kernel themselves.
#undef LOOM_EXTERN_CUDA_KERNELS
#include <loom/kernels/cuda/entry.cuh>

namespace loom::kernels::cuda::entry {
LOOM_CUDA_KERNELS_FOR(, double)
}  // namespace loom::kernels::cuda::entry

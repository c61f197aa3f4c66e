// loom::cuda_kernels: the Local backend's device-memory operations (<loom/comm/local_cuda.cuh>), compiled once for
// programs that include <loom/comm/local_cuda.hpp>.
#undef LOOM_EXTERN_CUDA_KERNELS
#include <loom/comm/local_cuda.cuh>

namespace loom::comm::detail::local_cuda {
const DeviceMemoryOps& compiled_ops() { return ops; }
}  // namespace loom::comm::detail::local_cuda

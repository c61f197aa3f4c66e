// train_gpt's layouts on a CUDA device: one rank, and data and tensor parallelism (with sequence parallelism or
// without) over ranks that share the GPU (threads of this process, through the Local backend's device memory).
// Compiled where loom is built with CUDA.
#include <loom/core/cuda_device.hpp>
#include <loom/comm/local_cuda.hpp>
#include <loom/kernels/cuda/device_ops.hpp>

#include "train_gpt.hpp"

namespace train_gpt {

using CudaLayouts = DeviceFamily<Cuda, Parallel<>, Parallel<DP<2>>, Parallel<TP<2>>, Parallel<TP<2>, DP<2>>,
                                 Parallel<TP<2, SequenceParallel>>>;

std::optional<int> run_cuda(const std::string& layout, const Args& a, int& argc, char**& argv) {
  const auto gpu = cuda_availability();
  LOOM_CHECK(gpu.kind == CudaAvailability::ready, "--device cuda: ", gpu.what);
  return CudaLayouts::run(layout, a, argc, argv);
}
std::vector<std::string> cuda_layouts() { return CudaLayouts::names(); }

}  // namespace train_gpt

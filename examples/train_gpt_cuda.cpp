// train_gpt's layouts on a CUDA device: one rank, and data, tensor (with sequence parallelism or without), pipeline
// (under every schedule), context (ring and Ulysses) and expert parallelism and ZeRO 1, 2 and 3 over ranks that share
// the GPU (threads of this process, through the Local backend's device memory) or have one each (--backend nccl, a
// process per GPU). Compiled where loom is built with CUDA.
#include <loom/core/cuda_device.hpp>
#include <loom/comm/local_cuda.hpp>
#include <loom/kernels/cuda/device_ops.hpp>
#ifdef LOOM_HAS_MPI
#include <loom/comm/nccl.hpp>
#endif

#include "train_gpt.hpp"

namespace train_gpt {

template <class Cfg, bool Pipelined, int Zero>
int run_nccl_layout([[maybe_unused]] int& argc, [[maybe_unused]] char**& argv,
                    [[maybe_unused]] const RankFn<Pipelined, Zero>& f) {
#ifdef LOOM_HAS_MPI
  return run_nccl<Cfg>(argc, argv, [&](auto& ctx) { f(train::AnyRankInLayout(train::rank_in_layout(ctx)).get()); });
#else
  throw Error("loom: --backend nccl: this build has no MPI, which starts the Nccl backend's ranks (configure with "
              "LOOM_WITH_MPI=ON)");
#endif
}

namespace {
template <class Pp>
using Alone = Parallel<Pp>;
using Layouts = FamilyOf<
    LayoutList<Parallel<>, Parallel<DP<2>>, Parallel<TP<2>>, Parallel<TP<2>, DP<2>>, Parallel<TP<2, SequenceParallel>>,
               Parallel<PP<2>, DP<2>>, Parallel<DP<2, ZeRO<1>>>, Parallel<DP<2, ZeRO<2>>>, Parallel<DP<2, ZeRO<3>>>,
               Parallel<TP<2>, DP<2, ZeRO<1>>>, Parallel<PP<2>, DP<2, ZeRO<1>>>, Parallel<CP<2>>,
               Parallel<CP<2>, DP<2>>, Parallel<CP<2, Ulysses>>, Parallel<DP<2>, EP<2>>>,
    EverySchedule<Alone, 2>>;
// The same layouts on the GPU.
template <class F>
struct OnCuda;
template <class... Cfgs>
struct OnCuda<DeviceFamily<Host, Cfgs...>> {
  using type = DeviceFamily<Cuda, Cfgs...>;
};
using CudaLayouts = typename OnCuda<Layouts>::type;
}  // namespace

std::optional<int> run_cuda(const std::string& layout, const Args& a, int& argc, char**& argv) {
  const auto gpu = cuda_availability();
  LOOM_CHECK(gpu.kind == CudaAvailability::ready, "--device cuda: ", gpu.what);
  return CudaLayouts::run(layout, a, argc, argv);
}
std::vector<std::string> cuda_layouts() { return CudaLayouts::names(); }

}  // namespace train_gpt

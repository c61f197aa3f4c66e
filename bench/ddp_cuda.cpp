// bench/ddp on ranks that share one CUDA device: threads of this process whose models compute on the GPU and whose
// buckets are averaged through the Local backend's device memory.
#include <loom/core/cuda_device.hpp>
#include <loom/comm/local_cuda.hpp>
#include <loom/kernels/cuda/device_ops.hpp>

#include "ddp.hpp"

namespace ddp_bench {

namespace {

template <models::GptShape S, class T>
Row measure_dp(int dp, const DdpOptions& o) {
  switch (dp) {
    case 2: return measure<S, 2, T, Cuda>(o);
    case 4: return measure<S, 4, T, Cuda>(o);
    default: throw Error("loom: --dp on cuda must list 2 or 4");
  }
}

template <models::GptShape S>
Row measure_dtype(int dp, const DdpOptions& o) {
  if (o.dtype == "bf16") return measure_dp<S, bf16>(dp, o);
  if (o.dtype == "f32") return measure_dp<S, float>(dp, o);
  throw Error("loom: --dtype " + o.dtype + " on cuda: bf16 or f32");
}

}  // namespace

std::vector<Row> measure_cuda(const DdpOptions& o) {
  const auto gpu = cuda_availability();
  LOOM_CHECK(gpu.kind == CudaAvailability::ready, "--device cuda: ", gpu.what);
  std::vector<Row> rows;
  for (int dp : o.dp) {
    if (o.model == "small") rows.push_back(measure_dtype<models::small>(dp, o));
    else if (o.model == "gpt2") rows.push_back(measure_dtype<models::gpt2>(dp, o));
    else throw Error("loom: unknown model '" + o.model + "' on cuda (small, gpt2)");
  }
  return rows;
}

}  // namespace ddp_bench

// The GPT training step on a CUDA device for bench/gpt_step: forward, backward, global-norm clipping and AdamW of
// models::Gpt<S, T, Parallel<>, Cuda>, in bf16 or f32, with tokens/s, the allocator's peak bytes and the MFU.
#include <loom/core/cuda_device.hpp>
#include <loom/kernels/cuda/device_ops.hpp>
#include <loom/kernels/cuda/profile.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/tensor/cuda_allocator.hpp>

#include "gpt_step.hpp"

namespace gpt_step {

namespace {

using namespace loom;

template <models::GptShape S, class T>
Row measure(const std::string& name, const std::string& dtype, const StepOptions& o) {
  const int T_ = std::min(o.seq, S.max_seq);
  models::GptOptions mo;
  mo.loss_gradient_in_forward = true;  // as the trainer: the loss's gradient written at forward
  models::Gpt<S, T, Parallel<>, Cuda> m(1, mo);
  optim::AdamW<T, Cuda> opt(m.specs(), m.params().numel(), {0.9, 0.95, 1e-8, 0.1}, m.ops());
  std::vector<std::int32_t> ids, tg;
  tokens(S.vocab, static_cast<std::size_t>(o.batch) * T_, ids, tg);
  int device = 0;
  LOOM_CUDA(cudaGetDevice(&device));
  CudaAllocator::instance().reset_peak(device);
  auto one_step = [&] {
    m.zero_grad();
    m.forward(ids.data(), tg.data(), o.batch, T_);
    m.backward();
    optim::clip_grad_norm(m.grads(), 1.0, m.ops());
    opt.step(m.params(), m.grads(), 1e-4);
  };
  const double step = median_step(o.steps, one_step, [] { LOOM_CUDA(cudaDeviceSynchronize()); });
  const double tps = o.batch * T_ / step;
  Row row{name, "loom", "cuda", dtype, 0, o.batch, T_, step * 1e3, tps,
          CudaAllocator::instance().peak_bytes(device), tps * flops_per_token(S, T_) / (o.peak_tflops * 1e12)};
  if (o.profile) {  // one more step, after the timed ones: its events do not slow them
    LOOM_CUDA(cudaDeviceSynchronize());
    kernels::cuda::Profile profile;
    one_step();
    for (const auto& r : profile.rows()) row.profile.push_back({r.op, r.calls, r.ms, r.flops});
  }
  return row;
}

template <models::GptShape S>
Row measure_dtype(const std::string& name, const StepOptions& o) {
  if (o.dtype == "bf16") return measure<S, bf16>(name, o.dtype, o);
  if (o.dtype == "f32") return measure<S, float>(name, o.dtype, o);
  throw Error("loom: --dtype " + o.dtype + " on cuda: bf16 or f32");
}

}  // namespace

std::vector<Row> measure_cuda(const StepOptions& o) {
  const auto gpu = cuda_availability();
  LOOM_CHECK(gpu.kind == CudaAvailability::ready, "--device cuda: ", gpu.what);
  std::vector<Row> rows;
  for (const auto& name : o.models) {
    if (name == "small") rows.push_back(measure_dtype<models::small>(name, o));
    else if (name == "gpt2") rows.push_back(measure_dtype<models::gpt2>(name, o));
    else throw Error("loom: unknown model '" + name + "' on cuda (small, gpt2)");
  }
  return rows;
}

}  // namespace gpt_step

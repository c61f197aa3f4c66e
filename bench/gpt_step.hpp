// What bench/gpt_step.cpp (the CPU, and the driver) and bench/gpt_step_cuda.cpp (the CUDA device) share: the options,
// one measured row, the timing of a model's training steps, and the FLOPs of a token.
#pragma once

#include <loom/models/gpt.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace gpt_step {

//! One operation's device time over a profiled step (--profile, CUDA).
struct OpTime {
  std::string op;
  long calls = 0;
  double ms = 0, flops = 0;
};

struct Row {
  std::string model, backend, device, dtype;
  int threads, batch, seq;
  double step_ms, tokens_per_s;
  std::size_t peak_bytes;
  double mfu = 0;  //!< on CUDA: tokens/s x FLOPs per token / the device's peak
  std::vector<OpTime> profile = {};  //!< --profile: loom's step on CUDA, operation by operation, the most time first
};

struct StepOptions {
  std::vector<std::string> models;  //!< default: tiny,small on the CPU, gpt2 on CUDA
  std::string device = "cpu", dtype;  //!< dtype default: f32 on the CPU, bf16 on CUDA
  int batch = 0, seq = 0, steps = 5, threads = 2;  //!< batch, seq 0: 4 x 256 on the CPU, 16 x 1024 on CUDA
  bool torch = true, torch_compile = true;
  bool profile = false;  //!< CUDA: one more step, timed operation by operation
  double peak_tflops = 989;  //!< H100/H200 SXM dense bf16
  std::string python = "/usr/bin/python3", json;
  //! The Python with transformers (scripts/install-deps' environment), for the Llama and Mixtral families' reference.
  std::string hf_python = std::string(std::getenv("HOME") ? std::getenv("HOME") : "") + "/.cache/loom/hf-venv/bin/python";
};

//! B x T token ids and targets, the same for every backend.
inline void tokens(int vocab, std::size_t n, std::vector<std::int32_t>& ids, std::vector<std::int32_t>& tg) {
  ids.resize(n), tg.resize(n);
  for (std::size_t i = 0; i < n; ++i)
    ids[i] = static_cast<std::int32_t>((i * 31 + 7) % vocab), tg[i] = static_cast<std::int32_t>((i * 17 + 3) % vocab);
}

//! The median seconds of `steps` calls of step() after two warm-up calls; sync() waits for the device.
template <class Step, class Sync>
double median_step(int steps, Step&& step, Sync&& sync) {
  std::vector<double> times;
  for (int i = 0; i < steps + 2; ++i) {
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    step();
    sync();
    if (i >= 2) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

//! Training FLOPs per token (PaLM, appendix B): 6N for the weights, 12 L d T for attention.
inline double flops_per_token(const loom::models::GptShape& s, int T) {
  return 6.0 * static_cast<double>(s.params()) + 12.0 * s.layers * s.d_model * T;
}

//! The rows of the CUDA device (bench/gpt_step_cuda.cpp); throws where loom was built without CUDA.
std::vector<Row> measure_cuda(const StepOptions& o);

}  // namespace gpt_step

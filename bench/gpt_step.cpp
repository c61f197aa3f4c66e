// GPT training-step benchmark: tokens/s and peak memory of forward + backward + AdamW. On the CPU (the default)
// for the tiny and small shapes, measured in the same run against the same model in PyTorch on the CPU
// (bench/gpt_torch.py under Debian's python3-torch, the same thread count), with the ratio loom / PyTorch; for the
// Llama and Mixtral families (llama-tiny, llama-small, mixtral-tiny, mixtral-small) against transformers' model of
// the same shape (bench/hf_step.py, in scripts/install-deps' environment; Mixtral dropless on both sides). With
// --device cuda (a build with CUDA) for the GPT-2 124M shape in bf16, with the MFU, against PyTorch on the same GPU
// (bf16 autocast, fused AdamW, eager and torch.compile).
//
//   gpt_step [--device cpu|cuda] [--models tiny,small,llama-small,mixtral-small,gpt2] [--dtype f32|bf16]
//            [--batch B] [--seq T] [--steps 5] [--threads 2] [--peak-tflops 989] [--python PATH]
//            [--hf-python PATH] [--no-torch] [--no-compile] [--profile] [--json FILE]
// --profile (CUDA) adds one step timed operation by operation: each operation's calls, device time, share of the
// step and, for the products and attention, TFLOP/s.
#include <loom/models/gpt/hf.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>

#include <nlohmann/json.hpp>

#include <Eigen/Core>

#include "cli.hpp"
#include "gpt_step.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#ifndef LOOM_SOURCE_DIR
#define LOOM_SOURCE_DIR "."
#endif

#ifndef LOOM_GPT_STEP_CUDA
std::vector<gpt_step::Row> gpt_step::measure_cuda(const StepOptions&) {
  throw loom::Error("loom: --device cuda: this gpt_step was built without CUDA (configure with -DLOOM_WITH_CUDA=ON)");
}
#endif

namespace {

using namespace loom;

using namespace gpt_step;

//! One rank's training step of the model of shape S on the CPU, in float (a mixture of experts dropless, without the
//! router's losses, as transformers' Mixtral trains).
Row measure(const models::GptShape& S, const std::string& name, const StepOptions& o) {
  const int T = std::min(o.seq, S.max_seq);
  models::GptOptions mo;
  mo.moe.capacity_factor = 0, mo.moe.aux_loss_coeff = 0;
  mo.loss_gradient_in_forward = true;
  models::GptModel<float> m(S, 1, mo);
  optim::AdamW<float> opt(m.specs(), S.params());
  std::vector<std::int32_t> ids, tg;
  tokens(S.vocab, static_cast<std::size_t>(o.batch) * T, ids, tg);
  host_memory().reset_peak();
  const double step = median_step(
      o.steps,
      [&] {
        m.zero_grad();
        m.forward(ids.data(), tg.data(), o.batch, T);
        m.backward();
        opt.step(m.params(), m.grads(), 1e-3f);
      },
      [] {});
  return {name, "loom", "cpu", "f32", o.threads, o.batch, T, step * 1e3, o.batch * T / step, host_memory().peak()};
}


//! One line of JSON from bench/gpt_torch.py run with `args`.
nlohmann::json run_torch(const StepOptions& o, const std::string& args) {
  std::ostringstream cmd;
  cmd << "OMP_NUM_THREADS=" << o.threads << " " << o.python << " " << LOOM_SOURCE_DIR << "/bench/gpt_torch.py " << args;
  return bench::run_json(cmd.str(), "PyTorch (install PyTorch for " + o.python + " or pass --no-torch)");
}

//! The same model and step in PyTorch: on the CPU with o.threads threads; on CUDA eager and (unless --no-compile)
//! compiled.
std::vector<Row> measure_torch(const models::GptShape& s, const std::string& name, const StepOptions& o) {
  const int T = std::min(o.seq, s.max_seq);
  std::ostringstream shape;
  shape << s.layers << " " << s.heads << " " << s.d_model << " " << s.vocab << " " << T << " " << o.batch << " "
        << o.steps;
  std::vector<Row> rows;
  if (o.device == "cpu" && checkpoint::hf_family(s) != checkpoint::HfFamily::gpt2) {  // transformers' model
    const std::string config = (std::filesystem::temp_directory_path() / ("loom-gpt-step-" + name + ".json")).string();
    std::ofstream(config) << checkpoint::llama_config(s, 1e-5).dump();
    std::ostringstream cmd;
    cmd << "OMP_NUM_THREADS=" << o.threads << " " << o.hf_python << " " << LOOM_SOURCE_DIR << "/bench/hf_step.py "
        << config << " " << T << " " << o.batch << " " << o.steps << " " << o.threads;
    const auto j =
        bench::run_json(cmd.str(), "transformers (run scripts/install-deps, pass --hf-python or --no-torch)");
    std::filesystem::remove(config);
    rows.push_back({name, "transformers " + j.at("version").get<std::string>(), "cpu", "f32", o.threads, o.batch, T,
                    j.at("step_ms"), j.at("tokens_per_s"), 0});
    return rows;
  }
  if (o.device == "cpu") {
    const auto j = run_torch(o, "bench " + shape.str() + " " + std::to_string(o.threads));
    rows.push_back({name, "pytorch " + j.at("version").get<std::string>(), "cpu", "f32", o.threads, o.batch, T,
                    j.at("step_ms"), j.at("tokens_per_s"), 0});
    return rows;
  }
  for (const char* mode : {"eager", "compile"}) {
    if (std::string(mode) == "compile" && !o.torch_compile) continue;
    const auto j = run_torch(o, "bench-cuda " + shape.str() + " " + o.dtype + " " + mode);
    const double tps = j.at("tokens_per_s");
    rows.push_back({name, "pytorch " + j.at("version").get<std::string>(), "cuda", o.dtype, 0, o.batch, T,
                    j.at("step_ms"), tps, j.at("peak_bytes").get<std::size_t>(),
                    tps * flops_per_token(s, T) / (o.peak_tflops * 1e12)});
  }
  return rows;
}

models::GptShape shape_of(const std::string& name) {
  const auto s = models::shape_named(name);
  LOOM_CHECK(s && name != "long" && name != "llama3-1b" && name.find("-moe") == std::string::npos,
             "unknown model '", name, "' (tiny, small, gpt2, llama-tiny, llama-small, mixtral-tiny, mixtral-small)");
  return *s;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    StepOptions o;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&] {
        LOOM_CHECK(i + 1 < argc, a, " needs a value");
        return std::string(argv[++i]);
      };
      if (a == "-h" || a == "--help") {
        std::fputs("usage: gpt_step [--models tiny,small,llama-small,mixtral-small,gpt2] [--device cpu|cuda]\n"
                   "                [--dtype f32|bf16] [--batch B] [--seq T] [--steps N] [--threads N] [--peak-tflops F]\n"
                   "                [--python PATH] [--hf-python PATH] [--no-torch] [--no-compile] [--profile]\n"
                   "                [--json FILE]\n",
                   stdout);
        return 0;
      } else if (a == "--models") {
        o.models.clear();
        std::stringstream ss(next());
        for (std::string x; std::getline(ss, x, ',');) o.models.push_back(x);
      } else if (a == "--device") o.device = next();
      else if (a == "--dtype") o.dtype = next();
      else if (a == "--batch") o.batch = std::stoi(next());
      else if (a == "--seq") o.seq = std::stoi(next());
      else if (a == "--steps") o.steps = std::stoi(next());
      else if (a == "--threads") o.threads = std::stoi(next());
      else if (a == "--peak-tflops") o.peak_tflops = std::stod(next());
      else if (a == "--python") o.python = next();
      else if (a == "--hf-python") o.hf_python = next();
      else if (a == "--no-torch") o.torch = false;
      else if (a == "--no-compile") o.torch_compile = false;
      else if (a == "--profile") o.profile = true;
      else if (a == "--json") o.json = next();
      else throw Error("loom: unknown flag '" + a + "'");
    }
    LOOM_CHECK(o.device == "cpu" || o.device == "cuda", "--device must be cpu or cuda, got '", o.device, "'");
    const bool cuda = o.device == "cuda";
    if (o.models.empty()) o.models = cuda ? std::vector<std::string>{"gpt2"} : std::vector<std::string>{"tiny", "small"};
    if (o.dtype.empty()) o.dtype = cuda ? "bf16" : "f32";
    if (o.batch == 0) o.batch = cuda ? 16 : 4;
    if (o.seq == 0) o.seq = cuda ? 1024 : 256;
    LOOM_CHECK(cuda || o.dtype == "f32", "--dtype ", o.dtype, ": the CPU benchmark runs f32");
    LOOM_CHECK(cuda || !o.profile, "--profile times the device's operations: it needs --device cuda");
    Eigen::setNbThreads(o.threads);
    std::vector<Row> rows;
    if (cuda) {
      const auto mine = measure_cuda(o);
      for (std::size_t k = 0; k < mine.size(); ++k) {
        rows.push_back(mine[k]);
        if (o.torch)
          for (auto& r : measure_torch(shape_of(o.models[k]), o.models[k], o)) rows.push_back(r);
      }
    } else {
      for (const auto& name : o.models) {
        LOOM_CHECK(name != "gpt2", "--models gpt2 runs with --device cuda; on the CPU: tiny, small, llama-tiny, "
                   "llama-small, mixtral-tiny, mixtral-small");
        rows.push_back(measure(shape_of(name), name, o));
        if (o.torch)
          for (auto& r : measure_torch(shape_of(name), name, o)) rows.push_back(r);
      }
    }
    std::printf("%-13s %-38s %-5s %-5s %7s %5s %5s %10s %12s %10s %6s %14s\n", "model", "backend", "dev", "dtype",
                "threads", "batch", "seq", "step_ms", "tokens/s", "peak_MiB", "mfu", "loom/pytorch");
    const Row* mine = nullptr;
    for (const auto& r : rows) {
      if (r.backend == "loom") mine = &r;
      std::string ratio;
      if (r.backend != "loom" && mine && mine->model == r.model)
        ratio = std::to_string(mine->tokens_per_s / r.tokens_per_s).substr(0, 5) + "x";
      std::printf("%-13s %-38s %-5s %-5s %7d %5d %5d %10.1f %12.0f %10.1f %6.3f %14s\n", r.model.c_str(),
                  r.backend.c_str(), r.device.c_str(), r.dtype.c_str(), r.threads, r.batch, r.seq, r.step_ms,
                  r.tokens_per_s, static_cast<double>(r.peak_bytes) / (1 << 20), r.mfu, ratio.c_str());
    }
    for (const auto& r : rows) {
      if (r.profile.empty()) continue;
      double total = 0;
      for (const auto& p : r.profile) total += p.ms;
      std::printf("\nloom's step on %s, operation by operation (%.1f ms of device time in operations; the step took "
                  "%.1f ms):\n%-44s %6s %9s %7s %8s\n",
                  r.model.c_str(), total, r.step_ms, "operation", "calls", "ms", "step%", "TFLOP/s");
      for (const auto& p : r.profile)
        std::printf("%-44s %6ld %9.3f %6.1f%% %8s\n", p.op.c_str(), p.calls, p.ms, 100 * p.ms / r.step_ms,
                    p.flops > 0 ? std::to_string(static_cast<int>(p.flops / (p.ms * 1e9))).c_str() : "");
    }
    if (!o.json.empty()) {
      std::ofstream f(o.json + ".tmp");
      for (const auto& r : rows) {
        nlohmann::json j{{"model", r.model},   {"backend", r.backend}, {"device", r.device},
                         {"dtype", r.dtype},   {"threads", r.threads}, {"batch", r.batch},
                         {"seq", r.seq},       {"step_ms", r.step_ms}, {"tokens_per_s", r.tokens_per_s},
                         {"peak_bytes", r.peak_bytes}, {"mfu", r.mfu}};
        for (const auto& p : r.profile)
          j["profile"].push_back({{"op", p.op}, {"calls", p.calls}, {"ms", p.ms}, {"flops", p.flops}});
        f << j.dump() << "\n";
      }
      f.close();
      std::rename((o.json + ".tmp").c_str(), o.json.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

// GPT training-step benchmark on the CPU: tokens/s and peak host memory of forward + backward + AdamW for the
// tiny and small shapes, and, measured in the same run with the same thread count, the same model in PyTorch
// (bench/gpt_torch.py under Debian's python3-torch) with the ratio loom / PyTorch.
//
//   gpt_step [--models tiny,small] [--batch 4] [--seq 256] [--steps 5] [--threads 2] [--no-torch] [--json FILE]
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>

#include <nlohmann/json.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#ifndef LOOM_SOURCE_DIR
#define LOOM_SOURCE_DIR "."
#endif

namespace {

using namespace loom;

struct Row {
  std::string model, backend;
  int threads, batch, seq;
  double step_ms, tokens_per_s;
  std::size_t peak_bytes;
};

struct StepOptions {
  std::vector<std::string> models{"tiny", "small"};
  int batch = 4, seq = 256, steps = 5, threads = 2;
  bool torch = true;
  std::string json;
};

template <models::GptShape S>
Row measure(const std::string& name, const StepOptions& o) {
  const int T = std::min(o.seq, S.max_seq);
  models::Gpt<S, float> m(1);
  optim::AdamW<float> opt(m.specs(), S.params());
  std::vector<std::int32_t> ids(static_cast<std::size_t>(o.batch) * T), tg(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 31 + 7) % S.vocab),
                                               tg[i] = static_cast<std::int32_t>((i * 17 + 3) % S.vocab);
  host_memory().reset_peak();
  std::vector<double> times;
  for (int i = 0; i < o.steps + 2; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    m.zero_grad();
    m.forward(ids.data(), tg.data(), o.batch, T);
    m.backward();
    opt.step(m.params(), m.grads(), 1e-3f);
    if (i >= 2) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  const double step = times[times.size() / 2];
  return {name, "loom", o.threads, o.batch, T, step * 1e3, o.batch * T / step, host_memory().peak()};
}

Row measure_torch(const models::GptShape& s, const std::string& name, const StepOptions& o) {
  std::ostringstream cmd;
  const int T = std::min(o.seq, s.max_seq);
  cmd << "OMP_NUM_THREADS=" << o.threads << " /usr/bin/python3 " << LOOM_SOURCE_DIR << "/bench/gpt_torch.py bench "
      << s.layers << " " << s.heads << " " << s.d_model << " " << s.vocab << " " << T << " " << o.batch << " "
      << o.steps << " " << o.threads;
  FILE* p = popen(cmd.str().c_str(), "r");
  LOOM_CHECK(p, "cannot run ", cmd.str());
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  const int rc = pclose(p);
  LOOM_CHECK(rc == 0 && !out.empty(), "the PyTorch reference failed (", cmd.str(),
             "); install python3-torch or pass --no-torch");
  const auto j = nlohmann::json::parse(out.substr(out.rfind('{')));
  return {name, "pytorch " + j.at("version").get<std::string>(), o.threads, o.batch, T, j.at("step_ms"),
          j.at("tokens_per_s"), 0};
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
      if (a == "--models") {
        o.models.clear();
        std::stringstream ss(next());
        for (std::string x; std::getline(ss, x, ',');) o.models.push_back(x);
      } else if (a == "--batch") o.batch = std::stoi(next());
      else if (a == "--seq") o.seq = std::stoi(next());
      else if (a == "--steps") o.steps = std::stoi(next());
      else if (a == "--threads") o.threads = std::stoi(next());
      else if (a == "--no-torch") o.torch = false;
      else if (a == "--json") o.json = next();
      else throw Error("loom: unknown flag '" + a + "'");
    }
    Eigen::setNbThreads(o.threads);
    std::vector<Row> rows;
    for (const auto& name : o.models) {
      models::GptShape s{};
      if (name == "tiny") rows.push_back(measure<models::tiny>(name, o)), s = models::tiny;
      else if (name == "small") rows.push_back(measure<models::small>(name, o)), s = models::small;
      else throw Error("loom: unknown model '" + name + "' (tiny, small)");
      if (o.torch) rows.push_back(measure_torch(s, name, o));
    }
    std::printf("%-6s %-16s %7s %5s %5s %10s %12s %10s %14s\n", "model", "backend", "threads", "batch", "seq",
                "step_ms", "tokens/s", "peak_MiB", "loom/pytorch");
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      std::string ratio;
      if (r.backend == "loom" && i + 1 < rows.size() && rows[i + 1].model == r.model)
        ratio = std::to_string(r.tokens_per_s / rows[i + 1].tokens_per_s).substr(0, 5) + "x";
      std::printf("%-6s %-16s %7d %5d %5d %10.1f %12.0f %10.1f %14s\n", r.model.c_str(), r.backend.c_str(), r.threads,
                  r.batch, r.seq, r.step_ms, r.tokens_per_s, static_cast<double>(r.peak_bytes) / (1 << 20),
                  ratio.c_str());
    }
    if (!o.json.empty()) {
      std::ofstream f(o.json + ".tmp");
      for (const auto& r : rows)
        f << nlohmann::json{{"model", r.model}, {"backend", r.backend}, {"threads", r.threads}, {"batch", r.batch},
                            {"seq", r.seq}, {"step_ms", r.step_ms}, {"tokens_per_s", r.tokens_per_s},
                            {"peak_bytes", r.peak_bytes}}.dump()
          << "\n";
      f.close();
      std::rename((o.json + ".tmp").c_str(), o.json.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

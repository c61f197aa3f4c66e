// ZeRO benchmark: for N data-parallel ranks (threads of this process, Local backend, f32, AdamW), plain data
// parallelism against ZeRO-1, 2 and 3 on the same model, side by side in one run: each rank's parameters,
// gradients and optimizer state in use between steps (the largest over ranks) beside the formula (4Ψ, or 4Ψ_r
// under ZeRO-3; 4Ψ, or 4Ψ_r under ZeRO-2 and 3; 8Ψ or 8Ψ_r: Ψ_r the largest shard), the peak of communication
// buffers and of everything, and the median step time. gpt2-medium (355M parameters) is a model whose replicated
// training state (5.7 GB a rank in f32) 8 ranks of a 24 GiB machine cannot hold: run it with --stages 3.
//
//   zero [--model small|gpt2|gpt2-medium] [--dp 1,2,4,8] [--stages 0,1,2,3] [--batch 8] [--seq 64] [--steps 3]
//        [--bucket-mb 25] [--json FILE]
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/trainer.hpp>

#include "cli.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using namespace loom;

//! GPT-2 medium: 24 layers of width 1024, 16 heads, 355M parameters.
constexpr models::GptShape gpt2_medium{24, 16, 16, 1024, 50257, 1024};

struct ZeroOptions {
  std::string model = "small";
  std::vector<int> dp{1, 2, 4, 8};
  std::vector<int> stages{0, 1, 2, 3};
  int batch = 8, seq = 64, steps = 3;
  double bucket_mb = 25;
  std::string json;
};

struct Row {
  std::string model, layout;
  int dp = 0;
  std::int64_t psi = 0;
  double params = 0, grads = 0, state = 0;                  // bytes in use between steps, largest over ranks
  double params_formula = 0, grads_formula = 0, state_formula = 0;
  double comm_peak = 0, peak = 0, step_ms = 0;
};

//! Layout Cfg (N ranks, with or without ZeRO<k>) on a GPT of shape S in f32.
template <models::GptShape S, class Cfg>
Row measure(const ZeroOptions& o) {
  using Model = models::Gpt<S, float, models::ModelLayout<Cfg>>;
  using Opt = optim::AdamW<float>;
  constexpr int N = Cfg::template size<Axis::dp>;
  Row row;
  row.model = o.model, row.layout = std::string(Cfg::name()), row.dp = N, row.psi = S.params();
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(o.batch) * (o.seq + 1) * 4);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 7919 + 13) % S.vocab);
  const train::Batches data(tokens, o.batch, o.seq, train::BatchOrder::sequential, 1);
  train::TrainerOptions<models::GptOptions> options;
  options.seed = 1;
  options.step.batch = o.batch, options.step.seq = o.seq;
  options.step.bucket_bytes = static_cast<std::size_t>(o.bucket_mb * (1 << 20));
  std::vector<Row> ranks(N);
  run_local<Cfg>([&](auto& ctx) {
    train::Trainer<Cfg, Model, Opt> trainer(ctx, data, options, [](const auto& specs, std::int64_t n) {
      return Opt(specs, n);
    });
    std::vector<double> times;
    for (int s = 0; s <= o.steps; ++s) {
      ctx.world().barrier();
      const auto t0 = std::chrono::steady_clock::now();
      trainer.step(s);
      ctx.world().barrier();
      const auto t1 = std::chrono::steady_clock::now();
      if (s > 0) times.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::sort(times.begin(), times.end());
    const auto& m = rank_memory();
    Row& r = ranks[ctx.rank()];
    r.params = double(m.in_use(MemoryUse::parameters));
    r.grads = double(m.in_use(MemoryUse::gradients));
    r.state = double(m.in_use(MemoryUse::optimizer_state));
    r.comm_peak = double(m.peak(MemoryUse::communication));
    r.peak = double(m.peak());
    r.step_ms = times.empty() ? 0 : times[times.size() / 2];
    // The formula: Ψ_r, this rank's chunk of each bucket (ZeRO), or the whole model.
    std::int64_t own = S.params();
    if constexpr (Cfg::zero_stage > 0) {
      own = 0;
      const int rank = ctx.template coord<Axis::dp>();
      const auto& m = trainer.model();
      const auto buckets = Cfg::zero_stage == 3
                               ? train::unit_buckets_of(m)
                               : train::make_buckets(m.specs(), sizeof(float), options.step.bucket_bytes);
      for (const auto& b : buckets) {
        const std::int64_t c = (b.hi - b.lo + N - 1) / N;
        own += std::clamp<std::int64_t>(b.hi - b.lo - rank * c, 0, c);
      }
    }
    r.params_formula = 4.0 * double(Cfg::zero_stage >= 3 ? own : S.params());
    r.grads_formula = 4.0 * double(Cfg::zero_stage >= 2 ? own : S.params());
    r.state_formula = 8.0 * double(own);
  });
  for (const auto& r : ranks) {
    row.params = std::max(row.params, r.params), row.grads = std::max(row.grads, r.grads);
    row.state = std::max(row.state, r.state), row.comm_peak = std::max(row.comm_peak, r.comm_peak);
    row.peak = std::max(row.peak, r.peak), row.step_ms = std::max(row.step_ms, r.step_ms);
    row.params_formula = std::max(row.params_formula, r.params_formula);
    row.grads_formula = std::max(row.grads_formula, r.grads_formula);
    row.state_formula = std::max(row.state_formula, r.state_formula);
  }
  return row;
}

template <models::GptShape S, int N>
void measure_both(const ZeroOptions& o, std::vector<Row>& rows) {
  auto wanted = [&](int k) { return std::find(o.stages.begin(), o.stages.end(), k) != o.stages.end(); };
  if (wanted(0)) rows.push_back(measure<S, Parallel<DP<N>>>(o));
  if (wanted(1)) rows.push_back(measure<S, Parallel<DP<N, ZeRO<1>>>>(o));
  if (wanted(2)) rows.push_back(measure<S, Parallel<DP<N, ZeRO<2>>>>(o));
  if (wanted(3)) rows.push_back(measure<S, Parallel<DP<N, ZeRO<3>>>>(o));
}

template <models::GptShape S>
void measure_all(const ZeroOptions& o, std::vector<Row>& rows) {
  for (int n : o.dp) {
    switch (n) {
      case 1: measure_both<S, 1>(o, rows); break;
      case 2: measure_both<S, 2>(o, rows); break;
      case 4: measure_both<S, 4>(o, rows); break;
      case 8: measure_both<S, 8>(o, rows); break;
      default: throw Error(loom::detail::cat("loom: --dp lists 1, 2, 4 or 8, got ", n));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return bench::guarded([&] {
    ZeroOptions o;
    bench::CommandLine cl(argc, argv);
    const bool go = cl.parse("usage: zero [--model small|gpt2|gpt2-medium] [--dp 1,2,4,8] [--stages 0,1,2,3]\n"
                             "            [--batch B] [--seq T] [--steps N] [--bucket-mb MB] [--json FILE]\n",
                             [&](const std::string& a) {
                               if (a == "--model") o.model = cl.value();
                               else if (a == "--dp") o.dp = bench::int_list(cl.value());
                               else if (a == "--stages") o.stages = bench::int_list(cl.value());
                               else if (a == "--batch") o.batch = std::stoi(cl.value());
                               else if (a == "--seq") o.seq = std::stoi(cl.value());
                               else if (a == "--steps") o.steps = std::stoi(cl.value());
                               else if (a == "--bucket-mb") o.bucket_mb = std::stod(cl.value());
                               else if (a == "--json") o.json = cl.value();
                               else throw Error("loom: unknown flag '" + a + "'");
                             });
    if (!go) return 0;
    std::vector<Row> rows;
    if (o.model == "small") measure_all<models::small>(o, rows);
    else if (o.model == "gpt2") measure_all<models::gpt2>(o, rows);
    else if (o.model == "gpt2-medium") measure_all<gpt2_medium>(o, rows);
    else throw Error("loom: unknown model '" + o.model + "' (small, gpt2, gpt2-medium)");
    constexpr double mib = 1 << 20;
    std::printf("%-11s %-10s %3s %11s %11s %11s %11s %11s %11s %9s %9s %9s\n", "model", "layout", "dp", "params_MiB",
                "formula", "grads_MiB", "formula", "state_MiB", "formula", "comm_MiB", "peak_MiB", "step_ms");
    std::vector<nlohmann::json> records;
    for (const auto& r : rows) {
      std::printf("%-11s %-10s %3d %11.3f %11.3f %11.3f %11.3f %11.3f %11.3f %9.3f %9.1f %9.1f\n", r.model.c_str(),
                  r.layout.c_str(), r.dp, r.params / mib, r.params_formula / mib, r.grads / mib,
                  r.grads_formula / mib, r.state / mib, r.state_formula / mib, r.comm_peak / mib, r.peak / mib,
                  r.step_ms);
      records.push_back({{"model", r.model}, {"layout", r.layout}, {"dp", r.dp}, {"psi", r.psi},
                         {"params_bytes", r.params}, {"params_formula", r.params_formula}, {"grads_bytes", r.grads},
                         {"grads_formula", r.grads_formula}, {"state_bytes", r.state},
                         {"state_formula", r.state_formula}, {"comm_peak_bytes", r.comm_peak},
                         {"peak_bytes", r.peak}, {"step_ms", r.step_ms}});
    }
    if (!o.json.empty()) bench::write_json_lines(o.json, records);
    return 0;
  });
}

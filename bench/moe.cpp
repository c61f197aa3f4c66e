// Mixture of experts under expert parallelism: training steps of tiny-moe and small-moe (f32, AdamW, CPU threads as
// ranks) on EP 1, 2, 4 and 8 (the experts split over n data-parallel ranks, Parallel<DP<n>, EP<n>>; EP 1 is one
// rank holding every expert), beside the dense model with the same active parameters per token (tiny, small) on the
// same ranks, at capacity factors 1.0, 1.25, 2.0 and dropless. Per row: tokens per second over the global batch, each
// rank's peak of bytes held (its ledger, the largest over ranks), the share of the step spent in the MoE layers'
// all-to-alls (the counts and the rows out and back, forward and backward; the largest over ranks), the fraction of
// assignments dropped over capacity and the largest expert load over the mean (both over the measured steps), and the
// last loss.
//
//   moe [--model tiny-moe,small-moe] [--ep 1,2,4,8] [--capacity 1,1.25,2,0] [--batch 16] [--seq 64]
//       [--steps 3] [--warmup 1] [--json FILE]
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data.hpp>
#include <loom/train/trainer.hpp>

#include "cli.hpp"

#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace loom;

struct BenchOptions {
  std::vector<std::string> models{"tiny-moe", "small-moe"};
  std::vector<int> ep{1, 2, 4, 8};
  std::vector<double> capacity{1.0, 1.25, 2.0, 0.0};
  int batch = 16, seq = 64, steps = 3, warmup = 1;
  std::string json;
};

struct Row {
  std::string model, layout;
  int ranks = 1;
  double capacity = 0, tokens_per_s = 0, peak_bytes = 0, a2a_share = 0, dropped = 0, imbalance = 1, loss = 0;
  std::int64_t params = 0, active = 0;
};

//! Steps of the model of shape S on n data-parallel ranks (with EP<n> when `experts`).
template <models::GptShape S, int N, bool Experts>
Row measure(const BenchOptions& o, const std::string& name, double capacity) {
  using Spread = std::conditional_t<Experts, Parallel<DP<N>, EP<N>>, Parallel<DP<N>>>;
  using Cfg = std::conditional_t<N == 1, Parallel<>, Spread>;
  using Model = models::Gpt<S, float, models::ModelLayout<Cfg>>;
  using AdamW = optim::AdamW<float>;
  const auto tokens = train::builtin_corpus();
  const train::Batches data(tokens, o.batch, o.seq, train::BatchOrder::shuffle, 5);
  std::vector<double> peak(N), a2a(N), wall(N);
  train::StepResult last{};
  double dropped = 0, assignments = 0, imbalance = 0, forwards = 0;
  run_local<Cfg>([&](auto& ctx) {
    train::TrainerOptions<models::GptOptions> t;
    t.seed = 1;
    t.model.moe.capacity_factor = capacity;
    t.step.batch = o.batch, t.step.seq = o.seq, t.step.lr = 1e-3;
    train::Trainer<Cfg, Model, AdamW> trainer(ctx, data, t, [](const auto& specs, std::int64_t n) {
      return AdamW(specs, n, {0.9, 0.95, 1e-8, 0.01});
    });
    const std::size_t r = static_cast<std::size_t>(ctx.rank());
    for (int s = 0; s < o.warmup; ++s) trainer.step(s);
    rank_memory().reset_peaks();
    double in_a2a = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 0; s < o.steps; ++s) {
      const auto res = trainer.step(o.warmup + s);
      in_a2a += res.moe.a2a_seconds;
      if (r == 0) {
        last = res;
        dropped += res.moe.dropped, assignments += res.moe.assignments;
        imbalance += res.moe.imbalance, forwards += res.moe.forwards;
      }
    }
    wall[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    peak[r] = double(rank_memory().peak());
    a2a[r] = in_a2a;
  });
  Row row{name, std::string(Cfg::name()), N, capacity};
  double w = 0, share = 0, p = 0;
  for (int r = 0; r < N; ++r) {
    w = std::max(w, wall[std::size_t(r)]), p = std::max(p, peak[std::size_t(r)]);
    share = std::max(share, a2a[std::size_t(r)] / wall[std::size_t(r)]);
  }
  row.tokens_per_s = double(o.steps) * o.batch * o.seq / w;
  row.peak_bytes = p, row.a2a_share = share, row.loss = last.loss;
  // a2a_seconds is one rank's own; the routing counts are the world's sums.
  row.dropped = assignments > 0 ? dropped / assignments : 0, row.imbalance = forwards > 0 ? imbalance / forwards : 1;
  row.params = S.params(), row.active = S.active_params();
  return row;
}

template <models::GptShape S, bool Experts>
Row measure_on(const BenchOptions& o, const std::string& name, int n, double capacity) {
  switch (n) {
    case 1: return measure<S, 1, Experts>(o, name, capacity);
    case 2: return measure<S, 2, Experts>(o, name, capacity);
    case 4: return measure<S, 4, Experts>(o, name, capacity);
    case 8: return measure<S, 8, Experts>(o, name, capacity);
    default: throw Error(loom::detail::cat("loom: --ep lists 1, 2, 4 or 8, got ", n));
  }
}

std::vector<double> double_list(const std::string& s) {
  std::vector<double> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stod(x));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  return bench::guarded([&] {
    BenchOptions o;
    bench::CommandLine cl(argc, argv);
    const bool go = cl.parse("usage: moe [--model tiny-moe,small-moe] [--ep 1,2,4,8] [--capacity 1,1.25,2,0]\n"
                             "           [--batch B] [--seq T] [--steps N] [--warmup N] [--json FILE]\n",
                             [&](const std::string& a) {
                               if (a == "--model") {
                                 o.models.clear();
                                 std::stringstream ss(cl.value());
                                 for (std::string m; std::getline(ss, m, ',');) o.models.push_back(m);
                               } else if (a == "--ep") o.ep = bench::int_list(cl.value());
                               else if (a == "--capacity") o.capacity = double_list(cl.value());
                               else if (a == "--batch") o.batch = std::stoi(cl.value());
                               else if (a == "--seq") o.seq = std::stoi(cl.value());
                               else if (a == "--steps") o.steps = std::stoi(cl.value());
                               else if (a == "--warmup") o.warmup = std::stoi(cl.value());
                               else if (a == "--json") o.json = cl.value();
                               else throw Error("loom: unknown flag '" + a + "'");
                             });
    if (!go) return 0;
    for (const auto& m : o.models)
      LOOM_CHECK(m == "tiny-moe" || m == "small-moe", "--model lists tiny-moe and small-moe, got '", m, "'");
    LOOM_CHECK(o.steps >= 1 && o.batch >= 1 && o.seq >= 1, "--steps, --batch and --seq must be at least 1");
    std::printf("f32, AdamW, batch %d x %d tokens, %d steps after %d of warmup; dense: the model with the same "
                "active parameters\n",
                o.batch, o.seq, o.steps, o.warmup);
    std::printf("%-9s %-12s %5s %9s %12s %12s %9s %9s %10s %8s %11s %11s\n", "model", "layout", "ranks", "capacity",
                "tokens/s", "peak_MiB", "a2a_share", "dropped", "max/mean", "loss", "params", "active");
    std::vector<nlohmann::json> records;
    auto print = [&](const Row& r, bool experts) {
      const std::string cap = !experts ? "-" : r.capacity == 0 ? "dropless" : loom::detail::cat(r.capacity);
      std::printf("%-9s %-12s %5d %9s %12.0f %12.2f %9.3f %9.4f %10.3f %8.4f %11lld %11lld\n", r.model.c_str(),
                  r.layout.c_str(), r.ranks, cap.c_str(), r.tokens_per_s, r.peak_bytes / (1 << 20), r.a2a_share,
                  r.dropped, r.imbalance, r.loss, static_cast<long long>(r.params),
                  static_cast<long long>(r.active));
      std::fflush(stdout);
      nlohmann::json j{{"model", r.model},         {"layout", r.layout},       {"ranks", r.ranks},
                       {"tokens_per_s", r.tokens_per_s}, {"peak_bytes", r.peak_bytes}, {"loss", r.loss},
                       {"params", r.params},       {"active_params", r.active}};
      if (experts) {
        j["capacity_factor"] = r.capacity, j["a2a_share"] = r.a2a_share;
        j["dropped"] = r.dropped, j["load_max_over_mean"] = r.imbalance;
      }
      records.push_back(j);
    };
    for (const auto& m : o.models)
      for (int n : o.ep) {
        const bool tiny = m == "tiny-moe";
        print(tiny ? measure_on<models::tiny, false>(o, "tiny", n, 0)
                   : measure_on<models::small, false>(o, "small", n, 0),
              false);
        for (double c : o.capacity)
          print(tiny ? measure_on<models::tiny_moe, true>(o, m, n, c) : measure_on<models::small_moe, true>(o, m, n, c),
                true);
      }
    if (!o.json.empty()) bench::write_json_lines(o.json, records);
    return 0;
  });
}

// Tensor-parallel step benchmark: for TP ranks (threads of this process, Local backend), the time of a forward +
// backward step of the GPT, with and without sequence parallelism; the elements one rank sends inside the
// transformer blocks, checked against Megatron's 8·b·s·h·(t−1)/t per layer; everything the step sends; and the
// parameter and activation bytes of a rank.
//
//   tensor_parallel [--model tiny|small] [--tp 1,2,4[,8]] [--sp | --no-sp] [--batch 4] [--seq 128] [--steps 5]
//                   [--json FILE]
//
// Without --sp or --no-sp, every tp > 1 gets a row without and a row with sequence parallelism. Volumes are in
// elements sent per rank by a ring algorithm (an all-reduce of n sends 2n(t−1)/t, an all-gather or reduce-scatter
// n(t−1)/t), counted by the model's TpGroup during the last measured step.
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>

#include <nlohmann/json.hpp>


#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace loom;
using Clock = std::chrono::steady_clock;
using layers::Phase;

struct TpOptions {
  std::string model = "small";
  std::vector<int> tp{1, 2, 4};
  bool without_sp = true, with_sp = true;
  int batch = 4, seq = 128, steps = 5;
  std::string json;
};

struct Row {
  std::string model;
  int tp = 1;
  bool sp = false;
  int batch = 0, seq = 0;
  double step_ms = 0;
  std::int64_t all_reduce = 0, all_gather = 0, reduce_scatter = 0;  //!< inside the blocks, forward + backward
  double block_volume = 0, formula = 0;
  double other_volume = 0, grads_volume = 0;  //!< embedding and loss; gradients that TP ranks share
  std::size_t param_bytes = 0, activation_bytes = 0;  //!< the largest over the ranks

  double ratio() const { return formula > 0 ? block_volume / formula : NAN; }
  double total_volume() const { return block_volume + other_volume + grads_volume; }
};

template <int N, bool SP>
using LayoutOf = std::conditional_t<N == 1, Parallel<>,
                                    std::conditional_t<SP, Parallel<TP<N, SequenceParallel>>, Parallel<TP<N>>>>;

template <models::GptShape S, int N, bool SP>
Row measure(const TpOptions& o) {
  using Cfg = LayoutOf<N, SP>;
  Row row{o.model, N, SP, o.batch, std::min(o.seq, S.max_seq)};
  const int B = o.batch, T = row.seq;
  LOOM_CHECK(B >= 1, "--batch ", B, " must be at least 1");
  LOOM_CHECK(!SP || T % N == 0, "--seq ", T, " must be a multiple of tp ", N, " for sequence parallelism");
  // Every rank of a tensor-parallel group reads the same tokens.
  std::vector<std::int32_t> ids(static_cast<std::size_t>(B) * T), tg(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 13 + 7) % S.vocab);
  for (std::size_t i = 0; i < ids.size(); ++i) tg[i] = ids[(i + 1) % ids.size()];
  std::mutex mu;
  run_local<Cfg>([&](auto& ctx) {
    auto& tp = ctx.template comm<Axis::tp>();
    models::Gpt<S, float, Cfg> m(1, tp);
    std::vector<double> times;
    for (int i = 0; i < o.steps + 1; ++i) {  // step 0 warms up and sizes the activations
      m.tp().reset_counts();
      tp.barrier();
      const auto t0 = Clock::now();
      m.zero_grad();
      m.forward(ids.data(), tg.data(), B, T);
      m.backward();
      tp.barrier();
      if (i > 0) times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    const auto& f = m.tp().counts(Phase::forward);
    const auto& b = m.tp().counts(Phase::backward);
    const auto pb = m.param_bytes();
    std::lock_guard lock(mu);
    row.param_bytes = std::max(row.param_bytes, pb.replicated + pb.sharded);
    row.activation_bytes = std::max(row.activation_bytes, m.activation_bytes());
    if (ctx.rank() != 0) return;
    row.step_ms = times[times.size() / 2];
    row.all_reduce = f.all_reduce + b.all_reduce;
    row.all_gather = f.all_gather + b.all_gather;
    row.reduce_scatter = f.reduce_scatter + b.reduce_scatter;
    row.block_volume = f.volume + b.volume;
    row.other_volume = m.tp().counts(Phase::other).volume;
    row.grads_volume = m.tp().counts(Phase::grads).volume;
  });
  row.formula = S.layers * 8.0 * B * T * S.d_model * (N - 1) / N;
  return row;
}

template <models::GptShape S, int N, bool SP>
Row measure_if_splits(const TpOptions& o) {
  constexpr auto rule = models::tensor_parallel_violation(S, N, SP);
  if constexpr (rule.empty()) return measure<S, N, SP>(o);
  else throw Error(loom::detail::cat("loom: the ", o.model, " model does not split over tp ", N, ": ", rule));
}

template <models::GptShape S, bool SP>
Row measure_tp(int tp, const TpOptions& o) {
  switch (tp) {
    case 1: return measure<S, 1, false>(o);
    case 2: return measure_if_splits<S, 2, SP>(o);
    case 4: return measure_if_splits<S, 4, SP>(o);
    case 8: return measure_if_splits<S, 8, SP>(o);
    default: throw Error(loom::detail::cat("loom: --tp lists ", tp, "; it must list 1, 2, 4 or 8"));
  }
}

template <models::GptShape S>
void measure_model(const TpOptions& o, std::vector<Row>& rows) {
  for (int tp : o.tp) {  // refused before any row runs
    const auto rule = models::tensor_parallel_violation(S, tp, false);
    LOOM_CHECK(rule.empty(), "the ", o.model, " model does not split over tp ", tp, ": ", rule);
  }
  for (int tp : o.tp) {
    if (tp == 1 || o.without_sp) rows.push_back(measure_tp<S, false>(tp, o));
    if (tp > 1 && o.with_sp) rows.push_back(measure_tp<S, true>(tp, o));
  }
}

double mib(std::size_t b) { return static_cast<double>(b) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  try {
    TpOptions o;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&] {
        LOOM_CHECK(i + 1 < argc, a, " needs a value");
        return std::string(argv[++i]);
      };
      if (a == "-h" || a == "--help") {
        std::fputs("usage: tensor_parallel [--model tiny|small|gpt2] [--tp 1,2,4,8] [--sp | --no-sp] [--batch B]\n"
                   "                       [--seq T] [--steps N] [--json FILE]\n", stdout);
        return 0;
      } else if (a == "--model") o.model = next();
      else if (a == "--tp") {
        o.tp.clear();
        std::stringstream ss(next());
        for (std::string x; std::getline(ss, x, ',');) o.tp.push_back(std::stoi(x));
      } else if (a == "--sp") o.with_sp = true, o.without_sp = false;
      else if (a == "--no-sp") o.with_sp = false, o.without_sp = true;
      else if (a == "--batch") o.batch = std::stoi(next());
      else if (a == "--seq") o.seq = std::stoi(next());
      else if (a == "--steps") o.steps = std::stoi(next());
      else if (a == "--json") o.json = next();
      else throw Error("loom: unknown flag '" + a + "'");
    }
    LOOM_CHECK(o.steps >= 1, "--steps ", o.steps, " must be at least 1");
    for (int t : o.tp) {
      LOOM_CHECK(t == 1 || t == 2 || t == 4 || t == 8, "--tp lists ", t, "; it must list 1, 2, 4 or 8");
      LOOM_CHECK(t == 1 || !o.with_sp || o.seq % t == 0, "--seq ", o.seq, " must be a multiple of tp ", t,
                 " for sequence parallelism");
    }
    std::vector<Row> rows;
    if (o.model == "tiny") measure_model<models::tiny>(o, rows);
    else if (o.model == "small") measure_model<models::small>(o, rows);
    else throw Error("loom: unknown model '" + o.model + "' (tiny, small)");

    std::printf("%-6s %3s %3s %6s %5s %9s %9s %12s %12s %6s %12s %9s %9s\n", "model", "tp", "sp", "batch", "seq",
                "step_ms", "ar/ag/rs", "block_elems", "formula", "ratio", "total_elems", "param_MiB", "act_MiB");
    bool agree = true;
    for (const auto& r : rows) {
      const std::string counts =
          std::to_string(r.all_reduce) + "/" + std::to_string(r.all_gather) + "/" + std::to_string(r.reduce_scatter);
      char ratio[16] = "-";
      if (r.formula > 0) std::snprintf(ratio, sizeof ratio, "%.3f", r.ratio());
      std::printf("%-6s %3d %3s %6d %5d %9.1f %9s %12.0f %12.0f %6s %12.0f %9.2f %9.2f\n", r.model.c_str(), r.tp,
                  r.sp ? "on" : "off", r.batch, r.seq, r.step_ms, counts.c_str(), r.block_volume, r.formula, ratio,
                  r.total_volume(), mib(r.param_bytes), mib(r.activation_bytes));
      agree = agree && std::abs(r.block_volume - r.formula) <= 1e-9 * std::max(1.0, r.formula);
    }
    if (!o.json.empty()) {
      {
        std::ofstream f(o.json + ".tmp");
        for (const auto& r : rows)
          f << nlohmann::json{{"model", r.model},
                              {"tp", r.tp},
                              {"sp", r.sp},
                              {"batch", r.batch},
                              {"seq", r.seq},
                              {"step_ms", r.step_ms},
                              {"block_all_reduce", r.all_reduce},
                              {"block_all_gather", r.all_gather},
                              {"block_reduce_scatter", r.reduce_scatter},
                              {"block_elems", r.block_volume},
                              {"formula_elems", r.formula},
                              {"ratio", r.formula > 0 ? nlohmann::json(r.ratio()) : nlohmann::json()},
                              {"other_elems", r.other_volume},
                              {"grads_elems", r.grads_volume},
                              {"total_elems", r.total_volume()},
                              {"param_bytes", r.param_bytes},
                              {"activation_bytes", r.activation_bytes}}
                   .dump()
            << "\n";
      }
      std::rename((o.json + ".tmp").c_str(), o.json.c_str());
    }
    if (!agree) {
      std::fprintf(stderr, "loom: the elements sent inside the blocks differ from 8·b·s·h·(t−1)/t per layer\n");
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

// Pipeline benchmark: for each schedule, the bubble the executor measures (F, B and W costed by sleeping, ranks as
// threads) against the table's simulation and the published formula, and the activations each stage holds: the
// executor's peak of (micro-batch, chunk) pairs held from F to W against the table's verified peak, and the bytes
// the GPT parts allocate for them.
//
//   pipeline [--pp 4] [--micro-batches 8] [--chunks 2] [--unit-ms 10] [--model tiny|small] [--json FILE]
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/testing/costed_model.hpp>
#include <loom/pipeline/executor.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace loom;
using namespace loom::pipeline;
using namespace loom::testing;

struct BenchOptions {
  int pp = 4, m = 8, v = 2;
  double unit_ms = 10;
  std::string model = "small", json;
};

struct Row {
  std::string schedule;
  int p, m, v;
  double formula, table, measured;   //!< bubble: 1 - busy / (p x step)
  std::vector<int> peak, bound;      //!< per stage: activations held at once (F to W), measured and the table's
  std::vector<double> act_mib;       //!< per stage: the GPT parts' activation bytes
};

//! The published bubble, as a share of the step (equal F, B, W; full backward 2 units).
double formula(Schedule s, int p, int m, int v) {
  switch (s) {
    case Schedule::gpipe:
    case Schedule::one_f_one_b: return double(p - 1) / (m + p - 1);
    case Schedule::interleaved: {  // (p-1)/(v m) of the ideal step
      const double r = double(p - 1) / (v * m);
      return r / (1 + r);
    }
    case Schedule::zero_bubble_h1: {  // a third of 1F1B's idle time
      const double idle = (p - 1.0) * 3 / 3, ideal = 3.0 * m;
      return idle / (ideal + idle);
    }
    case Schedule::zero_bubble_v: {  // the stagger at the ends only: (p-1)/(6m) of the ideal step
      const double r = (p - 1.0) / (6.0 * m);
      return r / (1 + r);
    }
  }
  return 0;
}

//! Each stage's GPT parts after one step of the schedule: their activation bytes (slots for the verified peak).
template <models::GptShape S, int P>
std::vector<double> activation_mib(const RuntimeTable& t) {
  const int V = chunks_per_stage(t.schedule, t.chunks), per = S.layers / (P * V);
  std::vector<double> mib(P);
  run_local<Parallel<PP<P>>>([&](auto& ctx) {
    const int stage = ctx.rank();
    using M = models::Gpt<S, float>;
    std::vector<std::unique_ptr<M>> parts;
    std::vector<M*> raw;
    for (int c = 0; c < V; ++c) {
      const int k = virtual_stage(t.schedule, P, stage, c);
      parts.push_back(std::make_unique<M>(1, ctx.template comm<Axis::tp>(), models::GptPart{k * per, (k + 1) * per}));
      raw.push_back(parts.back().get());
    }
    std::vector<std::int32_t> ids(2 * 64, 1);
    auto& pp = ctx.template comm<Axis::pp>();
    Executor<M, std::remove_reference_t<decltype(pp)>> exec(raw, pp, t.schedule);
    exec.run(t, [&](int) { return typename M::MicroBatch{ids.data(), ids.data(), 2, 64}; });
    double bytes = 0;
    for (auto& p : parts) bytes += static_cast<double>(p->activation_bytes());
    mib[stage] = bytes / (1 << 20);
  });
  return mib;
}

template <int P>
std::vector<Row> run_all(const BenchOptions& o) {
  std::vector<Row> rows;
  for (Schedule s : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::interleaved, Schedule::zero_bubble_h1,
                     Schedule::zero_bubble_v}) {
    const int v = s == Schedule::interleaved ? o.v : 1;
    const auto t = make_schedule_checked(s, P, o.m, v);
    Row r{std::string(describe_schedule(s)), P, o.m, chunks_per_stage(s, v), formula(s, P, o.m, v),
          simulate(t).bubble, 0, {}, {}, {}};
    const auto step = time_schedule<P>(t, o.unit_ms / 1000);
    r.measured = step.bubble, r.peak = step.peak;
    const auto check = verify(t);
    for (int st = 0; st < P; ++st) r.bound.push_back(check.peak_held[static_cast<std::size_t>(st)]);
    if (o.model == "tiny" && models::tiny.layers % (P * r.v) == 0) r.act_mib = activation_mib<models::tiny, P>(t);
    if (o.model == "small" && models::small.layers % (P * r.v) == 0) r.act_mib = activation_mib<models::small, P>(t);
    rows.push_back(r);
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  BenchOptions o;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&] {
        if (i + 1 >= argc) throw Error("loom: " + a + " needs a value");
        return std::string(argv[++i]);
      };
      if (a == "-h" || a == "--help") {
        std::fputs("usage: pipeline [--pp 2|4] [--micro-batches M] [--chunks V] [--unit-ms MS] [--model tiny|small]\n"
                   "                [--json FILE]\n", stdout);
        return 0;
      } else if (a == "--pp") o.pp = std::stoi(next());
      else if (a == "--micro-batches") o.m = std::stoi(next());
      else if (a == "--chunks") o.v = std::stoi(next());
      else if (a == "--unit-ms") o.unit_ms = std::stod(next());
      else if (a == "--model") o.model = next();
      else if (a == "--json") o.json = next();
      else throw Error("loom: unknown flag '" + a + "' (--pp --micro-batches --chunks --unit-ms --model --json)");
    }
    std::vector<Row> rows;
    if (o.pp == 2) rows = run_all<2>(o);
    else if (o.pp == 4) rows = run_all<4>(o);
    else throw Error("loom: --pp must be 2 or 4");
    std::printf("%-12s %3s %3s %2s %9s %9s %9s  %-22s %-22s %s\n", "schedule", "p", "m", "v", "formula", "table",
                "measured", "held per stage", "table per stage", "activation MiB per stage");
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : rows) {
      std::string peak, bound, mib;
      for (std::size_t s = 0; s < r.peak.size(); ++s) {
        peak += (s ? "," : "") + std::to_string(r.peak[s]);
        bound += (s ? "," : "") + std::to_string(r.bound[s]);
      }
      char b[32];
      for (std::size_t s = 0; s < r.act_mib.size(); ++s) {
        std::snprintf(b, sizeof b, "%s%.1f", s ? "," : "", r.act_mib[s]);
        mib += b;
      }
      std::printf("%-12s %3d %3d %2d %9.4f %9.4f %9.4f  %-22s %-22s %s\n", r.schedule.c_str(), r.p, r.m, r.v,
                  r.formula, r.table, r.measured, peak.c_str(), bound.c_str(), mib.empty() ? "-" : mib.c_str());
      out.push_back({{"schedule", r.schedule}, {"p", r.p}, {"m", r.m}, {"v", r.v}, {"bubble_formula", r.formula},
                     {"bubble_table", r.table}, {"bubble_measured", r.measured}, {"peak_activations", r.peak},
                     {"table_peak_held", r.bound}, {"activation_mib", r.act_mib}, {"model", o.model}});
    }
    if (!o.json.empty()) {
      std::ofstream f(o.json);
      f << out.dump(2) << "\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

// Data-parallel step benchmark: for DP ranks (threads of this process, Local backend), the time of a training
// step's forward + backward with the bucketed gradient all-reduce overlapped, the same without overlap, the
// compute alone (no reduction), and the reduction alone; exposed communication = (overlapped step - compute) /
// communication.
//
//   ddp [--model tiny|small] [--dp 2,4] [--batch 8] [--seq 128] [--steps 5] [--bucket-mb 1] [--json FILE]
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/train/data_parallel.hpp>

#include <nlohmann/json.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace loom;
using Clock = std::chrono::steady_clock;

struct DdpOptions {
  std::string model = "small";
  std::vector<int> dp{2, 4};
  int batch = 8, seq = 128, steps = 5;
  double bucket_mb = 1;
  std::string json;
};

struct Row {
  std::string model;
  int dp, batch, seq, buckets;
  double compute_ms, comm_ms, serial_ms, overlap_ms, exposed;
};

template <models::GptShape S, int N>
Row measure(const DdpOptions& o) {
  Row row{o.model, N, o.batch, std::min(o.seq, S.max_seq), 0, 0, 0, 0, 0, 0};
  const int T = row.seq, rows = o.batch / N;
  LOOM_CHECK(rows >= 1 && o.batch % N == 0, "--batch ", o.batch, " must be a multiple of dp ", N);
  run_local<Parallel<DP<N>>>([&](auto& ctx) {
#ifdef _OPENMP
    omp_set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / N));
#endif
    models::Gpt<S, float> m(1);
    auto& dp = ctx.template comm<Axis::dp>();
    const auto bucket_bytes = static_cast<std::size_t>(o.bucket_mb * (1 << 20));
    train::DataParallel<models::Gpt<S, float>, std::remove_reference_t<decltype(dp)>> on(m, dp, bucket_bytes, true),
        off(m, dp, bucket_bytes, false);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(rows) * T), tg(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i)
      ids[i] = static_cast<std::int32_t>((i * 13 + ctx.rank()) % S.vocab), tg[i] = ids[(i + 1) % ids.size()];
    auto timed = [&](auto&& body) {
      std::vector<double> t;
      for (int i = 0; i < o.steps + 1; ++i) {
        dp.barrier();
        const auto t0 = Clock::now();
        body();
        dp.barrier();
        if (i > 0) t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
      std::sort(t.begin(), t.end());
      return t[t.size() / 2];
    };
    auto fwd = [&] {
      m.zero_grad();
      m.forward(ids.data(), tg.data(), rows, T);
    };
    const double compute = timed([&] { fwd(), m.backward(); });
    const double comm = timed([&] {
      for (const auto& b : on.buckets())
        dp.all_reduce(std::span<float>(m.grads().data() + b.lo, static_cast<std::size_t>(b.hi - b.lo)),
                      comm::Reduce::avg);
    });
    const double serial = timed([&] { fwd(), off.backward(1.0); });
    const double overlap = timed([&] { fwd(), on.backward(1.0); });
    if (ctx.rank() == 0) {
      row.buckets = static_cast<int>(on.buckets().size());
      row.compute_ms = compute, row.comm_ms = comm, row.serial_ms = serial, row.overlap_ms = overlap;
      row.exposed = (overlap - compute) / comm;
    }
  });
  return row;
}

template <models::GptShape S>
Row measure_dp(int dp, const DdpOptions& o) {
  switch (dp) {
    case 2: return measure<S, 2>(o);
    case 4: return measure<S, 4>(o);
    case 8: return measure<S, 8>(o);
    default: throw Error("loom: --dp must list 2, 4 or 8");
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    DdpOptions o;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&] {
        LOOM_CHECK(i + 1 < argc, a, " needs a value");
        return std::string(argv[++i]);
      };
      if (a == "--model") o.model = next();
      else if (a == "--dp") {
        o.dp.clear();
        std::stringstream ss(next());
        for (std::string x; std::getline(ss, x, ',');) o.dp.push_back(std::stoi(x));
      } else if (a == "--batch") o.batch = std::stoi(next());
      else if (a == "--seq") o.seq = std::stoi(next());
      else if (a == "--steps") o.steps = std::stoi(next());
      else if (a == "--bucket-mb") o.bucket_mb = std::stod(next());
      else if (a == "--json") o.json = next();
      else throw Error("loom: unknown flag '" + a + "'");
    }
    std::vector<Row> rows;
    for (int dp : o.dp) {
      if (o.model == "tiny") rows.push_back(measure_dp<models::tiny>(dp, o));
      else if (o.model == "small") rows.push_back(measure_dp<models::small>(dp, o));
      else throw Error("loom: unknown model '" + o.model + "' (tiny, small)");
    }
    std::printf("%-6s %3s %6s %5s %8s %11s %9s %10s %11s %8s\n", "model", "dp", "batch", "seq", "buckets",
                "compute_ms", "comm_ms", "serial_ms", "overlap_ms", "exposed");
    for (const auto& r : rows)
      std::printf("%-6s %3d %6d %5d %8d %11.1f %9.1f %10.1f %11.1f %7.0f%%\n", r.model.c_str(), r.dp, r.batch, r.seq,
                  r.buckets, r.compute_ms, r.comm_ms, r.serial_ms, r.overlap_ms, 100 * r.exposed);
    if (!o.json.empty()) {
      {
        std::ofstream f(o.json + ".tmp");
        for (const auto& r : rows)
          f << nlohmann::json{{"model", r.model}, {"dp", r.dp}, {"batch", r.batch}, {"seq", r.seq},
                              {"buckets", r.buckets}, {"compute_ms", r.compute_ms}, {"comm_ms", r.comm_ms},
                              {"serial_ms", r.serial_ms}, {"overlap_ms", r.overlap_ms}, {"exposed", r.exposed}}
                   .dump()
            << "\n";
      }
      std::rename((o.json + ".tmp").c_str(), o.json.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

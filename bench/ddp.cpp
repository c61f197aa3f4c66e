// Data-parallel step benchmark: for DP ranks (threads of this process, Local backend; with --device cuda, sharing
// one GPU), the time of a training step's forward + backward with the bucketed gradient all-reduce overlapped, the
// same without overlap, the compute alone (no reduction), and the reduction alone; exposed communication =
// (overlapped step - compute) / communication.
//
//   ddp [--device cpu|cuda] [--model tiny|small|gpt2] [--dtype f32|bf16] [--dp 2,4] [--batch 8] [--seq 128]
//       [--steps 5] [--bucket-mb 1] [--json FILE]
#include "ddp.hpp"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>

#ifndef LOOM_DDP_CUDA
std::vector<ddp_bench::Row> ddp_bench::measure_cuda(const DdpOptions&) {
  throw loom::Error("loom: --device cuda: this ddp was built without CUDA (configure with -DLOOM_WITH_CUDA=ON)");
}
#endif

namespace {

using namespace ddp_bench;

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
      if (a == "-h" || a == "--help") {
        std::fputs("usage: ddp [--model tiny|small|gpt2] [--device cpu|cuda] [--dtype f32|bf16] [--dp 2,4]\n"
                   "           [--batch B] [--seq T] [--steps N] [--bucket-mb MB] [--json FILE]\n", stdout);
        return 0;
      } else if (a == "--model") o.model = next();
      else if (a == "--device") o.device = next();
      else if (a == "--dtype") o.dtype = next();
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
    LOOM_CHECK(o.device == "cpu" || o.device == "cuda", "--device must be cpu or cuda, got '", o.device, "'");
    if (o.device == "cuda") {
      rows = measure_cuda(o);
    } else {
      LOOM_CHECK(o.dtype == "f32", "--dtype ", o.dtype, ": CPU ranks run f32");
      for (int dp : o.dp) {
        if (o.model == "tiny") rows.push_back(measure_dp<models::tiny>(dp, o));
        else if (o.model == "small") rows.push_back(measure_dp<models::small>(dp, o));
        else throw Error("loom: unknown model '" + o.model + "' on the CPU (tiny, small)");
      }
    }
    std::printf("%-6s %-5s %-5s %3s %6s %5s %8s %11s %9s %10s %11s %8s\n", "model", "dev", "dtype", "dp", "batch",
                "seq", "buckets", "compute_ms", "comm_ms", "serial_ms", "overlap_ms", "exposed");
    for (const auto& r : rows)
      std::printf("%-6s %-5s %-5s %3d %6d %5d %8d %11.1f %9.1f %10.1f %11.1f %7.0f%%\n", r.model.c_str(),
                  r.device.c_str(), r.dtype.c_str(), r.dp, r.batch, r.seq, r.buckets, r.compute_ms, r.comm_ms,
                  r.serial_ms, r.overlap_ms, 100 * r.exposed);
    if (!o.json.empty()) {
      {
        std::ofstream f(o.json + ".tmp");
        for (const auto& r : rows)
          f << nlohmann::json{{"model", r.model}, {"device", r.device}, {"dtype", r.dtype}, {"dp", r.dp}, {"batch", r.batch}, {"seq", r.seq},
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

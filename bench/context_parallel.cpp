// Context-parallel attention: per-rank work of ring attention (forward and backward, f32, CPU threads as cp ranks)
// under the zigzag split and under a contiguous split, and of Ulysses, for sequences of 2k to 16k tokens on 1, 2, 4
// and 8 ranks. Each rank's work is the CPU time of its thread (CLOCK_THREAD_CPUTIME_ID: what it computed, not what
// it waited, though the ranks share the cores); the table gives the largest and smallest over ranks and their ratio,
// with the step's wall time and the elements each rank sent.
//
//   context_parallel [--seq 2048,4096,8192,16384] [--cp 1,2,4,8] [--heads 4] [--kv-heads 4] [--head-dim 64]
//                    [--json FILE]
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/layers/ring_attention.hpp>
#include <loom/layers/ulysses_attention.hpp>

#include "cli.hpp"

#include <time.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using namespace loom;

struct BenchOptions {
  std::vector<int> seq{2048, 4096, 8192, 16384}, cp{1, 2, 4, 8};
  int heads = 4, kv_heads = 4, head_dim = 64;
  std::string json;
};

struct Row {
  std::string algorithm;
  int seq = 0, cp = 0;
  double cpu_max_ms = 0, cpu_min_ms = 0, wall_ms = 0, sent = 0;
};

double thread_cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e3 + double(t.tv_nsec) * 1e-6;
}

template <int N>
void measure(const BenchOptions& o, int T, const std::string& algorithm, std::vector<Row>& rows) {
  const int c = T / (2 * N), D = o.head_dim, wq = o.heads * D, wkv = o.kv_heads * D;
  std::vector<double> cpu(N), wall(N), sent(N);
  run_local<Parallel<CP<N>>>([&](auto& ctx) {
    auto& cp = ctx.template comm<Axis::cp>();
    const int r = cp.rank();
    std::vector<float> q(std::size_t(2) * c * wq), k(std::size_t(2) * c * wkv), v(k.size()), out(q.size());
    std::vector<float> dq(q.size()), dk(k.size()), dv(k.size()), dout(q.size());
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = float(std::sin(0.37 * double(i + r))), dout[i] = 0.01f;
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = float(std::cos(0.11 * double(i))), v[i] = float(i % 7) * 0.1f;
    std::vector<float> lse(std::size_t(o.heads) * 2 * c);
    const kernels::AttentionShape s{1, 2 * c, o.heads, o.kv_heads, D, wq, wkv, wq, 1.0 / std::sqrt(double(D))};
    cp.barrier();
    cp.reset_traffic();
    const double c0 = thread_cpu_ms();
    const auto t0 = std::chrono::steady_clock::now();
    if (algorithm == "ulysses") {
      layers::ulysses_attention_forward(cp, q.data(), k.data(), v.data(), out.data(), lse.data(), s);
      layers::ulysses_attention_backward(cp, dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(),
                                         dq.data(), dk.data(), dv.data(), s);
    } else {
      const auto split = algorithm == "ring" ? layers::SeqSplit::zigzag : layers::SeqSplit::contiguous;
      layers::ring_attention_forward(cp, q.data(), k.data(), v.data(), out.data(), lse.data(), s, split);
      layers::ring_attention_backward(cp, dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(),
                                      dq.data(), dk.data(), dv.data(), s, split);
    }
    cpu[std::size_t(r)] = thread_cpu_ms() - c0;
    cp.barrier();
    wall[std::size_t(r)] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    sent[std::size_t(r)] = cp.traffic().elements;
  });
  Row row{algorithm, T, N, cpu[0], cpu[0], wall[0], sent[0]};
  for (int r = 0; r < N; ++r) {
    row.cpu_max_ms = std::max(row.cpu_max_ms, cpu[std::size_t(r)]);
    row.cpu_min_ms = std::min(row.cpu_min_ms, cpu[std::size_t(r)]);
    row.wall_ms = std::max(row.wall_ms, wall[std::size_t(r)]), row.sent = std::max(row.sent, sent[std::size_t(r)]);
  }
  rows.push_back(row);
}

void measure_all(const BenchOptions& o, int T, int n, std::vector<Row>& rows) {
  layers::check_zigzag(T, n);
  for (const char* a : {"ring", "contiguous", "ulysses"}) {
    if (std::string(a) == "ulysses" && (o.heads % n || o.kv_heads % n)) continue;
    if (std::string(a) == "contiguous" && n == 1) continue;
    switch (n) {
      case 1: measure<1>(o, T, a, rows); break;
      case 2: measure<2>(o, T, a, rows); break;
      case 4: measure<4>(o, T, a, rows); break;
      case 8: measure<8>(o, T, a, rows); break;
      default: throw Error(loom::detail::cat("loom: --cp lists 1, 2, 4 or 8, got ", n));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return bench::guarded([&] {
    BenchOptions o;
    bench::CommandLine cl(argc, argv);
    const bool go = cl.parse("usage: context_parallel [--seq 2048,4096,...] [--cp 1,2,4,8] [--heads H]\n"
                             "                        [--kv-heads H] [--head-dim D] [--json FILE]\n",
                             [&](const std::string& a) {
                               if (a == "--seq") o.seq = bench::int_list(cl.value());
                               else if (a == "--cp") o.cp = bench::int_list(cl.value());
                               else if (a == "--heads") o.heads = std::stoi(cl.value());
                               else if (a == "--kv-heads") o.kv_heads = std::stoi(cl.value());
                               else if (a == "--head-dim") o.head_dim = std::stoi(cl.value());
                               else if (a == "--json") o.json = cl.value();
                               else throw Error("loom: unknown flag '" + a + "'");
                             });
    if (!go) return 0;
    std::vector<Row> rows;
    std::printf("%-10s %6s %3s %12s %12s %9s %10s %12s\n", "split", "seq", "cp", "cpu_max_ms", "cpu_min_ms",
                "max/min", "wall_ms", "sent");
    std::vector<nlohmann::json> records;
    for (int T : o.seq)
      for (int n : o.cp) {
        const std::size_t first = rows.size();
        measure_all(o, T, n, rows);
        for (std::size_t i = first; i < rows.size(); ++i) {
          const Row& r = rows[i];
          std::printf("%-10s %6d %3d %12.1f %12.1f %9.3f %10.1f %12.0f\n", r.algorithm.c_str(), r.seq, r.cp,
                      r.cpu_max_ms, r.cpu_min_ms, r.cpu_max_ms / r.cpu_min_ms, r.wall_ms, r.sent);
          std::fflush(stdout);
          records.push_back({{"split", r.algorithm}, {"seq", r.seq}, {"cp", r.cp}, {"cpu_max_ms", r.cpu_max_ms},
                             {"cpu_min_ms", r.cpu_min_ms}, {"wall_ms", r.wall_ms}, {"sent_elements", r.sent}});
        }
      }
    if (!o.json.empty()) bench::write_json_lines(o.json, records);
    return 0;
  });
}

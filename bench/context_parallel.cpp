// Context-parallel attention: per-rank work of ring attention (forward and backward, f32, CPU threads as cp ranks)
// under the zigzag split and under a contiguous split, and of Ulysses, for sequences of 2k to 16k tokens on 1, 2, 4
// and 8 ranks. Each rank's work is the CPU time of its thread (CLOCK_THREAD_CPUTIME_ID: what it computed, not what
// it waited, though the ranks share the cores; the least of --repeat runs, 3 by default); the table gives the largest
// and smallest over ranks and their ratio, with the step's wall time and the elements each rank sent.
//
// Then the model: one forward and backward of `--model long` (tiny's width and depth, 32768 positions; f32, one
// sequence) on CP 1, 2, 4 and 8 ranks, ring and Ulysses, for sequences of 2k to 32k tokens: each rank's peak of
// activation bytes (its ledger's MemoryUse::activations, the attention's workspace included), the largest over ranks,
// per token the rank holds, and the wall time.
//
//   context_parallel [--seq 2048,4096,8192,16384] [--cp 1,2,4,8] [--heads 4] [--kv-heads 4] [--head-dim 64]
//                    [--repeat 3] [--model-seq 2048,...,32768] [--recompute none|selective|full] [--json FILE]
// An empty list skips its part: --model-seq '' runs the attention alone.
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/layers/ring_attention.hpp>
#include <loom/layers/ulysses_attention.hpp>
#include <loom/models/gpt.hpp>

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
  int heads = 4, kv_heads = 4, head_dim = 64, repeat = 3;
  std::vector<int> model_seq{2048, 4096, 8192, 16384, 32768};
  models::Recompute recompute = models::Recompute::none;
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
    cpu[std::size_t(r)] = wall[std::size_t(r)] = INFINITY;
    for (int rep = 0; rep < o.repeat; ++rep) {  // each rank's least time over the repetitions
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
      cpu[std::size_t(r)] = std::min(cpu[std::size_t(r)], thread_cpu_ms() - c0);
      cp.barrier();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      wall[std::size_t(r)] = std::min(wall[std::size_t(r)], ms);
      sent[std::size_t(r)] = cp.traffic().elements;
    }
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

struct ModelRow {
  std::string algorithm;
  int seq = 0, cp = 0;
  double peak_bytes = 0, wall_ms = 0, loss = 0;
};

//! One forward and backward of the long-context model on CP<N, A>: the largest peak of activation bytes over ranks.
template <int N, class A>
ModelRow measure_model(const BenchOptions& o, int T) {
  using Cfg = std::conditional_t<N == 1, Parallel<>, Parallel<CP<N, A>>>;
  using Model = models::Gpt<models::long_context, float, models::ModelLayout<Cfg>>;
  std::vector<double> peak(N), wall(N), loss(N);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T)), targets(ids.size());
  for (int t = 0; t < T; ++t) ids[std::size_t(t)] = t * 7 % 256, targets[std::size_t(t)] = (t * 7 + 3) % 256;
  run_local<Cfg>([&](auto& ctx) {
    models::GptOptions opt;
    opt.recompute = o.recompute;
    std::unique_ptr<Model> m;
    if constexpr (N == 1) m = std::make_unique<Model>(1, opt);
    else
      m = std::make_unique<Model>(1, ctx.template comm<Axis::tp>(), ctx.template comm<Axis::cp>(), models::GptPart{},
                                  opt);
    rank_memory().reset_peaks();
    const auto t0 = std::chrono::steady_clock::now();
    const double l = m->forward(ids.data(), targets.data(), 1, T);
    m->backward();
    const std::size_t r = static_cast<std::size_t>(ctx.rank());
    wall[r] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    peak[r] = double(rank_memory().peak(MemoryUse::activations));
    loss[r] = l;
  });
  ModelRow row{N == 1 ? "single" : std::string(describe_cp_algorithm(Cfg::cp_algorithm)), T, N, 0, 0, 0};
  for (int r = 0; r < N; ++r) {
    row.peak_bytes = std::max(row.peak_bytes, peak[std::size_t(r)]);
    row.wall_ms = std::max(row.wall_ms, wall[std::size_t(r)]);
    row.loss += loss[std::size_t(r)] / N;
  }
  return row;
}

void measure_model_all(const BenchOptions& o, int T, int n, std::vector<ModelRow>& rows) {
  layers::check_zigzag(T, n);
  switch (n) {
    case 1: rows.push_back(measure_model<1, Ring>(o, T)); break;
    case 2: rows.push_back(measure_model<2, Ring>(o, T)), rows.push_back(measure_model<2, Ulysses>(o, T)); break;
    case 4: rows.push_back(measure_model<4, Ring>(o, T)), rows.push_back(measure_model<4, Ulysses>(o, T)); break;
    case 8: rows.push_back(measure_model<8, Ring>(o, T)); break;  // long_context's 4 heads do not split over 8
    default: throw Error(loom::detail::cat("loom: --cp lists 1, 2, 4 or 8, got ", n));
  }
}

}  // namespace

int main(int argc, char** argv) {
  return bench::guarded([&] {
    BenchOptions o;
    bench::CommandLine cl(argc, argv);
    const bool go = cl.parse("usage: context_parallel [--seq 2048,4096,...] [--cp 1,2,4,8] [--heads H]\n"
                             "                        [--kv-heads H] [--head-dim D] [--repeat R]\n"
                             "                        [--model-seq 2048,...]\n"
                             "                        [--recompute none|selective|full] [--json FILE]\n",
                             [&](const std::string& a) {
                               if (a == "--seq") o.seq = bench::int_list(cl.value());
                               else if (a == "--cp") o.cp = bench::int_list(cl.value());
                               else if (a == "--heads") o.heads = std::stoi(cl.value());
                               else if (a == "--kv-heads") o.kv_heads = std::stoi(cl.value());
                               else if (a == "--head-dim") o.head_dim = std::stoi(cl.value());
                               else if (a == "--json") o.json = cl.value();
                               else if (a == "--model-seq") o.model_seq = bench::int_list(cl.value());
                               else if (a == "--repeat") o.repeat = std::stoi(cl.value());
                               else if (a == "--recompute") {
                                 const std::string v = cl.value();
                                 const auto r = models::recompute_named(v);
                                 LOOM_CHECK(r, "--recompute must be none, selective or full, got '", v, "'");
                                 o.recompute = *r;
                               }
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
    std::printf("\nmodel long (d=64, 2 layers, 4 heads), f32, one sequence, recompute %s: one forward and backward\n",
                std::string(models::describe_recompute(o.recompute)).c_str());
    std::printf("%-10s %6s %3s %16s %16s %10s %10s\n", "algorithm", "seq", "cp", "peak_act_MiB", "bytes/token",
                "wall_ms", "loss");
    for (int T : o.model_seq)
      for (int n : o.cp) {
        std::vector<ModelRow> mrows;
        measure_model_all(o, T, n, mrows);
        for (const ModelRow& r : mrows) {
          const double per_token = r.peak_bytes / (double(r.seq) / r.cp);
          std::printf("%-10s %6d %3d %16.2f %16.1f %10.1f %10.4f\n", r.algorithm.c_str(), r.seq, r.cp,
                      r.peak_bytes / (1 << 20), per_token, r.wall_ms, r.loss);
          std::fflush(stdout);
          records.push_back({{"model", "long"}, {"algorithm", r.algorithm}, {"seq", r.seq}, {"cp", r.cp},
                             {"recompute", models::describe_recompute(o.recompute)},
                             {"peak_activation_bytes", r.peak_bytes}, {"wall_ms", r.wall_ms}, {"loss", r.loss}});
        }
      }
    if (!o.json.empty()) bench::write_json_lines(o.json, records);
    return 0;
  });
}

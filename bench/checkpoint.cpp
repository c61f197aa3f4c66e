// Checkpoint benchmark: sharded checkpoints of a GPT (f32, AdamW) on 1, 2, 4 and 8 ranks (one rank, and data
// parallelism with ZeRO-1: each rank writes its shard of the optimizer state and an even share of the parameters),
// as threads of this process or, with --backend mpi under mpirun, as processes. For each: the bytes written against
// the model's and optimizer's (4Ψ + 8Ψ: nothing twice); the time a save holds the training, written in place
// against in the background (CheckpointWriter, side by side in one run: its first save, which allocates the host
// copy, and its second, two steps later, which reuses it), and how long the second takes to be in place; a training
// step alone and a step while the background writer runs; the time to load it back; and per rank the peak of
// checkpoint buffers while saving in place (one chunk), in the background (the host copy of its part) and while
// loading (one checksum block), and under mpirun each process's peak resident memory.
//
//   checkpoint [--model small|gpt2] [--ranks 1,2,4,8] [--batch 8] [--seq 32] [--dir DIR] [--json FILE]
//   mpirun -np 4 checkpoint --backend mpi --ranks 4 [...]
#include <loom/checkpoint/sharded.hpp>
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/models/gpt/checkpoint.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/trainer.hpp>
#ifdef LOOM_HAS_MPI
#include <loom/comm/mpi.hpp>
#endif

#include "cli.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

using namespace loom;

struct BenchOptions {
  std::string model = "small", backend = "local", dir, json;
  std::vector<int> ranks{1, 2, 4, 8};
  int batch = 8, seq = 32;
};

struct Row {
  std::string model, layout, backend;
  int ranks = 0;
  std::int64_t psi = 0;
  double written = 0, model_bytes = 0;    // bytes on disk; 4Ψ + 8Ψ
  double step_ms = 0, step_writing_ms = 0;  // a step alone; a step while the background writer runs
  double sync_ms = 0, async_blocked_ms = 0, async_next_ms = 0, async_in_place_ms = 0, load_ms = 0;
  double save_buffers = 0, async_buffers = 0, load_buffers = 0, rss = 0;  // per rank, the largest; rss: mpirun
};

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

//! This process's peak resident memory (VmHWM), in bytes.
double peak_rss() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) * 1024;
  return 0;
}

double bytes_under(const std::string& dir) {
  double b = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.is_regular_file()) b += double(e.file_size());
  return b;
}

//! What every rank does: trains, saves in place, saves in the background across a step, loads.
template <models::GptShape S, class Cfg, class Ctx>
void rank_body(Ctx& ctx, const BenchOptions& o, const std::string& root, Row& row) {
  using Model = models::Gpt<S, float, models::ModelLayout<Cfg>>;
  using Opt = optim::AdamW<float>;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(o.batch) * (o.seq + 1) * 4);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 7919 + 13) % S.vocab);
  const train::Batches data(tokens, o.batch, o.seq, train::BatchOrder::sequential, 1);
  train::TrainerOptions<models::GptOptions> options;
  options.seed = 1;
  options.step.batch = o.batch, options.step.seq = o.seq;
  train::Trainer<Cfg, Model, Opt> trainer(ctx, data, options, [](const auto& specs, std::int64_t n) {
    return Opt(specs, n);
  });
  auto& world = ctx.world();
  const std::string layout(Cfg::name());
  trainer.step(0);
  world.barrier();
  double t = now_ms();
  trainer.step(1);
  world.barrier();
  std::vector<double> v(11, 0.0);
  v[0] = now_ms() - t;  // a step

  rank_memory().reset_peaks();
  world.barrier();
  t = now_ms();
  checkpoint::save_sharded(root + "/sync", trainer, 2, layout);
  v[1] = now_ms() - t;  // in place (it ends with a barrier)
  v[2] = double(rank_memory().peak(MemoryUse::checkpoint));

  rank_memory().reset_peaks();
  {
    checkpoint::CheckpointWriter writer(root + "/async", {.asynchronous = true});
    world.barrier();
    t = now_ms();
    writer.save(trainer, 2, layout);
    v[3] = now_ms() - t;  // what the first save held the training (its host buffers are allocated)
    trainer.step(2);      // while this rank's file is written
    v[4] = now_ms() - t - v[3];
    trainer.step(3);
    world.barrier();
    t = now_ms();
    writer.save(trainer, 4, layout);  // the buffers reused; the first save's writing may still hold it
    v[10] = now_ms() - t;
    writer.finish(trainer);
    v[5] = now_ms() - t;  // the second save, until it is in place
  }
  v[9] = double(rank_memory().peak(MemoryUse::checkpoint));

  rank_memory().reset_peaks();
  world.barrier();
  t = now_ms();
  checkpoint::load_sharded(root + "/sync", trainer);
  v[6] = now_ms() - t;
  v[7] = double(rank_memory().peak(MemoryUse::checkpoint));
  v[8] = peak_rss();
  world.all_reduce(v, comm::Reduce::max);
  if (world.rank() != 0) return;
  row.layout = layout, row.ranks = Cfg::world_size;
  row.step_ms = v[0], row.sync_ms = v[1], row.save_buffers = v[2], row.async_blocked_ms = v[3];
  row.step_writing_ms = v[4], row.async_in_place_ms = v[5], row.load_ms = v[6], row.load_buffers = v[7];
  row.rss = o.backend == "mpi" ? v[8] : 0;
  row.async_buffers = v[9], row.async_next_ms = v[10];
  row.written = bytes_under(checkpoint::resolve_checkpoint(root + "/sync"));
  row.psi = S.params(), row.model_bytes = 12.0 * double(S.params());
}

template <models::GptShape S, class Cfg>
void measure(const BenchOptions& o, [[maybe_unused]] int& argc, [[maybe_unused]] char**& argv,
             std::vector<Row>& rows) {
  Row row;
  row.model = o.model, row.backend = o.backend;
  const std::string root = o.dir + "/" + std::string(Cfg::name());
  if (o.backend == "mpi") {
#ifdef LOOM_HAS_MPI
    const int rc = run_mpi<Cfg>(argc, argv, [&](auto& ctx) { rank_body<S, Cfg>(ctx, o, root, row); });
    if (rc != 0) std::exit(rc);
    if (comm::launch().rank != 0) return;
#else
    throw Error("loom: --backend mpi: this build has no MPI");
#endif
  } else {
    run_local<Cfg>([&](auto& ctx) { rank_body<S, Cfg>(ctx, o, root, row); });
  }
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  rows.push_back(row);
}

template <models::GptShape S>
void measure_all(const BenchOptions& o, int& argc, char**& argv, std::vector<Row>& rows) {
  for (int n : o.ranks) {
    switch (n) {
      case 1: measure<S, Parallel<>>(o, argc, argv, rows); break;
      case 2: measure<S, Parallel<DP<2, ZeRO<1>>>>(o, argc, argv, rows); break;
      case 4: measure<S, Parallel<DP<4, ZeRO<1>>>>(o, argc, argv, rows); break;
      case 8: measure<S, Parallel<DP<8, ZeRO<1>>>>(o, argc, argv, rows); break;
      default: throw Error(loom::detail::cat("loom: --ranks lists 1, 2, 4 or 8, got ", n));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return bench::guarded([&] {
    BenchOptions o;
    bench::CommandLine cl(argc, argv);
    const bool go = cl.parse("usage: checkpoint [--model small|gpt2] [--ranks 1,2,4,8] [--backend local|mpi]\n"
                             "                  [--batch B] [--seq T] [--dir DIR] [--json FILE]\n",
                             [&](const std::string& a) {
                               if (a == "--model") o.model = cl.value();
                               else if (a == "--ranks") o.ranks = bench::int_list(cl.value());
                               else if (a == "--backend") o.backend = cl.value();
                               else if (a == "--batch") o.batch = std::stoi(cl.value());
                               else if (a == "--seq") o.seq = std::stoi(cl.value());
                               else if (a == "--dir") o.dir = cl.value();
                               else if (a == "--json") o.json = cl.value();
                               else throw Error("loom: unknown flag '" + a + "'");
                             });
    if (!go) return 0;
    LOOM_CHECK(o.backend == "local" || o.backend == "mpi", "--backend must be local or mpi, got '", o.backend, "'");
    LOOM_CHECK(o.backend == "local" || o.ranks.size() == 1, "--backend mpi measures one --ranks (the job's size)");
    const bool own_dir = o.dir.empty();
    if (own_dir) o.dir = (std::filesystem::temp_directory_path() / "loom-bench-checkpoint").string();
    if (own_dir && o.backend == "mpi") o.dir += "-mpi";
    std::vector<Row> rows;
    if (o.model == "small") measure_all<models::small>(o, argc, argv, rows);
    else if (o.model == "gpt2") measure_all<models::gpt2>(o, argc, argv, rows);
    else throw Error("loom: unknown model '" + o.model + "' (small, gpt2)");
    if (rows.empty()) return 0;  // an MPI rank but rank 0
    constexpr double mib = 1 << 20;
    std::printf("%-6s %-10s %-7s %5s %11s %11s %8s %9s %9s %9s %10s %9s %10s %8s %9s %9s %9s\n", "model",
                "layout", "backend", "ranks", "written_MiB", "12psi_MiB", "step_ms", "sync_ms", "async_ms", "next_ms",
                "in_place", "step_bg", "load_ms", "sync_MiB", "async_MiB", "load_MiB", "rss_MiB");
    std::vector<nlohmann::json> records;
    for (const auto& r : rows) {
      std::printf("%-6s %-10s %-7s %5d %11.3f %11.3f %8.1f %9.1f %9.1f %9.1f %10.1f %9.1f %10.1f %8.3f %9.3f "
                  "%9.3f %9.1f\n",
                  r.model.c_str(), r.layout.c_str(), r.backend.c_str(), r.ranks, r.written / mib,
                  r.model_bytes / mib, r.step_ms, r.sync_ms, r.async_blocked_ms, r.async_next_ms, r.async_in_place_ms,
                  r.step_writing_ms, r.load_ms, r.save_buffers / mib, r.async_buffers / mib, r.load_buffers / mib,
                  r.rss / mib);
      records.push_back({{"model", r.model}, {"layout", r.layout}, {"backend", r.backend}, {"ranks", r.ranks},
                         {"psi", r.psi}, {"written_bytes", r.written}, {"model_optimizer_bytes", r.model_bytes},
                         {"step_ms", r.step_ms}, {"sync_save_ms", r.sync_ms},
                         {"async_blocked_ms", r.async_blocked_ms}, {"async_next_blocked_ms", r.async_next_ms},
                         {"async_in_place_ms", r.async_in_place_ms},
                         {"step_while_writing_ms", r.step_writing_ms}, {"load_ms", r.load_ms},
                         {"sync_buffer_peak_bytes", r.save_buffers}, {"async_buffer_peak_bytes", r.async_buffers},
                         {"load_buffer_peak_bytes", r.load_buffers},
                         {"peak_rss_bytes", r.rss}});
    }
    if (!o.json.empty()) bench::write_json_lines(o.json, records);
    return 0;
  });
}

// train_gpt's training loop, shared by the translation units that compile its layouts (one per family of
// layouts, so that the build runs in parallel): the options, what every rank does, and the dispatch from
// --model, --dtype and --parallel to compile-time types.
#pragma once

#include <loom/checkpoint/sharded.hpp>
#include <loom/checkpoint/snapshots.hpp>
#include <loom/checkpoint/trainer.hpp>
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/core/heartbeat.hpp>
#include <loom/data/shards.hpp>
#include <loom/models/gpt.hpp>
#include <loom/models/gpt/checkpoint.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/optim/schedule.hpp>
#include <loom/train/data.hpp>
#include <loom/train/trainer.hpp>
#ifdef LOOM_HAS_MPI
#include <loom/comm/mpi.hpp>
#endif

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace train_gpt {

using namespace loom;

//! The shapes --model names (models::tiny, ..., models::mixtral_small); a Hugging Face directory names its own.
inline constexpr std::string_view model_names =
    "tiny, small, gpt2, long, tiny-moe, small-moe, llama-tiny, llama-small, llama3-1b, mixtral-tiny, mixtral-small";

struct Args {
  std::string model = "tiny", optimizer = "adamw", dtype = "f32", device = "cpu", backend = "local";
  std::string parallel, schedule = "1f1b", data, batch_order = "sequential", log_json, save, init_from, resume;
  std::string recompute = "none";  //!< --recompute none|selective|full
  std::string router = "softmax";  //!< --router softmax|sigmoid: a mixture of experts' scores
  int steps = 200, batch = 16, micro_batches = 1, seq = 64, warmup = 0;
  int chunks = 1;  //!< --parallel vN: model chunks per pipeline stage (interleaved)
  std::vector<int> layer_split;  //!< --layer-split: blocks per virtual pipeline stage; empty: even
  double lr = 3e-3, weight_decay = 0.01, grad_clip = 1.0, dropout = 0.0;
  //! Mixture of experts: --capacity-factor (0: dropless), --aux-loss-coeff, --z-loss-coeff.
  double capacity_factor = 1.25, aux_loss_coeff = 0.01, z_loss_coeff = 0.0;
  float bucket_mb = 25.0f;
  std::uint64_t max_bytes = 0;  //!< --max-bytes: each rank's cap on host memory (0: LOOM_MAX_BYTES, else none)
  std::uint64_t seed = 1234;
  bool progress = true;
  bool schedule_given = false;     //!< --schedule was on the command line
  bool allow_changed_run = false;  //!< --allow-changed-run: --resume may continue with other settings
  bool auto_resume = false;        //!< --auto-resume: continue from --save DIR's newest checkpoint, if it has one
  //! Token shards (llm.c's format) to train on instead of --data's bytes, and to validate on: globs.
  std::string train_data, val_data;
  int val_every = 0;    //!< --val-every N: validation every N steps (0: at the end only)
  int val_batches = 4;  //!< --val-batches K: the validation loss is the mean over batches 0..K-1 of --val-data
  //! --lr-schedule constant|cosine|linear|wsd, --min-lr, --decay-steps (0: --steps), --wsd-decay-fraction.
  std::string lr_schedule = "constant";
  double min_lr = 0, wsd_decay_fraction = 0.2;
  int decay_steps = 0;
  double peak_flops = 0;  //!< --peak-flops: the job's peak FLOP/s for MFU (0: the device's default, peak_flops)
  double norm_eps = 1e-5;  //!< the norms' epsilon: a Hugging Face directory's (--model or --init-from), read by parse
  //! --vocab N, or --tokenizer FILE's size (read by parse): the model's vocabulary at run time (0: the shape's).
  int vocab = 0;
  std::string tokenizer;
  std::string log_dir;  //!< --log-dir DIR: every rank's own log, DIR/rank-NNNNN.jsonl
  int save_every = 0;              //!< --save-every N: a checkpoint every N steps (0: at the end only)
  int keep = 0;                    //!< --keep N: the N newest checkpoints stay (0: all)
  bool async_save = false;         //!< --async-save: checkpoints are written in the background
  int snapshot_every = 0;          //!< --snapshot-every N: an in-memory snapshot every N steps (0: none)
  std::string snapshot_dir;        //!< --snapshot-dir DIR: where they are kept (default: default_snapshot_dir)
  int disk_step = -1;              //!< --auto-resume: the step of --save DIR's newest checkpoint (-1: none)
  //! --sample-every N: a text generated greedily from the model every N steps and after the last (0: none): --prompt
  //! TEXT and the --sample-tokens K tokens after it, encoded by parse (with --tokenizer, else as bytes) into
  //! prompt_ids; detokenize gives a sample's text, and sample_stops the tokens that end one.
  int sample_every = 0, sample_tokens = 32;
  std::string prompt;
  bool prompt_given = false;
  std::vector<std::int32_t> prompt_ids, sample_stops;
  std::function<std::string(const std::vector<std::int32_t>&)> detokenize;
  std::string write_corpus;  //!< --write-corpus FILE: write the built-in corpus there and exit
};

//! The training data: bytes (--data, or the built-in corpus) or token shards (--train-data), drawn into the global
//! batches of the run, and what a run record names of it.
struct DataSet {
  std::unique_ptr<train::DataSource> source;
  std::uint64_t tokens = 0;
  std::string hash;  //!< FNV-1a over the tokens (bytes), or over the shards' own
  nlohmann::json shards = nlohmann::json::array();  //!< per shard: its file name, tokens and FNV-1a of its bytes
};
//! The training data of the run, for a model of `vocab` tokens (a token at or above it is refused, naming where).
DataSet open_data(const Args& a, int vocab);
//! --val-data's shards, read in order, or null without it.
std::unique_ptr<data::TokenShards> open_validation(const Args& a, int vocab);
//! The peak FLOP/s MFU is measured against: --peak-flops, else a nominal figure for the device (cpu: 64 GFLOP/s per
//! hardware thread, AVX2's two 8-wide FMAs at 2 GHz; cuda: 989 TFLOP/s, an H100's or H200's dense bf16).
double peak_flops(const Args& a);
//! The learning rate of each step from --lr, --warmup, --lr-schedule, --min-lr, --decay-steps and
//! --wsd-decay-fraction (checked by parse).
optim::LrSchedule lr_schedule(const Args& a);

//! Skipped steps in a row (the loss or the gradient norm not finite) after which a run stops.
inline constexpr int max_skipped_in_a_row = 10;

//! x in the fewest digits that read back as x ("0.003", "1e+30"); every NaN is "nan", whatever its sign bit.
std::string show(double x);

//! What a checkpoint's index records of a run (under "run"): the settings that make it the run it is, and the data's
//! size and FNV-1a hash. `layout` is the layout's name.
nlohmann::json run_record(const Args& a, const std::string& layout, const DataSet& data);

//! For --resume: refuses a checkpoint that stands at or beyond --steps, and one saved by a run with other settings
//! (unless --allow-changed-run; the model and optimizer never change); `run` is this run's run_record.
void check_resume(const Args& a, const nlohmann::json& run);

//! What each rank holds, in bytes (the largest over ranks: the vocabulary may split unevenly).
struct Held {
  double replicated = 0, sharded = 0, grads = 0, state = 0, master = 0;
};

//! What train_gpt reads of a layout type: its name, sizes, sequence parallelism and, with pipeline parallelism, its
//! schedule and chunks per stage (layout_facts<Cfg>).
struct LayoutFacts {
  std::string name;
  int tp = 1, dp = 1, pp = 1, chunks = 1;
  bool sequence_parallel = false;
  Schedule schedule = Schedule::one_f_one_b;
  int cp = 1, ep = 1;
};
template <class Cfg>
LayoutFacts layout_facts() {
  constexpr int pp = Cfg::template size<Axis::pp>;
  return {std::string(Cfg::name()),
          Cfg::template size<Axis::tp>,
          Cfg::template size<Axis::dp>,
          pp,
          pp > 1 ? pipeline::chunks_per_stage(Cfg::schedule, Cfg::virtual_stages) : 1,
          Cfg::sequence_parallel,
          Cfg::schedule,
          Cfg::template size<Axis::cp>,
          Cfg::template size<Axis::ep>};
}

//! What a rank does, given its place in the layout (train::RankInLayout) over type-erased communicators: the
//! trainer and the loop are compiled once for both backends.
template <bool Pipelined, int Zero>
using RankFn = std::function<void(const train::RankInLayout<comm::AnyComm, Pipelined, Zero>&)>;

//! A layout as train_gpt runs it: its facts, and how to start its ranks on each backend, each rank given its
//! RankInLayout. The only part of train_gpt compiled once per layout (Launch<Cfg>); the model, the trainer and the
//! loop are compiled once per model layout (models::ModelLayout), Pipelined and ZeRO stage.
template <bool Pipelined, int Zero>
struct LayoutRun {
  LayoutFacts facts;
  void (*local)(const RankFn<Pipelined, Zero>&);
  int (*mpi)(int&, char**&, const RankFn<Pipelined, Zero>&);
  int (*nccl)(int&, char**&, const RankFn<Pipelined, Zero>&) = nullptr;  //!< on CUDA: a process per GPU
};

//! --backend nccl's launch of layout Cfg (Launch<Cfg>::nccl): one process per GPU under mpirun or srun, the NCCL
//! communicators of every group built from the layout. Defined in train_gpt_cuda.cpp, where CUDA is.
template <class Cfg, bool Pipelined, int Zero>
int run_nccl_layout(int& argc, char**& argv, const RankFn<Pipelined, Zero>& f);

template <class Cfg>
struct Launch {
  static constexpr bool pipelined = Cfg::template size<Axis::pp> > 1;
  static constexpr int zero = Cfg::zero_stage;
  static void local(const RankFn<pipelined, zero>& f) {
    run_local<Cfg>([&](auto& ctx) { f(train::AnyRankInLayout(train::rank_in_layout(ctx)).get()); });
  }
  static int mpi([[maybe_unused]] int& argc, [[maybe_unused]] char**& argv,
                 [[maybe_unused]] const RankFn<pipelined, zero>& f) {
#ifdef LOOM_HAS_MPI
    return run_mpi<Cfg>(argc, argv, [&](auto& ctx) { f(train::AnyRankInLayout(train::rank_in_layout(ctx)).get()); });
#else
    throw Error("loom: --backend mpi: this build has no MPI (configure with LOOM_WITH_MPI=ON)");
#endif
  }
  static int nccl(int& argc, char**& argv, const RankFn<pipelined, zero>& f) {
    return run_nccl_layout<Cfg>(argc, argv, f);
  }
  //! How the layout runs on device Dev: on CUDA, with the Nccl backend too.
  template <class Dev>
  static LayoutRun<pipelined, zero> run() {
    if constexpr (std::is_same_v<Dev, Host>) return {layout_facts<Cfg>(), &local, &mpi};
    else return {layout_facts<Cfg>(), &local, &mpi, &nccl};
  }
};

//! The training loop every layout shares: steps from `start`, progress, --log-json, validation, samples, the summary.
//! step(i) runs optimizer step i and returns its train::StepResult; validate(), where given, the validation loss
//! (every --val-every steps and after the last); sample(), where given, a generated text (every --sample-every steps
//! and after the last; a collective, whose text rank 0 has); logged(i), where given, runs on every rank once step i's
//! line is written (the checkpoints: a run that restarts from one has logged every step before it). A skipped step
//! (every rank left the model as it was: its loss or gradient norm was not finite) is reported on stderr;
//! max_skipped_in_a_row of them in a row stop the run.
//! MFU is the model's FLOPs (flops_per_token, forward and backward) per second over peak_flops(a). Compiled once per
//! backend, whatever the layout and the model.
template <class Comm>
void train_loop(const Args& a, const models::GptShape& S, Comm& world, const LayoutFacts& layout,
                std::size_t data_tokens, int start, Held held, double flops_per_token,
                const std::function<double()>& validate, const std::function<std::string()>& sample,
                const std::function<train::StepResult(int)>& step, const std::function<void(int)>& logged) {
  const bool lead = world.rank() == 0;
  std::ofstream log;
  if (lead && !a.log_json.empty()) {
    // A resumed run adds its steps to the log (a step lost to a failure appears again, with the same values).
    log.open(a.log_json, start > 0 ? std::ios::app : std::ios::trunc);
    LOOM_CHECK(log.good(), "cannot write --log-json file ", a.log_json);
    log.precision(12);
  }
  // --log-dir: every rank's own line per step (its step time, throughput and memory; the loss is the global one).
  std::ofstream rank_log;
  if (!a.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(a.log_dir, ec);
    char name[32];
    std::snprintf(name, sizeof name, "/rank-%05d.jsonl", world.rank());
    rank_log.open(a.log_dir + name, std::ios::trunc);
    LOOM_CHECK(rank_log.good(), "rank ", world.rank(), " cannot write ", a.log_dir, name, " (--log-dir)");
    rank_log.precision(12);
  }
  const bool bar = lead && a.progress && isatty(fileno(stderr));
  if (lead) {
    std::printf("train_gpt: model %s (%lld parameters, %d layers, d=%d, heads=%d/%d), %s, %s, layout %s (%s), "
                "batch %d x %d tokens, %d micro-batches per rank, %zu data tokens\n",
                a.model.c_str(), static_cast<long long>(S.params()), S.layers, S.d_model, S.heads, S.kv_heads,
                a.dtype.c_str(), a.optimizer.c_str(), layout.name.c_str(), a.backend.c_str(), a.batch, a.seq,
                a.micro_batches, data_tokens);
    if (layout.pp > 1) {
      std::string split = "even";
      for (std::size_t i = 0; i < a.layer_split.size(); ++i)
        split = (i ? split + "," : std::string()) + std::to_string(a.layer_split[i]);
      std::printf("train_gpt: pipeline of %d stages, schedule %s, %d chunks per stage, layers split %s\n", layout.pp,
                  std::string(describe_schedule(layout.schedule)).c_str(), layout.chunks, split.c_str());
    }
  }
  std::vector<double> bytes{held.replicated, held.sharded, held.grads, held.state, held.master};
  world.all_reduce(bytes, comm::Reduce::max);
  constexpr double mib = 1 << 20;
  char master[64] = "";  // bf16 parameters: the optimizer's fp32 copy
  if (bytes[4] > 0) std::snprintf(master, sizeof master, ", fp32 master weights %.3f MiB", bytes[4] / mib);
  if (lead)
    std::printf("train_gpt: per rank: parameters %.3f MiB (%.3f replicated + %.3f sharded over tp%d), gradients "
                "%.3f MiB, optimizer state %.3f MiB%s\n",
                (bytes[0] + bytes[1]) / mib, bytes[0] / mib, bytes[1] / mib, layout.tp, bytes[2] / mib,
                bytes[3] / mib, master);
  if (lead && S.experts > 0)
    std::printf("train_gpt: mixture of %d experts, top-%d %s, in %s (expert width %d, %d shared), capacity factor "
                "%s, aux loss coefficient %s, z-loss coefficient %s, experts split over ep%d\n",
                S.experts, S.top_k, a.router.c_str(),
                S.moe_every == 1 ? "every block" : ("blocks 0, " + std::to_string(S.moe_every) + ", ...").c_str(),
                S.expert_width(), S.shared_experts,
                a.capacity_factor == 0 ? "0 (dropless)" : show(a.capacity_factor).c_str(),
                show(a.aux_loss_coeff).c_str(), show(a.z_loss_coeff).c_str(), layout.ep);
  if (lead && start > 0) std::printf("train_gpt: resuming %s at step %d\n", a.resume.c_str(), start);
  const double peak_rate = peak_flops(a);  // MFU's denominator, FLOP/s
  double first_loss = 0, loss = 0;
  int skipped = 0, in_a_row = 0;
  const auto t_start = std::chrono::steady_clock::now();
  Heartbeat::process().rank(world.rank());
  Heartbeat::process().step(start);  // started
  for (int i = start; i < a.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const train::StepResult r = step(i);
    Heartbeat::process().step(i + 1);
    loss = r.loss;
    if (r.skipped) {  // every rank agrees (StepResult), so every rank counts the same and stops at the same step
      ++skipped, ++in_a_row;
      if (lead) {
        if (bar) std::fputc('\n', stderr);
        std::fprintf(stderr, "train_gpt: warning: step %d skipped, no rank updated the model: loss %s, gradient norm "
                     "%s (%d in a row, %d stop the run)\n", i, show(r.loss).c_str(), show(r.grad_norm).c_str(),
                     in_a_row, max_skipped_in_a_row);
        std::fflush(stderr);
      }
    } else {
      in_a_row = 0;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tps = static_cast<double>(a.batch) * a.seq / secs;
    const double mfu = flops_per_token * tps / peak_rate;
    // Validation every --val-every steps and after the last step (on every rank: a collective).
    const bool validates = validate && ((a.val_every > 0 && (i + 1) % a.val_every == 0) || i + 1 == a.steps);
    const double val_loss = validates ? validate() : 0;
    const bool samples = sample && ((i + 1) % a.sample_every == 0 || i + 1 == a.steps);
    // As a JSON string (one line, whatever the text holds; bytes that are not UTF-8 shown as U+FFFD).
    const std::string text = samples ? nlohmann::json(sample()).dump(-1, ' ', false,
                                                                     nlohmann::json::error_handler_t::replace)
                                     : std::string();
    // peak_bytes: the most loaded rank's peak (its ledger), the same quantity on threads and under mpirun;
    // process_peak_bytes: the largest process's (on threads, every rank of the process together).
    std::vector<double> peak{static_cast<double>(rank_memory().peak()), static_cast<double>(host_memory().peak())};
    world.all_reduce(peak, comm::Reduce::max);
    if (i == start) first_loss = loss;
    if (lead && log.is_open()) {  // JSON has no NaN: a loss that is not finite is null
      log << "{\"step\": " << i << ", \"loss\": ";
      if (std::isfinite(loss)) log << loss;
      else log << "null";
      log << ", \"lr\": " << r.lr << ", \"grad_norm\": ";
      if (std::isfinite(r.grad_norm)) log << r.grad_norm;
      else log << "null";
      log << ", \"tokens_per_s\": " << tps << ", \"mfu\": " << mfu << ", \"peak_bytes\": "
          << static_cast<std::uint64_t>(peak[0]) << ", \"process_peak_bytes\": "
          << static_cast<std::uint64_t>(peak[1]);
      if (validates) log << ", \"val_loss\": " << val_loss;
      if (samples) log << ", \"sample\": " << text;
      if (r.moe.forwards > 0)
        log << ", \"moe_dropped\": " << r.moe.dropped_fraction() << ", \"moe_load_max_over_mean\": "
            << r.moe.mean_imbalance() << ", \"moe_aux_loss\": " << r.moe.aux_loss / r.moe.forwards;
      log << (r.skipped ? ", \"skipped\": true}\n" : "}\n");
      log.flush();
    }
    if (rank_log.is_open()) {
      rank_log << "{\"rank\": " << world.rank() << ", \"step\": " << i << ", \"loss\": ";
      if (std::isfinite(loss)) rank_log << loss;
      else rank_log << "null";
      rank_log << ", \"step_s\": " << secs << ", \"tokens_per_s\": " << tps << ", \"peak_bytes\": "
               << rank_memory().peak() << "}\n";
      rank_log.flush();
    }
    // Only now may a checkpoint that continues after step i appear: a run restarted from it logs from step i + 1.
    if (logged) logged(i);
    if (in_a_row == max_skipped_in_a_row)  // on every rank
      throw Error(loom::detail::cat("loom: stopping at step ", i, " after ", in_a_row, " skipped steps in a row (",
                                    i - in_a_row + 1, " to ", i, "): the loss is ", show(r.loss),
                                    " and the gradient norm ", show(r.grad_norm), " (try a lower --lr)"));
    if (!lead) continue;
    if (validates) {
      if (bar) std::fputc('\n', stderr);
      std::printf("val   %5d  loss %.4f  perplexity %.3f\n", i, val_loss, std::exp(val_loss));
      std::fflush(stdout);
    }
    if (samples) {
      if (bar && !validates) std::fputc('\n', stderr);
      std::printf("sample %4d  %s\n", i, text.c_str());
      std::fflush(stdout);
    }
    if (bar) {
      const int width = 30, done = a.steps ? (i + 1) * width / a.steps : width;
      std::fprintf(stderr, "\r[%.*s%*s] step %d/%d loss %.4f %.0f tok/s ", done, "##############################",
                   width - done, "", i + 1, a.steps, loss, tps);
      std::fflush(stderr);
    } else if (i % 25 == 0 || i + 1 == a.steps) {
      std::printf("step %5d  loss %.4f  lr %.2e  grad norm %.3f  %.0f tok/s  mfu %.2f%%", i, loss, r.lr,
                  r.grad_norm, tps, 100 * mfu);
      if (r.moe.forwards > 0)  // the dropped share of the assignments, the largest expert load over the mean
        std::printf("  dropped %.2f%%  load max/mean %.3f", 100 * r.moe.dropped_fraction(), r.moe.mean_imbalance());
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  // Each rank's peak by use (its ledger: rank_memory()), the largest over ranks.
  std::vector<double> by_use(memory_uses);
  for (std::size_t u = 0; u < memory_uses; ++u) by_use[u] = double(rank_memory().peak(static_cast<MemoryUse>(u)));
  world.all_reduce(by_use, comm::Reduce::max);
  // ... and what it holds between steps, after the last: the training state, the largest over ranks.
  constexpr MemoryUse state[] = {MemoryUse::parameters, MemoryUse::gradients, MemoryUse::optimizer_state,
                                 MemoryUse::master_weights};
  std::vector<double> between;
  for (MemoryUse u : state) between.push_back(double(rank_memory().in_use(u)));
  world.all_reduce(between, comm::Reduce::max);
  if (!lead) return;
  if (bar) std::fputc('\n', stderr);
  std::string uses;
  for (std::size_t u = 0; u < memory_uses; ++u)
    if (by_use[u] > 0)
      uses += loom::detail::cat(uses.empty() ? "" : ", ", name_of(static_cast<MemoryUse>(u)), " ",
                                show(std::round(by_use[u] / mib * 1000) / 1000));
  std::printf("train_gpt: peak per rank by use, MiB: %s\n", uses.c_str());
  uses.clear();
  for (std::size_t i = 0; i < between.size(); ++i)
    if (between[i] > 0)
      uses += loom::detail::cat(uses.empty() ? "" : ", ", name_of(state[i]), " ",
                                show(std::round(between[i] / mib * 1000) / 1000));
  std::printf("train_gpt: held between steps per rank, MiB: %s\n", uses.c_str());
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  const int ran = std::max(0, a.steps - start);
  if (ran > 0)
    std::printf("train_gpt: loss %.4f -> %.4f in %d steps (%d skipped), %.1f s, %.0f tokens/s, peak host memory "
                "%.1f MiB\n",
                first_loss, loss, ran, skipped, total, static_cast<double>(ran) * a.batch * a.seq / total,
                static_cast<double>(host_memory().peak()) / (1 << 20));
}

// train_gpt.cpp compiles the loop, once; the layouts' translation units call it.
extern template void train_loop<comm::AnyComm>(const Args&, const models::GptShape&, comm::AnyComm&,
                                               const LayoutFacts&, std::size_t, int, Held, double,
                                               const std::function<double()>&, const std::function<std::string()>&,
                                               const std::function<train::StepResult(int)>&,
                                               const std::function<void(int)>&);

//! Greedy samples from the whole model's parameters in host memory (Trainer::whole_params, in the single-rank
//! layout): the prompt and its continuation as text. Keeps the host model it decodes with from one sample to the
//! next. Compiled once per element type, in train_gpt.cpp, whatever the layout and the device that trains.
template <class T>
struct Sampler {
  std::string operator()(const Args& a, const models::GptShape& shape, models::GptOptions options,
                         const std::vector<T>& whole);
  std::unique_ptr<models::GptModel<T>> model;
};
extern template struct Sampler<float>;
extern template struct Sampler<double>;
extern template struct Sampler<bf16>;

//! An optimizer's bytes: its state, and the fp32 master weights it keeps for bf16 parameters.
template <class Opt>
void add_state_bytes(const Opt& opt, Held& held) {
  for (const auto& [name, t] : opt.state())
    (name.ends_with(".master") ? held.master : held.state) += static_cast<double>(t.bytes());
}

using checkpoint::hugging_face_dir;

//! What a rank does once its trainer is built, whatever the layout: weights from --init-from, the bytes it holds,
//! --resume, the training loop, --save (sharded checkpoints). Compiled once per model, optimizer and backend.
template <class Model, class Opt, class Comm>
void run_trainer(const Args& a, train::TrainerOf<Model, Opt>& trainer, Comm& world, const LayoutFacts& layout,
                 std::size_t data_tokens, const train::DataSource* val, const nlohmann::json& run) {
  if (!a.init_from.empty()) {
    if (hugging_face_dir(a.init_from))
      for (const auto& p : trainer.parts()) checkpoint::load_gpt(a.init_from, *p);
    else
      checkpoint::load_sharded(a.init_from, trainer, checkpoint::LoadWhat::parameters);
  }
  Held held;
  for (const auto& p : trainer.parts()) {
    const auto pb = p->param_bytes();
    held.replicated += double(pb.replicated), held.sharded += double(pb.sharded);
  }
  if (trainer.zero_stage() == 3) {  // the shard's, in the proportions of the whole part's
    const double f = double(rank_memory().in_use(MemoryUse::parameters)) / (held.replicated + held.sharded);
    held.replicated *= f, held.sharded *= f;
  }
  held.grads = double(rank_memory().in_use(MemoryUse::gradients));  // under ZeRO-2 and 3, the shard's
  for (const auto& o : trainer.optimizers()) add_state_bytes(o, held);
  // --auto-resume --snapshot-every: an in-memory snapshot newer than the checkpoint on disk, from every host's store.
  Args resumed = a;  // its `resume`: what the run continues from (a snapshot's directory where one is newer)
  bool from_snapshot = false;
  if (a.auto_resume && a.snapshot_every > 0) {
    const auto t0 = std::chrono::steady_clock::now();
    const checkpoint::FoundSnapshot found = checkpoint::gather_snapshot(a.snapshot_dir, world, a.disk_step);
    for (const auto& note : found.notes) std::printf("train_gpt: --auto-resume: %s\n", note.c_str());
    if (found.step >= 0) {
      resumed.resume = found.dir, from_snapshot = true;
      check_resume(resumed, run);
      if (world.rank() == 0)
        std::printf("train_gpt: --auto-resume: the in-memory snapshot of step %d (%s) is the newest state, found, "
                    "verified and put together in %.3f s\n", found.step, a.snapshot_dir.c_str(),
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::fflush(stdout);
  }
  const int start = resumed.resume.empty() ? 0 : checkpoint::load_sharded(resumed.resume, trainer);
  if (from_snapshot) {  // the directory gather_snapshot made of it (every rank has loaded: a barrier ended it)
    std::error_code ec;
    std::filesystem::remove_all(resumed.resume, ec);
  }
  // Every rank writes its own part (checkpoint::CheckpointWriter): every --save-every steps, and at the end.
  std::optional<checkpoint::CheckpointWriter> saver;
  if (!a.save.empty()) saver.emplace(a.save, checkpoint::SaveOptions{a.async_save, a.keep});
  int saved_at = -1;
  // --snapshot-every: in host memory, a copy on a peer (checkpoint::SnapshotKeeper). The snapshot a restart loaded
  // stays until a newer one is complete.
  std::optional<checkpoint::SnapshotKeeper> keeper;
  if (a.snapshot_every > 0) keeper.emplace(a.snapshot_dir, world, from_snapshot ? start : -1);
  int newest = -1;  // the newest complete state, on disk or in memory (the heartbeat's)
  auto complete = [&](int s) { Heartbeat::process().saved(newest = std::max(newest, s)); };
  if (start > 0) complete(start);
  std::function<double()> validate;
  if (val)
    validate = [&] {
      double sum = 0;
      for (int k = 0; k < a.val_batches; ++k) sum += trainer.evaluate(*val, k);
      return sum / a.val_batches;
    };
  // Samples: the whole model put together (a collective, on any device), then rank 0 decodes it on the host.
  std::function<std::string()> sample;
  Sampler<typename Model::value_type> sampler;
  if (a.sample_every > 0)
    sample = [&] {
      const auto whole = trainer.whole_params();
      if (world.rank() != 0) return std::string();
      return sampler(a, trainer.shape(), trainer.parts().front()->options(), whole);
    };
  const double flops = trainer.parts().front()->flops_per_token(a.seq);
  // A checkpoint every --save-every steps, once the step's line is in the log.
  auto save_after = [&](int i) {
    if (keeper && (i + 1) % a.snapshot_every == 0 && i + 1 < a.steps) {
      keeper->take(trainer, world, i + 1, layout.name, run);
      if (keeper->complete() >= 0) complete(keeper->complete());  // the one before, complete on every rank
    }
    if (!saver || a.save_every <= 0 || (i + 1) % a.save_every != 0) return;
    const int previous = saved_at;
    saver->save(trainer, i + 1, layout.name, run), saved_at = i + 1;
    // Written in place, this checkpoint is complete; in the background, the one before it is (put in place now).
    if (!a.async_save) complete(i + 1);
    else if (previous >= 0) complete(previous);
  };
  train_loop(resumed, trainer.shape(), world, layout, data_tokens, start, held, flops, validate, sample,
             [&](int i) { return trainer.step(i); }, save_after);
  if (!saver) return;
  const int end = std::max(a.steps, start);
  if (saved_at != end) saver->save(trainer, end, layout.name, run);
  saver->finish(trainer);
  complete(end);
  if (keeper) {  // the state is on disk: the snapshots are no longer needed
    std::vector<double> snap{keeper->blocked_seconds(), keeper->copied_seconds(), keeper->exchanged_seconds(),
                             keeper->waited_seconds()};
    world.all_reduce(snap, comm::Reduce::max);
    const int taken = keeper->taken();
    keeper->remove(world);
    if (world.rank() == 0)
      std::printf("train_gpt: %d in-memory snapshot%s (every %d steps, copies on peers %s): training waited %.3f s "
                  "in all (host copy %.3f, exchange %.3f, previous writing %.3f)\n", taken, taken == 1 ? "" : "s",
                  a.snapshot_every, keeper->peers().separate ? "in other processes or hosts" : "in this process",
                  snap[0], snap[1], snap[2], snap[3]);
  }
  std::vector<double> waited{saver->blocked_seconds(), saver->finish_seconds()};
  world.all_reduce(waited, comm::Reduce::max);
  if (world.rank() == 0)
    std::printf("train_gpt: saved %s (%d checkpoint%s, %s: training waited %.3f s in all, the end %.3f s more)\n",
                saver->last().c_str(), saver->saves(), saver->saves() == 1 ? "" : "s",
                a.async_save ? "written in the background" : "written in place", waited[0], waited[1]);
}

//! The trainer's options from the command line: what the layout type does not say.
train::TrainerOptions<models::GptOptions> trainer_options(const Args& a);

//! What every rank does: builds its trainer from its place in the layout (its part of the model: tensor
//! parallelism; with pipeline parallelism the parts of its stage) and runs it; on the host or, Dev = Cuda, on the GPU
//! (ranks that share one GPU through the Local backend). Compiled once per element type, model layout, device,
//! Pipelined and ZeRO stage: the shape is a value (models::GptModel).
template <class T, class ML, class Dev, class Comm, bool Pipelined, int Zero>
void train_rank(const Args& a, const models::GptShape& shape, const train::RankInLayout<Comm, Pipelined, Zero>& at,
                const LayoutFacts& layout, const DataSet& data, const train::DataSource* val,
                const nlohmann::json& run) {
  using Model = models::GptModel<T, ML, Dev>;
  const train::TrainerOptions<models::GptOptions> options = trainer_options(a);
  auto go = [&](auto make) {
    using Opt = decltype(make(std::vector<layers::ParamSpec>{}, 0));
    train::TrainerOf<Model, Opt> trainer(shape, at, *data.source, options, make);
    run_trainer(a, trainer, *at.world, layout, data.tokens, val, run);
  };
  // On a GPU train_gpt compiles AdamW alone, which halves the CUDA part of its build.
  if (a.optimizer == "adamw")
    go([&](const auto& specs, std::int64_t n) {
      return optim::AdamW<T, Dev>(specs, n, optim::AdamWConfig{0.9, 0.999, 1e-8, a.weight_decay});
    });
  else if constexpr (std::is_same_v<Dev, Host>)
    go([&](const auto& specs, std::int64_t n) {
      return optim::Sgd<T, Dev>(specs, n, optim::SgdConfig{0.9, a.weight_decay});
    });
  else
    throw Error("loom: --device cuda trains with --optimizer adamw");
}

//! Runs a layout with model layout ML (its tensor-parallel degree and sequence parallelism) and a model of shape S
//! (which meets the rules of ML) on the chosen backend and device.
template <class T, class ML, class Dev, bool Pipelined, int Zero>
int train(const Args& a, const models::GptShape& S, int& argc, char**& argv, const LayoutRun<Pipelined, Zero>& layout) {
  const LayoutFacts& f = layout.facts;
  LOOM_CHECK(a.seq <= S.max_seq, "--seq ", a.seq, " is longer than the model's max_seq ", S.max_seq);
  if (Pipelined) {
    const int parts = f.pp * f.chunks;
    if (a.layer_split.empty())
      LOOM_CHECK(S.layers % parts == 0, "--model ", a.model, " has ", S.layers, " layers, which do not split over ",
                 parts, " pipeline parts (pp", f.pp, " x ", f.chunks,
                 " chunks): --layer-split can split them unevenly");
    else
      train::layer_bounds(S.layers, parts, a.layer_split);
  } else {
    LOOM_CHECK(a.layer_split.empty(), "--layer-split splits the layers over pipeline stages, but the layout ",
               f.name, " has none (add ppN to --parallel)");
  }
  LOOM_CHECK(a.batch % (f.dp * a.micro_batches) == 0, "--batch ", a.batch,
             " must be a multiple of dp x micro-batches = ", f.dp, " x ", a.micro_batches);
  LOOM_CHECK(a.seq % (2 * f.cp) == 0, "--parallel ", f.name, ": context parallelism over ", f.cp,
             " ranks cuts each sequence into 2 x ", f.cp, " = ", 2 * f.cp, " chunks, but --seq ", a.seq,
             " is not a multiple of ", 2 * f.cp);
  LOOM_CHECK(!f.sequence_parallel || (a.seq / f.cp) % f.tp == 0, "--parallel ", f.name,
             ": sequence parallelism splits each sequence", f.cp > 1 ? "'s share on a cp rank" : "", " over tp = ",
             f.tp, " ranks, but its length ", a.seq / f.cp, " is not a multiple of it");
  if (a.sample_every > 0) {
    LOOM_CHECK(std::int64_t(a.prompt_ids.size()) + a.sample_tokens - 1 <= S.max_seq, "--prompt of ",
               a.prompt_ids.size(), " tokens and --sample-tokens ", a.sample_tokens, " exceed the model's ",
               S.max_seq, " positions (max_seq)");
    for (std::size_t i = 0; i < a.prompt_ids.size(); ++i)
      LOOM_CHECK(a.prompt_ids[i] < S.vocab, "--prompt: token ", a.prompt_ids[i], " at position ", i,
                 " is outside the model's vocabulary 0..", S.vocab - 1);
  }
  const DataSet data = open_data(a, S.vocab);
  const auto val = open_validation(a, S.vocab);
  // Checked here, before any rank starts: a refusal is one message and exit status 1 on every backend.
  const nlohmann::json run = run_record(a, f.name, data);
  if (!a.resume.empty()) check_resume(a, run);
  if (!a.init_from.empty() && !hugging_face_dir(a.init_from))
    checkpoint::read_index(checkpoint::resolve_checkpoint(a.init_from));  // the shape is checked as it loads
  if (a.backend == "mpi") {
    if constexpr (std::is_same_v<Dev, Host>)
      return layout.mpi(argc, argv, [&](const auto& at) { train_rank<T, ML, Dev>(a, S, at, f, data, val.get(), run); });
    throw Error("loom: --device cuda trains with --backend local (ranks share the GPU) or nccl (a process per GPU)");
  }
  if (a.backend == "nccl") {
    LOOM_CHECK(layout.nccl != nullptr, "--backend nccl needs --device cuda");
    return layout.nccl(argc, argv, [&](const auto& at) { train_rank<T, ML, Dev>(a, S, at, f, data, val.get(), run); });
  }
  layout.local([&](const auto& at) { train_rank<T, ML, Dev>(a, S, at, f, data, val.get(), run); });
  return 0;
}

//! A layout with model layout ML on device Dev, with the model and dtype that --model and --dtype name; a shape that
//! cannot be split as ML says is refused with the rule it breaks (checked at compile time; the experts' split over
//! the layout's EP when it runs). Compiled once per model
//! layout, Pipelined and ZeRO stage.
template <class ML, class Dev, bool Pipelined, int Zero>
int train_model_layout(const Args& a, int& argc, char**& argv, const LayoutRun<Pipelined, Zero>& layout) {
  const auto refuse = [&](std::string_view rule) {
    return Error(loom::detail::cat("loom: --model ", a.model, " cannot run on --parallel ", layout.facts.name, ": ",
                                   rule));
  };
  constexpr int tp = ML::template size<Axis::tp>, cp = ML::template size<Axis::cp>;
  // A shape given at run time (a Hugging Face directory's, or a vocabulary from --vocab or --tokenizer), checked here.
  auto run_shape = [&](models::GptShape S) -> int {
    if (a.vocab > 0) S.vocab = a.vocab;
    for (const auto rule : {models::shape_violation(S), models::tensor_parallel_violation(S, tp, ML::sequence_parallel),
                            models::context_parallel_violation(S, tp, cp, ML::cp_algorithm),
                            models::expert_parallel_violation(S, layout.facts.ep)})
      if (!rule.empty()) throw refuse(rule);
    if (a.dtype == "f64") return train<double, ML, Dev>(a, S, argc, argv, layout);
    if constexpr (!std::is_same_v<Dev, Host>)
      if (a.dtype == "bf16") return train<bf16, ML, Dev>(a, S, argc, argv, layout);
    return train<float, ML, Dev>(a, S, argc, argv, layout);
  };
  auto go = [&]<models::GptShape S>() -> int {
    constexpr auto rule = !models::tensor_parallel_violation(S, tp, ML::sequence_parallel).empty()
                              ? models::tensor_parallel_violation(S, tp, ML::sequence_parallel)
                              : models::context_parallel_violation(S, tp, cp, ML::cp_algorithm);
    if constexpr (rule.empty()) {
      return run_shape(S);
    } else {
      throw refuse(rule);
    }
  };
  if (a.model == "tiny") return go.template operator()<models::tiny>();
  if (a.model == "small") return go.template operator()<models::small>();
  if (a.model == "gpt2") return go.template operator()<models::gpt2>();
  if (a.model == "long") return go.template operator()<models::long_context>();
  if (a.model == "tiny-moe") return go.template operator()<models::tiny_moe>();
  if (a.model == "small-moe") return go.template operator()<models::small_moe>();
  if (a.model == "llama-tiny") return go.template operator()<models::llama_tiny>();
  if (a.model == "llama-small") return go.template operator()<models::llama_small>();
  if (a.model == "llama3-1b") return go.template operator()<models::llama3_1b>();
  if (a.model == "mixtral-tiny") return go.template operator()<models::mixtral_tiny>();
  if (a.model == "mixtral-small") return go.template operator()<models::mixtral_small>();
  if (hugging_face_dir(a.model)) return run_shape(checkpoint::hf_shape(a.model));  // from its config.json
  throw Error("loom: unknown --model '" + a.model + "' (" + std::string(model_names) +
              ", or a Hugging Face directory)");
}

//! Layout Cfg on device Dev: what its type decides (Launch<Cfg>), then the model layout's program.
template <class Cfg, class Dev = Host>
int train_model(const Args& a, int& argc, char**& argv) {
  return train_model_layout<models::ModelLayout<Cfg>, Dev>(a, argc, argv, Launch<Cfg>::template run<Dev>());
}

//! Whether train_gpt compiles layout Cfg of its lists on device Dev: every one; with -DLOOM_TRAIN_GPT_ONLY="name"
//! (CMake: LOOM_TRAIN_GPT_LAYOUT=name) none on the host, where the layout the name spells is compiled alone
//! (NamedLayout: any layout, of any size), and on CUDA only the one so named; so that a build for one run does not
//! wait for the others.
template <class Dev, class Cfg>
inline constexpr bool compiled =
#ifdef LOOM_TRAIN_GPT_ONLY
    !std::is_same_v<Dev, Host> && Cfg::name() == std::string_view(LOOM_TRAIN_GPT_ONLY);
#else
    true;
#endif

//! A family of layouts compiled in one translation unit for device Dev: runs the one named `layout`, if it is
//! among them.
template <class Dev, class... Cfgs>
struct DeviceFamily {
  static std::vector<std::string> names() {
    std::vector<std::string> v;
    ((compiled<Dev, Cfgs> ? (void)v.emplace_back(Cfgs::name()) : void()), ...);
    return v;
  }
  static std::optional<int> run(const std::string& layout, const Args& a, int& argc, char**& argv) {
    std::optional<int> rc;
    (run_one<Cfgs>(layout, a, argc, argv, rc), ...);
    return rc;
  }

 private:
  template <class Cfg>
  static void run_one(const std::string& layout, const Args& a, int& argc, char**& argv, std::optional<int>& rc) {
    // Every layout train_gpt lists is the one its name spells, so that LOOM_TRAIN_GPT_LAYOUT builds it as listed.
    static_assert(LayoutOf<name_of_layout<Cfg>>::name() == Cfg::name(),
                  "loom: a train_gpt layout is not the layout its name spells (LayoutOf)");
    if constexpr (compiled<Dev, Cfg>)
      if (layout == Cfg::name() && !rc) rc = train_model<Cfg, Dev>(a, argc, argv);
  }
};
template <class... Cfgs>
using Family = DeviceFamily<Host, Cfgs...>;

//! Lists of layouts, joined into one family.
template <class... Cfgs>
struct LayoutList {};
template <class... Lists>
struct JoinLayouts;
template <class... Cfgs>
struct JoinLayouts<LayoutList<Cfgs...>> {
  using family = Family<Cfgs...>;
};
template <class... A, class... B, class... Rest>
struct JoinLayouts<LayoutList<A...>, LayoutList<B...>, Rest...> : JoinLayouts<LayoutList<A..., B...>, Rest...> {};
template <class... Lists>
using FamilyOf = typename JoinLayouts<Lists...>::family;

//! Layout L<PP<p, ...>> under every schedule train_gpt offers: 1F1B, GPipe, ZB-H1, ZB-V, and interleaved 1F1B with two
//! chunks per stage (--schedule and --parallel vN pick one: parse_parallel).
template <template <class> class L, int P>
using EverySchedule = LayoutList<L<PP<P>>, L<PP<P, GPipe>>, L<PP<P, ZeroBubbleH1>>, L<PP<P, ZeroBubbleV>>,
                                 L<PP<P, Interleaved<2>>>>;

//! The families, each compiled in its own translation unit (train_gpt_<family>.cpp) and grouped by model layout, so
//! that each model layout's model and trainers are compiled once: run_* runs the layout if it is in the family;
//! *_layouts lists the family's layouts.
std::optional<int> run_replicated(const std::string& layout, const Args& a, int& argc, char**& argv);
std::optional<int> run_tensor_parallel(const std::string& layout, const Args& a, int& argc, char**& argv);
std::optional<int> run_context_parallel(const std::string& layout, const Args& a, int& argc, char**& argv);
std::vector<std::string> replicated_layouts();
std::vector<std::string> tensor_parallel_layouts();
std::vector<std::string> context_parallel_layouts();
//! The layouts --device cuda trains (train_gpt_cuda.cpp, in a build with CUDA; empty otherwise).
std::optional<int> run_cuda(const std::string& layout, const Args& a, int& argc, char**& argv);
std::vector<std::string> cuda_layouts();
//! Every compiled layout.
std::vector<std::string> layouts();

}  // namespace train_gpt

// train_gpt: trains a GPT with a compile-time shape on a parallel layout picked by --parallel, following the
// command-line contract in DESIGN.md. Layouts: one rank and data parallelism (dp2, dp4, dp8), ranks as threads
// (--backend local) or MPI processes (mpirun -np N train_gpt --backend mpi --parallel dpN).
//
//   train_gpt [--model tiny|small|gpt2] [--steps N] [--batch B] [--micro-batches M] [--seq T] [--lr LR]
//             [--seed S] [--optimizer adamw|sgd] [--weight-decay W] [--grad-clip C] [--warmup N] [--dropout P]
//             [--dtype f64|f32] [--device cpu] [--backend local|mpi] [--parallel dpN] [--bucket-mb MB]
//             [--schedule NAME]
//             [--data FILE] [--batch-order sequential|shuffle] [--log-json FILE] [--save DIR] [--init-from DIR]
#include <loom/checkpoint/gpt.hpp>
#include <loom/checkpoint/training.hpp>
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data.hpp>
#include <loom/train/data_parallel.hpp>
#ifdef LOOM_HAS_MPI
#include <loom/comm/mpi.hpp>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include <unistd.h>

#include <thread>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>

namespace {

using namespace loom;

struct Args {
  std::string model = "tiny", optimizer = "adamw", dtype = "f32", device = "cpu", backend = "local";
  std::string parallel, schedule = "1f1b", data, batch_order = "sequential", log_json, save, init_from, resume;
  int steps = 200, batch = 16, micro_batches = 1, seq = 64, warmup = 0;
  double lr = 3e-3, weight_decay = 0.01, grad_clip = 1.0;
  float dropout = 0.0f, bucket_mb = 25.0f;
  std::uint64_t seed = 1234;
  bool progress = true;
};

const char* usage =
    "usage: train_gpt [--model tiny|small|gpt2] [--steps N] [--batch B] [--micro-batches M] [--seq T] [--lr LR]\n"
    "                 [--seed S] [--optimizer adamw|sgd] [--weight-decay W] [--grad-clip C (0: off)] [--warmup N]\n"
    "                 [--dropout P] [--dtype f64|f32] [--device cpu] [--backend local|mpi] [--parallel SPEC]\n"
    "                 [--bucket-mb MB]\n"
    "                 [--schedule gpipe|1f1b|interleaved|zb-h1|zb-v] [--data FILE]\n"
    "                 [--batch-order sequential|shuffle] [--log-json FILE] [--save DIR] [--init-from DIR]\n"
    "                 [--resume DIR]\n"
    "                 [--no-progress]\n";

template <class N>
N number(const std::string& flag, const std::string& v) {
  std::istringstream is(v);
  N x{};
  is >> x;
  if (!is || !is.eof()) throw Error("loom: " + flag + " needs a number, got '" + v + "'");
  return x;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "-h" || f == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (f == "--no-progress") {
      a.progress = false;
      continue;
    }
    if (f.rfind("--", 0) != 0) throw Error("loom: unexpected argument '" + f + "'\n" + usage);
    if (i + 1 >= argc) throw Error("loom: " + f + " needs a value");
    const std::string v = argv[++i];
    if (f == "--model") a.model = v;
    else if (f == "--steps") a.steps = number<int>(f, v);
    else if (f == "--batch") a.batch = number<int>(f, v);
    else if (f == "--micro-batches") a.micro_batches = number<int>(f, v);
    else if (f == "--seq") a.seq = number<int>(f, v);
    else if (f == "--lr") a.lr = number<double>(f, v);
    else if (f == "--seed") a.seed = number<std::uint64_t>(f, v);
    else if (f == "--optimizer") a.optimizer = v;
    else if (f == "--weight-decay") a.weight_decay = number<double>(f, v);
    else if (f == "--grad-clip") a.grad_clip = number<double>(f, v);
    else if (f == "--warmup") a.warmup = number<int>(f, v);
    else if (f == "--dropout") a.dropout = number<float>(f, v);
    else if (f == "--dtype") a.dtype = v;
    else if (f == "--device") a.device = v;
    else if (f == "--backend") a.backend = v;
    else if (f == "--parallel") a.parallel = v;
    else if (f == "--schedule") a.schedule = v;
    else if (f == "--data") a.data = v;
    else if (f == "--batch-order") a.batch_order = v;
    else if (f == "--log-json") a.log_json = v;
    else if (f == "--save") a.save = v;
    else if (f == "--init-from") a.init_from = v;
    else if (f == "--resume") a.resume = v;
    else if (f == "--bucket-mb") a.bucket_mb = number<float>(f, v);
    else throw Error("loom: unknown flag '" + f + "'\n" + usage);
  }
  LOOM_CHECK(a.steps >= 0, "--steps must not be negative, got ", a.steps);
  LOOM_CHECK(a.batch >= 1, "--batch must be at least 1, got ", a.batch);
  LOOM_CHECK(a.micro_batches >= 1 && a.batch % a.micro_batches == 0, "--micro-batches ", a.micro_batches,
             " must divide --batch ", a.batch);
  LOOM_CHECK(a.seq >= 1, "--seq must be at least 1, got ", a.seq);
  LOOM_CHECK(a.lr > 0 && std::isfinite(a.lr), "--lr must be positive, got ", a.lr);
  LOOM_CHECK(a.dropout >= 0 && a.dropout < 1, "--dropout must be in [0, 1), got ", a.dropout);
  LOOM_CHECK(a.grad_clip >= 0, "--grad-clip must not be negative, got ", a.grad_clip);
  LOOM_CHECK(a.optimizer == "adamw" || a.optimizer == "sgd", "--optimizer must be adamw or sgd, got '",
             a.optimizer, "'");
  LOOM_CHECK(a.batch_order == "sequential" || a.batch_order == "shuffle",
             "--batch-order must be sequential or shuffle, got '", a.batch_order, "'");
  LOOM_CHECK(a.backend == "local" || a.backend == "mpi", "--backend must be local or mpi (nccl needs --device cuda), got '",
             a.backend, "'");
  LOOM_CHECK(a.bucket_mb > 0, "--bucket-mb must be positive, got ", a.bucket_mb);
  LOOM_CHECK(a.device == "cpu", "--device ", a.device,
             ": training on CUDA is not built into train_gpt yet; use --device cpu");
  LOOM_CHECK(a.dtype == "f32" || a.dtype == "f64", "--dtype ", a.dtype,
             ": the CPU trains in f32 or f64 (bf16 training needs --device cuda)");
  LOOM_CHECK(a.resume.empty() || a.init_from.empty(), "--resume and --init-from exclude each other: --resume "
             "continues a run (weights, optimizer state, step), --init-from starts a new one from weights");
  for (const char* s : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"})
    if (a.schedule == s) return a;
  throw Error("loom: --schedule must be gpipe, 1f1b, interleaved, zb-h1 or zb-v, got '" + a.schedule + "'");
}

//! The data-parallel degree that --parallel asks for; the other axes are not in this build's layouts yet.
int parse_parallel(const std::string& spec) {
  std::map<std::string, int> size{{"tp", 1}, {"pp", 1}, {"dp", 1}, {"cp", 1}, {"ep", 1}};
  std::stringstream ss(spec);
  for (std::string tok; std::getline(ss, tok, ',');) {
    if (tok.empty()) continue;
    if (tok == "sp" || tok.rfind("zero", 0) == 0 || (tok[0] == 'v' && tok.size() > 1)) {
      if (tok == "sp" || tok == "zero0" || tok == "v1") continue;
      throw Error("loom: --parallel " + spec + ": '" + tok + "' is not in this build's layouts (single, dp2, dp4, dp8)");
    }
    const std::string axis = tok.substr(0, 2);
    if (size.count(axis) && tok.size() > 2) {
      size[axis] = number<int>("--parallel " + tok, tok.substr(2));
      LOOM_CHECK(size[axis] >= 1, "--parallel ", tok, ": a size must be at least 1");
      continue;
    }
    throw Error("loom: --parallel: unknown part '" + tok + "' (tpN, ppN, dpN, cpN, epN, sp, vN, zeroK)");
  }
  const int dp = size["dp"], others = size["tp"] * size["pp"] * size["cp"];
  if (others != 1 || size["ep"] != 1 || (dp != 1 && dp != 2 && dp != 4 && dp != 8))
    throw Error(loom::detail::cat("loom: --parallel ", spec, " needs ", dp * others,
                                  " ranks in a layout this build does not have (compiled layouts: single, dp2, dp4, "
                                  "dp8)"));
  return dp;
}

//! What every rank does: its slice of each global batch, gradients averaged over the data-parallel group.
template <models::GptShape S, class T, class Ctx>
void train_rank(const Args& a, Ctx& ctx, const std::vector<std::int32_t>& tokens) {
  const bool lead = ctx.rank() == 0;
  const int ranks = Ctx::world_size;
#ifdef _OPENMP
  omp_set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks));
#endif
  train::Batches batches(tokens, a.batch, a.seq,
                         a.batch_order == "shuffle" ? train::BatchOrder::shuffle : train::BatchOrder::sequential,
                         a.seed);
  models::GptOptions mo;
  mo.dropout = a.dropout;
  models::Gpt<S, T> model(a.seed, mo);
  if (!a.init_from.empty()) checkpoint::load_gpt(a.init_from, model);
  std::optional<optim::AdamW<T>> adamw;
  std::optional<optim::Sgd<T>> sgd;
  if (a.optimizer == "adamw") adamw.emplace(model.specs(), S.params(), optim::AdamWConfig{0.9, 0.999, 1e-8, a.weight_decay});
  else sgd.emplace(model.specs(), S.params(), optim::SgdConfig{0.9, a.weight_decay});
  train::StepConfig cfg;
  cfg.batch = a.batch, cfg.seq = a.seq, cfg.micro_batches = a.micro_batches, cfg.lr = a.lr, cfg.warmup = a.warmup;
  cfg.grad_clip = a.grad_clip, cfg.bucket_bytes = static_cast<std::size_t>(a.bucket_mb * (1 << 20));
  auto& dp = ctx.template comm<Axis::dp>();
  auto run = [&](auto& opt) {
    const int start = a.resume.empty() ? 0 : checkpoint::load_training(a.resume, model, opt);
    train::DataParallelTrainer trainer(model, opt, dp, batches, cfg);
    std::ofstream log;
    if (lead && !a.log_json.empty()) {
      log.open(a.log_json, std::ios::trunc);
      LOOM_CHECK(log.good(), "cannot write --log-json file ", a.log_json);
      log.precision(12);
    }
    const bool bar = lead && a.progress && isatty(fileno(stderr));
    if (lead)
      std::printf("train_gpt: model %s (%lld parameters, %d layers, d=%d, heads=%d/%d), %s, %s, layout %s (%s), "
                  "batch %d x %d tokens, %d micro-batches per rank, %zu data tokens\n",
                  a.model.c_str(), static_cast<long long>(S.params()), S.layers, S.d_model, S.heads, S.kv_heads,
                  a.dtype.c_str(), a.optimizer.c_str(), std::string(Ctx::config::name()).c_str(), a.backend.c_str(),
                  a.batch, a.seq, a.micro_batches, tokens.size());
    double first_loss = 0, loss = 0;
    int skipped = 0;
    const auto t_start = std::chrono::steady_clock::now();
    if (lead && start > 0) std::printf("train_gpt: resuming %s at step %d\n", a.resume.c_str(), start);
    for (int step = start; step < a.steps; ++step) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto r = trainer.step(step);
      loss = r.loss;
      if (!std::isfinite(loss))
        throw Error(loom::detail::cat("loom: the loss is ", loss, " at step ", step, "; lower --lr or set --grad-clip"));
      if (r.skipped) {
        ++skipped;
        if (lead) std::printf("step %5d  skipped: the gradient norm is %g\n", step, r.grad_norm);
      }
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double tps = static_cast<double>(a.batch) * a.seq / secs;
      std::vector<double> peak{static_cast<double>(host_memory().peak())};
      ctx.world().all_reduce(peak, comm::Reduce::max);
      if (step == start) first_loss = loss;
      if (!lead) continue;
      if (log.is_open()) {
        log << "{\"step\": " << step << ", \"loss\": " << loss << ", \"lr\": " << r.lr << ", \"tokens_per_s\": "
            << tps << ", \"peak_bytes\": " << static_cast<std::uint64_t>(peak[0]) << "}\n";
        log.flush();
      }
      if (bar) {
        const int width = 30, done = a.steps ? (step + 1) * width / a.steps : width;
        std::fprintf(stderr, "\r[%.*s%*s] step %d/%d loss %.4f %.0f tok/s ", done, "##############################",
                     width - done, "", step + 1, a.steps, loss, tps);
        std::fflush(stderr);
      } else if (step % 25 == 0 || step + 1 == a.steps) {
        std::printf("step %5d  loss %.4f  lr %.2e  %.0f tok/s\n", step, loss, r.lr, tps);
        std::fflush(stdout);
      }
    }
    if (!lead) return;
    if (bar) std::fputc('\n', stderr);
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    const int ran = std::max(0, a.steps - start);
    if (ran > 0)
      std::printf("train_gpt: loss %.4f -> %.4f in %d steps (%d skipped), %.1f s, %.0f tokens/s, peak host memory "
                  "%.1f MiB\n",
                  first_loss, loss, ran, skipped, total, static_cast<double>(ran) * a.batch * a.seq / total,
                  static_cast<double>(host_memory().peak()) / (1 << 20));
    if (!a.save.empty()) {
      checkpoint::save_training(a.save, model, opt, std::max(a.steps, start));
      std::printf("train_gpt: saved %s (model.safetensors, config.json, optimizer.safetensors, trainer.json)\n",
                  a.save.c_str());
    }
  };
  if (adamw) run(*adamw);
  else run(*sgd);
}

template <models::GptShape S, class T, int DP_>
int train(const Args& a, int& argc, char**& argv) {
  using Cfg = Parallel<DP<DP_>>;
  LOOM_CHECK(a.seq <= S.max_seq, "--seq ", a.seq, " is longer than the model's max_seq ", S.max_seq);
  LOOM_CHECK(a.batch % (DP_ * a.micro_batches) == 0, "--batch ", a.batch, " must be a multiple of dp x micro-batches = ",
             DP_, " x ", a.micro_batches);
  auto tokens = a.data.empty() ? train::builtin_corpus() : train::read_bytes(a.data);
  for (auto t : tokens)
    LOOM_CHECK(t < S.vocab, "the data has token ", t, " outside the model's vocabulary of ", S.vocab);
  if (a.backend == "mpi") {
#ifdef LOOM_HAS_MPI
    return run_mpi<Cfg>(argc, argv, [&](auto& ctx) { train_rank<S, T>(a, ctx, tokens); });
#else
    throw Error("loom: --backend mpi: this build has no MPI (configure with LOOM_WITH_MPI=ON)");
#endif
  }
  (void)argc, (void)argv;
  run_local<Cfg>([&](auto& ctx) { train_rank<S, T>(a, ctx, tokens); });
  return 0;
}

template <models::GptShape S, class T>
int train_layout(const Args& a, int dp, int& argc, char**& argv) {
  switch (dp) {
    case 2: return train<S, T, 2>(a, argc, argv);
    case 4: return train<S, T, 4>(a, argc, argv);
    case 8: return train<S, T, 8>(a, argc, argv);
    default: return train<S, T, 1>(a, argc, argv);
  }
}

template <models::GptShape S>
int train_dtype(const Args& a, int dp, int& argc, char**& argv) {
  if (a.dtype == "f64") return train_layout<S, double>(a, dp, argc, argv);
  return train_layout<S, float>(a, dp, argc, argv);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    const int dp = parse_parallel(a.parallel);
    if (a.model == "tiny") return train_dtype<models::tiny>(a, dp, argc, argv);
    if (a.model == "small") return train_dtype<models::small>(a, dp, argc, argv);
    if (a.model == "gpt2") return train_dtype<models::gpt2>(a, dp, argc, argv);
    throw Error("loom: unknown --model '" + a.model + "' (tiny, small, gpt2)");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

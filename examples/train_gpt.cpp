// train_gpt: trains a GPT with a compile-time shape on a parallel layout picked by --parallel, following the
// command-line contract in DESIGN.md. This build runs one-rank layouts; later layouts add to the same flags.
//
//   train_gpt [--model tiny|small|gpt2] [--steps N] [--batch B] [--micro-batches M] [--seq T] [--lr LR]
//             [--seed S] [--optimizer adamw|sgd] [--weight-decay W] [--grad-clip C] [--warmup N] [--dropout P]
//             [--dtype f64|f32] [--device cpu] [--backend local] [--parallel SPEC] [--schedule NAME]
//             [--data FILE] [--batch-order sequential|shuffle] [--log-json FILE] [--save DIR] [--init-from DIR]
#include <loom/checkpoint/gpt.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data.hpp>

#include <unistd.h>

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
  float lr = 3e-3f, weight_decay = 0.01f, grad_clip = 1.0f, dropout = 0.0f;
  std::uint64_t seed = 1234;
  bool progress = true;
};

const char* usage =
    "usage: train_gpt [--model tiny|small|gpt2] [--steps N] [--batch B] [--micro-batches M] [--seq T] [--lr LR]\n"
    "                 [--seed S] [--optimizer adamw|sgd] [--weight-decay W] [--grad-clip C (0: off)] [--warmup N]\n"
    "                 [--dropout P] [--dtype f64|f32] [--device cpu] [--backend local] [--parallel SPEC]\n"
    "                 [--schedule gpipe|1f1b|interleaved|zb-h1|zb-v] [--data FILE]\n"
    "                 [--batch-order sequential|shuffle] [--log-json FILE] [--save DIR] [--init-from DIR]\n"
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
    else if (f == "--lr") a.lr = number<float>(f, v);
    else if (f == "--seed") a.seed = number<std::uint64_t>(f, v);
    else if (f == "--optimizer") a.optimizer = v;
    else if (f == "--weight-decay") a.weight_decay = number<float>(f, v);
    else if (f == "--grad-clip") a.grad_clip = number<float>(f, v);
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
  LOOM_CHECK(a.backend == "local", "--backend ", a.backend, ": this build runs one-rank layouts (backend local)");
  LOOM_CHECK(a.device == "cpu", "--device ", a.device,
             ": training on CUDA is not built into train_gpt yet; use --device cpu");
  LOOM_CHECK(a.dtype == "f32" || a.dtype == "f64", "--dtype ", a.dtype,
             ": the CPU trains in f32 or f64 (bf16 training needs --device cuda)");
  LOOM_CHECK(a.resume.empty(), "--resume is not available yet; --init-from DIR loads a model's weights");
  for (const char* s : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"})
    if (a.schedule == s) return a;
  throw Error("loom: --schedule must be gpipe, 1f1b, interleaved, zb-h1 or zb-v, got '" + a.schedule + "'");
}

//! The layouts compiled into this program; --parallel picks one. Only the one-rank layout so far.
void check_parallel(const std::string& spec) {
  std::map<char, int> size{{'t', 1}, {'p', 1}, {'d', 1}, {'c', 1}, {'e', 1}};
  std::stringstream ss(spec);
  for (std::string tok; std::getline(ss, tok, ',');) {
    if (tok.empty() || tok == "sp") continue;
    auto with_number = [&](const char* prefix, char key) {
      const std::string p = prefix;
      if (tok.rfind(p, 0) != 0 || tok.size() == p.size()) return false;
      size[key] = number<int>("--parallel " + tok, tok.substr(p.size()));
      return true;
    };
    if (with_number("tp", 't') || with_number("pp", 'p') || with_number("dp", 'd') || with_number("cp", 'c') ||
        with_number("ep", 'e') || with_number("zero", 'z') || with_number("v", 'v'))
      continue;
    throw Error("loom: --parallel: unknown part '" + tok + "' (tpN, ppN, dpN, cpN, epN, sp, vN, zeroK)");
  }
  const int world = size['t'] * size['p'] * size['d'] * size['c'];
  if (world != 1)
    throw Error(loom::detail::cat("loom: --parallel ", spec, " needs ", world,
                                  " ranks; this build has the one-rank layout only (compiled layouts: single)"));
}

template <models::GptShape S, class T>
int train(const Args& a) {
  LOOM_CHECK(a.seq <= S.max_seq, "--seq ", a.seq, " is longer than the model's max_seq ", S.max_seq);
  auto tokens = a.data.empty() ? train::builtin_corpus() : train::read_bytes(a.data);
  for (auto t : tokens)
    LOOM_CHECK(t < S.vocab, "the data has token ", t, " outside the model's vocabulary of ", S.vocab);
  const std::size_t n_tokens = tokens.size();
  train::Batches batches(std::move(tokens), a.batch, a.seq,
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

  std::ofstream log;
  if (!a.log_json.empty()) {
    log.open(a.log_json, std::ios::trunc);
    LOOM_CHECK(log.good(), "cannot write --log-json file ", a.log_json);
  }
  const bool bar = a.progress && isatty(fileno(stderr));
  std::printf("train_gpt: model %s (%lld parameters, %d layers, d=%d, heads=%d/%d), %s, %s, batch %d x %d tokens, "
              "%d micro-batches, %zu data tokens\n",
              a.model.c_str(), static_cast<long long>(S.params()), S.layers, S.d_model, S.heads, S.kv_heads,
              a.dtype.c_str(), a.optimizer.c_str(), a.batch, a.seq, a.micro_batches, n_tokens);

  const int micro = a.batch / a.micro_batches;
  std::vector<std::int32_t> in(static_cast<std::size_t>(micro) * a.seq), tgt(in.size());
  double first_loss = 0, loss = 0;
  const auto t_start = std::chrono::steady_clock::now();
  for (int step = 0; step < a.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    model.zero_grad();
    loss = 0;
    for (int mb = 0; mb < a.micro_batches; ++mb) {
      batches.fill(step, mb * micro, micro, in.data(), tgt.data());
      loss += model.forward(in.data(), tgt.data(), micro, a.seq, static_cast<std::uint64_t>(step),
                            static_cast<std::int64_t>(mb) * micro) /
              a.micro_batches;
      model.backward(1.0 / a.micro_batches);
    }
    if (!std::isfinite(loss))
      throw Error(loom::detail::cat("loom: the loss is ", loss, " at step ", step,
                                    "; lower --lr or set --grad-clip"));
    const double norm = optim::clip_grad_norm(model.grads(), a.grad_clip);
    if (!std::isfinite(norm))
      throw Error(loom::detail::cat("loom: the gradient norm is ", norm, " at step ", step,
                                    "; lower --lr or set --grad-clip"));
    const double lr = optim::warmup_lr(a.lr, step, a.warmup);
    if (adamw) adamw->step(model.params(), model.grads(), lr);
    else sgd->step(model.params(), model.grads(), lr);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tps = static_cast<double>(a.batch) * a.seq / secs;
    if (step == 0) first_loss = loss;
    if (log.is_open()) {
      log << "{\"step\": " << step << ", \"loss\": " << loss << ", \"lr\": " << lr << ", \"tokens_per_s\": " << tps
          << ", \"peak_bytes\": " << host_memory().peak() << "}\n";
      log.flush();
    }
    if (bar) {
      const int width = 30, done = a.steps ? (step + 1) * width / a.steps : width;
      std::fprintf(stderr, "\r[%.*s%*s] step %d/%d loss %.4f %.0f tok/s ", done, "##############################",
                   width - done, "", step + 1, a.steps, loss, tps);
      std::fflush(stderr);
    } else if (step % 25 == 0 || step + 1 == a.steps) {
      std::printf("step %5d  loss %.4f  lr %.2e  %.0f tok/s\n", step, loss, lr, tps);
      std::fflush(stdout);
    }
  }
  if (bar) std::fputc('\n', stderr);
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  if (a.steps > 0)
    std::printf("train_gpt: loss %.4f -> %.4f in %d steps, %.1f s, %.0f tokens/s, peak host memory %.1f MiB\n",
                first_loss, loss, a.steps, total, static_cast<double>(a.steps) * a.batch * a.seq / total,
                static_cast<double>(host_memory().peak()) / (1 << 20));
  if (!a.save.empty()) {
    checkpoint::save_gpt(a.save, model);
    std::printf("train_gpt: saved %s/model.safetensors and config.json\n", a.save.c_str());
  }
  return 0;
}

template <models::GptShape S>
int train_dtype(const Args& a) {
  if (a.dtype == "f64") return train<S, double>(a);
  return train<S, float>(a);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    check_parallel(a.parallel);
    if (a.model == "tiny") return train_dtype<models::tiny>(a);
    if (a.model == "small") return train_dtype<models::small>(a);
    if (a.model == "gpt2") return train_dtype<models::gpt2>(a);
    throw Error("loom: unknown --model '" + a.model + "' (tiny, small, gpt2)");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

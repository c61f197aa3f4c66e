// train_gpt: trains a GPT-2, Llama or Mixtral model on a parallel layout picked by --parallel, with the command line
// docs/train_gpt.md gives. Layouts: one rank, data parallelism, tensor parallelism with and without sequence
// parallelism, pipeline parallelism, context parallelism, expert parallelism (mixture-of-experts models), and their
// combinations up to 8 ranks; ranks as threads (--backend local) or MPI processes (mpirun -np N train_gpt --backend
// mpi --parallel SPEC). `train_gpt --help` lists the flags.
#include "train_gpt.hpp"

#include <loom/models/gpt/generate.hpp>

#ifdef LOOM_HAS_TOKENIZER
#include <loom/data/tokenizer.hpp>
#endif

#include <charconv>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <map>
#include <sstream>

namespace train_gpt {

template void train_loop<comm::AnyComm>(const Args&, const models::GptShape&, comm::AnyComm&, const LayoutFacts&,
                                        std::size_t, int, Held, double, const std::function<double()>&,
                                        const std::function<std::string()>&,
                                        const std::function<train::StepResult(int)>&,
                                        const std::function<void(int)>&);

template <class T>
std::string Sampler<T>::operator()(const Args& a, const models::GptShape& shape, models::GptOptions options,
                                   const std::vector<T>& whole) {
  if (!model) {
    options.write_buffers = false, options.dropout = 0;
    model = std::make_unique<models::GptModel<T>>(shape, 0, options);
  }
  std::copy(whole.begin(), whole.end(), model->params().data());
  models::GptDecoder<T> decoder(*model);
  std::vector<std::int32_t> text = a.prompt_ids;  // the prompt and its continuation
  const auto more = decoder.generate(a.prompt_ids, a.sample_tokens, {}, a.sample_stops);
  text.insert(text.end(), more.begin(), more.end());
  return a.detokenize(text);
}
template struct Sampler<float>;
template struct Sampler<double>;
template struct Sampler<bf16>;

const char* usage =
    "usage: train_gpt [--model tiny|small|gpt2|long|tiny-moe|small-moe|llama-tiny|llama-small|llama3-1b|\n"
    "                          mixtral-tiny|mixtral-small|HF_DIR] [--steps N] [--batch B]\n"
    "                 [--micro-batches M] [--seq T] [--lr LR]\n"
    "                 [--seed S] [--optimizer adamw|sgd] [--weight-decay W] [--grad-clip C (0: off)] [--warmup N]\n"
    "                 [--dropout P] [--dtype f64|f32|bf16] [--device cpu|cuda] [--backend local|mpi|nccl]\n"
    "                 [--parallel SPEC (tpN,sp,cpN,ulysses,ppN,vN,dpN,zeroK,keep,shardS,epN)] [--bucket-mb MB]\n"
    "                 [--max-bytes B (per rank)] [--recompute none|selective|full]\n"
    "                 [--capacity-factor F (0: dropless)] [--aux-loss-coeff C] [--z-loss-coeff C]\n"
    "                 [--router softmax|sigmoid]\n"
    "                 [--schedule gpipe|1f1b|interleaved|zb-h1|zb-v] [--layer-split N,N,... (per pipeline part)]\n"
    "                 [--data FILE | --train-data GLOB] [--batch-order sequential|shuffle] [--log-json FILE]\n"
    "                 [--log-dir DIR (a log per rank)]\n"
    "                 [--val-data GLOB] [--val-every N (0: at the end)] [--val-batches K]\n"
    "                 [--lr-schedule constant|cosine|linear|wsd] [--min-lr LR] [--decay-steps N (0: --steps)]\n"
    "                 [--wsd-decay-fraction F] [--peak-flops F (for MFU)] [--vocab N | --tokenizer FILE]\n"
    "                 [--sample-every N] [--sample-tokens K] [--prompt TEXT] [--write-corpus FILE]\n"
    "                 [--save DIR] [--save-every N] [--keep N] [--async-save]\n"
    "                 [--snapshot-every N (in host memory)] [--snapshot-dir DIR (%h: the host's name)]\n"
    "                 [--init-from DIR] [--resume DIR] [--auto-resume] [--allow-changed-run] [--no-progress]\n"
    "                 [--help]\n";

//! v, all of it, as a number of type N: a floating-point value must be finite, an unsigned one not negative.
template <class N>
N number(const std::string& flag, const std::string& v) {
  if constexpr (std::is_unsigned_v<N>)
    if (!v.empty() && v[0] == '-') throw Error("loom: " + flag + " must not be negative, got " + v);
  N x{};
  const char* end = v.data() + v.size();
  const auto [at, ec] = std::from_chars(v.data(), end, x);
  if (ec == std::errc::result_out_of_range && at == end)
    throw Error("loom: " + flag + " " + v + " is out of range");
  if (ec != std::errc{} || at != end) throw Error("loom: " + flag + " needs a number, got '" + v + "'");
  if constexpr (std::is_floating_point_v<N>)
    if (!std::isfinite(x)) throw Error("loom: " + flag + " needs a finite number, got " + v);
  return x;
}

std::string show(double x) {
  if (std::isnan(x)) return "nan";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

//! The crash tests' fault injection: with LOOM_CHECKPOINT_FAULT=POINT or POINT@STEP set, a save of that step (any
//! step) reaching POINT (checkpoint::fault_hook: write, index, rename, snapshot) kills the process with SIGKILL, as a
//! job that is killed. Under loom-run, in its first attempt only (LOOM_RUN_ATTEMPT 0): the restarts get through.
void install_fault_injection() {
  const char* env = std::getenv("LOOM_CHECKPOINT_FAULT");
  if (!env || !*env) return;
  if (const char* attempt = std::getenv("LOOM_RUN_ATTEMPT"); attempt && std::string(attempt) != "0") return;
  checkpoint::fault_hook() = [](const char* point, int step) {
    const std::string v = std::getenv("LOOM_CHECKPOINT_FAULT");
    const auto at = v.find('@');
    if (v.substr(0, at) != point) return;
    if (at != std::string::npos && v.substr(at + 1) != std::to_string(step)) return;
    std::fprintf(stderr, "loom: LOOM_CHECKPOINT_FAULT=%s: killing the process at '%s' of the save of step %d\n",
                 v.c_str(), point, step);
    std::fflush(stderr);
    std::raise(SIGKILL);
  };
}

//! Where --snapshot-every keeps its snapshots by default: in host memory (/dev/shm where there is one), a folder of
//! the user's named after --save DIR's absolute path, so that a restarted run finds it and no other run does.
std::string default_snapshot_dir(const std::string& save) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string key = fs::weakly_canonical(fs::absolute(save, ec), ec).string();
  const fs::path base = fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path(ec);
  char name[96];
  std::snprintf(name, sizeof name, "loom-snapshots-%u-%016zx", static_cast<unsigned>(::getuid()),
                std::hash<std::string>{}(key));
  return (base / name).string();
}

//! --auto-resume: the newest complete state of --save DIR's checkpoints and, with --snapshot-every, of the in-memory
//! snapshots; the run continues from it (as --resume, and --init-from no longer applies); where there is none, the
//! run starts. A checkpoint at --steps or beyond means the run is done: exit status 0 at once. The snapshots are
//! looked for once the ranks are up (checkpoint::gather_snapshot: each host may hold a part of them).
std::optional<int> auto_resume(Args& a) {
  Heartbeat::process();  // a supervisor (loom-run) hears from the process from its start
  if (!a.auto_resume) return std::nullopt;
  std::string dir;
  try {
    dir = checkpoint::resolve_checkpoint(a.save);
    a.disk_step = checkpoint::read_index(dir).next_step;
  } catch (const Error&) {
  }
  const char* snapshots = a.snapshot_every > 0 ? " unless an in-memory snapshot is newer" : "";
  if (a.disk_step < 0) {
    std::printf("train_gpt: --auto-resume: %s holds no checkpoint yet; starting at step 0%s\n", a.save.c_str(),
                snapshots);
    return std::nullopt;
  }
  // (With snapshots, the step it starts at is known once they are looked for: train_loop reports it.)
  Heartbeat::process().saved(a.disk_step);
  if (a.snapshot_every == 0) Heartbeat::process().step(a.disk_step);
  if (a.disk_step >= a.steps) {
    std::printf("train_gpt: --auto-resume: %s is at step %d of %d: the run is done\n", dir.c_str(), a.disk_step,
                a.steps);
    return 0;
  }
  std::printf("train_gpt: --auto-resume: continuing from %s at step %d%s\n", dir.c_str(), a.disk_step, snapshots);
  a.resume = a.save, a.init_from.clear();
  return std::nullopt;
}

//! --write-corpus FILE: the built-in corpus's bytes, written to a temporary name and renamed; exit status 0.
int write_corpus(const std::string& path) {
  const auto tokens = train::builtin_corpus();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    for (std::int32_t t : tokens) f.put(static_cast<char>(t));
    LOOM_CHECK(f.good(), "cannot write --write-corpus file ", tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  LOOM_CHECK(!ec, "cannot rename ", tmp, " to ", path, ": ", ec.message());
  std::printf("train_gpt: wrote the built-in corpus (%zu bytes) to %s\n", tokens.size(), path.c_str());
  return 0;
}

//! --sample-every's settings checked, and the prompt encoded: with --tokenizer (by loom::data::Tokenizer; default:
//! its document separator, which starts every document loom-tokenize writes), else as bytes (default: a newline).
void prepare_samples(Args& a) {
  LOOM_CHECK(a.sample_every >= 0, "--sample-every must not be negative (0: no samples), got ", a.sample_every);
  LOOM_CHECK(a.sample_tokens >= 1, "--sample-tokens must be at least 1, got ", a.sample_tokens);
  for (const auto& [given, flag] : {std::pair{a.sample_tokens != 32, "--sample-tokens"},
                                    std::pair{a.prompt_given, "--prompt"}})
    LOOM_CHECK(!given || a.sample_every > 0, flag, " says how to sample, but no --sample-every N is given");
  if (a.sample_every == 0) return;
  if (a.tokenizer.empty()) {
    for (unsigned char c : a.prompt_given ? a.prompt : std::string("\n")) a.prompt_ids.push_back(c);
    a.detokenize = [](const std::vector<std::int32_t>& ids) {
      std::string text;
      for (std::int32_t t : ids) text.push_back(static_cast<char>(t));
      return text;
    };
  } else {
#ifdef LOOM_HAS_TOKENIZER
    auto tok = std::make_shared<const data::Tokenizer>(a.tokenizer);
    const int separator = tok->document_separator();
    if (a.prompt_given) a.prompt_ids = tok->encode(a.prompt);
    else if (separator >= 0) a.prompt_ids = {separator};
    for (int id : {tok->end_of_text(), separator})
      if (id >= 0 && std::find(a.sample_stops.begin(), a.sample_stops.end(), id) == a.sample_stops.end())
        a.sample_stops.push_back(id);
    a.detokenize = [tok](const std::vector<std::int32_t>& ids) { return tok->decode(ids); };
#else
    throw Error("loom: --sample-every with --tokenizer " + a.tokenizer + " needs loom::tokenizer (PCRE2), which this "
                "build of train_gpt lacks");
#endif
  }
  LOOM_CHECK(!a.prompt_ids.empty(), "--prompt '", a.prompt, "' has no tokens", a.tokenizer.empty() ? "" :
             " (and the tokenizer has no document separator to start from)");
}

//! The ids a Hugging Face tokenizer.json gives: one more than the largest of its vocabulary and added tokens.
int tokenizer_size(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw Error("loom: cannot open the tokenizer " + path);
  const auto j = nlohmann::json::parse(f, nullptr, false);
  LOOM_CHECK(!j.is_discarded() && j.is_object() && j.contains("model") && j["model"].contains("vocab") &&
                 j["model"]["vocab"].is_object(),
             path, " is not a tokenizer.json with a model.vocab");
  int n = 0;
  for (const auto& [token, id] : j["model"]["vocab"].items()) n = std::max(n, id.get<int>() + 1);
  for (const auto& t : j.value("added_tokens", nlohmann::json::array())) n = std::max(n, t.value("id", 0) + 1);
  return n;
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
    if (f == "--allow-changed-run") {
      a.allow_changed_run = true;
      continue;
    }
    if (f == "--async-save") {
      a.async_save = true;
      continue;
    }
    if (f == "--auto-resume") {
      a.auto_resume = true;
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
    else if (f == "--dropout") a.dropout = number<double>(f, v);
    else if (f == "--dtype") a.dtype = v;
    else if (f == "--device") a.device = v;
    else if (f == "--backend") a.backend = v;
    else if (f == "--parallel") a.parallel = v;
    else if (f == "--schedule") a.schedule = v, a.schedule_given = true;
    else if (f == "--layer-split") {
      std::stringstream ss(v);
      for (std::string n; std::getline(ss, n, ',');) a.layer_split.push_back(number<int>(f, n));
    }
    else if (f == "--data") a.data = v;
    else if (f == "--batch-order") a.batch_order = v;
    else if (f == "--log-json") a.log_json = v;
    else if (f == "--log-dir") a.log_dir = v;
    else if (f == "--save") a.save = v;
    else if (f == "--save-every") a.save_every = number<int>(f, v);
    else if (f == "--keep") a.keep = number<int>(f, v);
    else if (f == "--snapshot-every") a.snapshot_every = number<int>(f, v);
    else if (f == "--snapshot-dir") a.snapshot_dir = v;
    else if (f == "--init-from") a.init_from = v;
    else if (f == "--resume") a.resume = v;
    else if (f == "--bucket-mb") a.bucket_mb = number<float>(f, v);
    else if (f == "--max-bytes") a.max_bytes = number<std::uint64_t>(f, v);
    else if (f == "--recompute") a.recompute = v;
    else if (f == "--capacity-factor") a.capacity_factor = number<double>(f, v);
    else if (f == "--aux-loss-coeff") a.aux_loss_coeff = number<double>(f, v);
    else if (f == "--z-loss-coeff") a.z_loss_coeff = number<double>(f, v);
    else if (f == "--router") a.router = v;
    else if (f == "--train-data") a.train_data = v;
    else if (f == "--val-data") a.val_data = v;
    else if (f == "--val-every") a.val_every = number<int>(f, v);
    else if (f == "--val-batches") a.val_batches = number<int>(f, v);
    else if (f == "--lr-schedule") a.lr_schedule = v;
    else if (f == "--min-lr") a.min_lr = number<double>(f, v);
    else if (f == "--decay-steps") a.decay_steps = number<int>(f, v);
    else if (f == "--wsd-decay-fraction") a.wsd_decay_fraction = number<double>(f, v);
    else if (f == "--peak-flops") a.peak_flops = number<double>(f, v);
    else if (f == "--vocab") a.vocab = number<int>(f, v);
    else if (f == "--tokenizer") a.tokenizer = v;
    else if (f == "--sample-every") a.sample_every = number<int>(f, v);
    else if (f == "--sample-tokens") a.sample_tokens = number<int>(f, v);
    else if (f == "--prompt") a.prompt = v, a.prompt_given = true;
    else if (f == "--write-corpus") a.write_corpus = v;
    else throw Error("loom: unknown flag '" + f + "'\n" + usage);
  }
  LOOM_CHECK(a.steps >= 0, "--steps must not be negative, got ", a.steps);
  LOOM_CHECK(a.batch >= 1, "--batch must be at least 1, got ", a.batch);
  LOOM_CHECK(a.micro_batches >= 1 && a.batch % a.micro_batches == 0, "--micro-batches ", a.micro_batches,
             " must divide --batch ", a.batch);
  LOOM_CHECK(a.seq >= 1, "--seq must be at least 1, got ", a.seq);
  LOOM_CHECK(a.lr > 0, "--lr must be positive, got ", show(a.lr));
  LOOM_CHECK(a.warmup >= 0, "--warmup must not be negative, got ", a.warmup);
  LOOM_CHECK(a.weight_decay >= 0, "--weight-decay must not be negative, got ", show(a.weight_decay));
  LOOM_CHECK(a.dropout >= 0 && a.dropout < 1, "--dropout must be in [0, 1), got ", show(a.dropout));
  LOOM_CHECK(a.grad_clip >= 0, "--grad-clip must not be negative, got ", show(a.grad_clip));
  LOOM_CHECK(a.capacity_factor >= 0, "--capacity-factor must not be negative (0: dropless), got ",
             show(a.capacity_factor));
  LOOM_CHECK(a.aux_loss_coeff >= 0, "--aux-loss-coeff must not be negative, got ", show(a.aux_loss_coeff));
  LOOM_CHECK(a.z_loss_coeff >= 0, "--z-loss-coeff must not be negative, got ", show(a.z_loss_coeff));
  LOOM_CHECK(a.router == "softmax" || a.router == "sigmoid", "--router must be softmax or sigmoid, got '", a.router,
             "'");
  LOOM_CHECK(a.optimizer == "adamw" || a.optimizer == "sgd", "--optimizer must be adamw or sgd, got '",
             a.optimizer, "'");
  LOOM_CHECK(a.batch_order == "sequential" || a.batch_order == "shuffle",
             "--batch-order must be sequential or shuffle, got '", a.batch_order, "'");
  LOOM_CHECK(a.backend == "local" || a.backend == "mpi" || a.backend == "nccl",
             "--backend must be local, mpi or nccl, got '", a.backend, "'");
  if (a.backend == "local") {
    const comm::Launch l = comm::launch();
    if (l.several())
      throw Error("loom: --backend local runs every rank as a thread of one process, but this process is one of " +
                  (l.processes > 1 ? std::to_string(l.processes) : std::string("several")) + " started together (" +
                  l.evidence +
                  "): each would run the whole job, so launch with --backend mpi");
  }
  LOOM_CHECK(a.bucket_mb > 0, "--bucket-mb must be positive, got ", show(a.bucket_mb));
  if (a.max_bytes > 0) set_memory_cap(static_cast<std::size_t>(a.max_bytes));  // else LOOM_MAX_BYTES, if set
  LOOM_CHECK(a.device == "cpu" || a.device == "cuda", "--device must be cpu or cuda, got '", a.device, "'");
  LOOM_CHECK(a.backend != "nccl" || a.device == "cuda",
             "--backend nccl runs one process per GPU: it needs --device cuda (the CPU's ranks use local or mpi)");
  if (a.device == "cpu")
    LOOM_CHECK(a.dtype == "f32" || a.dtype == "f64", "--dtype ", a.dtype,
               ": the CPU trains in f32 or f64 (bf16 training needs --device cuda)");
  else
    LOOM_CHECK(a.dtype == "f32" || a.dtype == "bf16" || a.dtype == "f64", "--dtype ", a.dtype,
               ": CUDA trains in f32, bf16 or f64");
  LOOM_CHECK(a.save_every >= 0, "--save-every must not be negative, got ", a.save_every);
  LOOM_CHECK(a.keep >= 0, "--keep must not be negative, got ", a.keep);
  LOOM_CHECK(a.snapshot_every >= 0, "--snapshot-every must not be negative, got ", a.snapshot_every);
  for (const auto& [given, flag] : {std::pair{a.save_every > 0, "--save-every"}, std::pair{a.keep > 0, "--keep"},
                                    std::pair{a.async_save, "--async-save"},
                                    std::pair{a.snapshot_every > 0, "--snapshot-every"}})
    LOOM_CHECK(!given || !a.save.empty(), flag, " says how --save saves, but no --save DIR is given");
  LOOM_CHECK(a.snapshot_dir.empty() || a.snapshot_every > 0, "--snapshot-dir ", a.snapshot_dir,
             " says where in-memory snapshots go, but no --snapshot-every N is given");
  if (a.snapshot_every > 0 && a.snapshot_dir.empty()) a.snapshot_dir = default_snapshot_dir(a.save);
  a.snapshot_dir = checkpoint::store_for_host(a.snapshot_dir);
  LOOM_CHECK(models::recompute_named(a.recompute), "--recompute must be none, selective or full, got '",
             a.recompute, "'");
  LOOM_CHECK(!a.auto_resume || !a.save.empty(), "--auto-resume continues from --save DIR's newest checkpoint, but "
             "no --save DIR is given");
  LOOM_CHECK(!a.auto_resume || a.resume.empty(), "--auto-resume and --resume ", a.resume, " both say where to "
             "continue from: give one");
  LOOM_CHECK(a.resume.empty() || a.init_from.empty(), "--resume and --init-from exclude each other: --resume "
             "continues a run (weights, optimizer state, step), --init-from starts a new one from weights");
  LOOM_CHECK(a.data.empty() || a.train_data.empty(), "--data ", a.data, " and --train-data ", a.train_data,
             " name two data sets: give one");
  LOOM_CHECK(a.val_every >= 0, "--val-every must not be negative, got ", a.val_every);
  LOOM_CHECK(a.val_batches >= 1, "--val-batches must be at least 1, got ", a.val_batches);
  for (const auto& [given, flag] : {std::pair{a.val_every > 0, "--val-every"}, std::pair{a.val_batches != 4,
                                                                                        "--val-batches"}})
    LOOM_CHECK(!given || !a.val_data.empty(), flag, " says how to validate, but no --val-data GLOB is given");
  LOOM_CHECK(a.val_data.empty() || a.dropout == 0, "--val-data: validation runs the training forward, which drops "
             "out with --dropout ", show(a.dropout), "; validate with --dropout 0");
  LOOM_CHECK(a.peak_flops >= 0, "--peak-flops must not be negative (0: the device's default), got ",
             show(a.peak_flops));
  LOOM_CHECK(optim::lr_shape_named(a.lr_schedule), "--lr-schedule must be constant, cosine, linear or wsd, got '",
             a.lr_schedule, "'");
  LOOM_CHECK(a.decay_steps >= 0, "--decay-steps must not be negative (0: --steps), got ", a.decay_steps);
  lr_schedule(a).check();
  LOOM_CHECK(a.vocab >= 0, "--vocab must not be negative (0: the model's), got ", a.vocab);
  LOOM_CHECK(a.vocab == 0 || a.tokenizer.empty(), "--vocab ", a.vocab, " and --tokenizer ", a.tokenizer,
             " both set the vocabulary: give one");
  if (!a.tokenizer.empty()) a.vocab = tokenizer_size(a.tokenizer);
  prepare_samples(a);
  // The norms' epsilon of a model read from a Hugging Face directory (--model or --init-from), else 1e-5.
  if (hugging_face_dir(a.model)) checkpoint::hf_shape(a.model, &a.norm_eps);
  else if (!a.init_from.empty() && hugging_face_dir(a.init_from)) checkpoint::hf_shape(a.init_from, &a.norm_eps);
  for (const char* s : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"})
    if (a.schedule == s) return a;
  throw Error("loom: --schedule must be gpipe, 1f1b, interleaved, zb-h1 or zb-v, got '" + a.schedule + "'");
}

//! The options of the PP policy that --schedule and --parallel vN name, as Parallel<...>::name() spells them after
//! ppN: "" (1F1B), ".gpipe", ".zb-h1", ".zb-v", or ".vN" (interleaved 1F1B, N chunks per stage). The schedule's rules
//! on chunks are checked here, with the messages of pipeline::make_schedule_checked.
std::string pipeline_options(const Args& a) {
  const Schedule s = [&] {
    for (Schedule x : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::interleaved, Schedule::zero_bubble_h1,
                       Schedule::zero_bubble_v})
      if (describe_schedule(x) == a.schedule) return x;
    throw Error("loom: --schedule must be gpipe, 1f1b, interleaved, zb-h1 or zb-v, got '" + a.schedule + "'");
  }();
  const int v = a.chunks;
  switch (s) {
    case Schedule::one_f_one_b: return v > 1 ? ".v" + std::to_string(v) : "";  // 1F1B with v > 1 is interleaved
    case Schedule::interleaved:
      LOOM_CHECK(v >= 2, "the interleaved schedule needs v >= 2 chunks per stage, got v = ", v);
      return ".v" + std::to_string(v);
    case Schedule::zero_bubble_v:
      LOOM_CHECK(v <= 2, "zb-v has two chunks per stage, got v = ", v);
      return ".zb-v";
    default:
      LOOM_CHECK(v == 1, "the ", a.schedule, " schedule takes one chunk per stage, got v = ", v,
                 " (only interleaved takes v > 1)");
      return "." + a.schedule;
  }
}

//! The layout --parallel names, as Parallel<...>::name() spells it ("tp2.sp.dp2", "pp2.zb-h1.dp2"; "single" for
//! one rank).
std::string parse_parallel(const std::string& spec, Args& a) {
  std::map<std::string, int> size{{"tp", 1}, {"cp", 1}, {"pp", 1}, {"dp", 1}, {"ep", 1}};
  std::map<std::string, std::string> given;  // each part of the spec ("tp", "sp", "v", ...) and the token that gave it
  bool sp = false;
  int zero = 0, shard = 0;
  std::stringstream ss(spec);
  auto compiled = [] {
    std::string all;
    for (const auto& n : layouts()) all += (all.empty() ? "" : ", ") + n;
    return all;
  };
  auto starts = [](const std::string& tok, const char* prefix) { return tok.rfind(prefix, 0) == 0; };
  for (std::string tok; std::getline(ss, tok, ',');) {
    if (tok.empty()) continue;
    std::string part;
    if (tok == "sp" || tok == "single" || tok == "ulysses" || tok == "keep") part = tok;
    else if (starts(tok, "zero")) part = "zero";
    else if (starts(tok, "shard")) part = "shard";
    else if (tok[0] == 'v' && tok.size() > 1) part = "v";
    else if (tok.size() > 2 && (starts(tok, "tp") || starts(tok, "pp") || starts(tok, "dp") || starts(tok, "cp") ||
                                starts(tok, "ep")))
      part = tok.substr(0, 2);
    else
      throw Error("loom: --parallel " + spec + ": unknown part '" + tok +
                  "' (tpN, sp, cpN, ulysses, ppN, vN, dpN, zeroK, keep, shardS, epN)");
    if (const auto it = given.find(part); it != given.end())
      throw Error("loom: --parallel " + spec + ": " + (part == "v" ? "vN" : part) + " is given twice (" + it->second +
                  " and " + tok + ")");
    given[part] = tok;
    if (part == "sp") sp = true;
    else if (part == "single" || part == "keep" || part == "ulysses") continue;
    else if (part == "shard") {
      shard = number<int>("--parallel " + tok, tok.substr(5));
      LOOM_CHECK(shard >= 2, "--parallel ", tok, ": hybrid sharding shards over groups of at least 2 ranks");
    }
    else if (part == "zero") {
      zero = number<int>("--parallel " + tok, tok.substr(4));
      LOOM_CHECK(0 <= zero && zero <= 3, "--parallel ", tok, ": the ZeRO stages are 0 to 3");
    } else if (part == "v") {
      a.chunks = number<int>("--parallel " + tok, tok.substr(1));
      LOOM_CHECK(a.chunks >= 1, "--parallel ", tok, ": chunks per stage must be at least 1");
    } else {
      const int n = number<int>("--parallel " + tok, tok.substr(2));
      LOOM_CHECK(n >= 1, "--parallel ", tok, ": a size must be at least 1");
      size[part] = n;
    }
  }
  LOOM_CHECK(!sp || size["tp"] > 1, "--parallel ", spec, ": sp (sequence parallelism) splits over the tp ranks and "
             "needs tp >= 2");
  std::string name;
  auto add = [&](const std::string& p) { name += (name.empty() ? "" : ".") + p; };
  if (size["tp"] > 1) add("tp" + std::to_string(size["tp"]));
  if (sp) add("sp");
  const bool ulysses = given.count("ulysses") > 0;
  LOOM_CHECK(!ulysses || size["cp"] > 1, "--parallel ", spec, ": ulysses picks the all-to-all algorithm of context "
             "parallelism and needs cpN with N >= 2");
  if (size["cp"] > 1) add("cp" + std::to_string(size["cp"]) + (ulysses ? ".ulysses" : ""));
  if (size["pp"] > 1) add("pp" + std::to_string(size["pp"]) + pipeline_options(a));
  LOOM_CHECK(zero == 0 || size["dp"] > 1, "--parallel ", spec, ": ", given["zero"], " shards over the data-parallel "
             "ranks and needs dpN with N >= 2");
  const bool keep = given.count("keep") > 0;
  LOOM_CHECK(!keep || zero == 3, "--parallel ", spec, ": keep keeps zero3's gathered parameters from forward to "
             "backward, and needs zero3");
  LOOM_CHECK(zero < 3 || keep || size["pp"] == 1, "--parallel ", spec, ": zero3 under pipeline parallelism needs "
             "keep (a stage runs several forwards before their backwards)");
  LOOM_CHECK(!shard || (zero > 0 && size["dp"] % shard == 0), "--parallel ", spec, ": ", given["shard"],
             " shards the ZeRO state over groups of ", shard, " data-parallel ranks: it needs zeroK and a dpN that ",
             shard, " divides");
  if (size["dp"] > 1)
    add("dp" + std::to_string(size["dp"]) + (zero ? ".zero" + std::to_string(zero) : "") + (keep ? ".keep" : "") +
        (shard ? ".shard" + std::to_string(shard) : ""));
  LOOM_CHECK(size["ep"] == 1 || (size["dp"] * size["cp"]) % size["ep"] == 0, "--parallel ", spec, ": ", given["ep"],
             " splits the experts over ranks carved out of dp x cp = ", size["dp"] * size["cp"],
             ", which it must divide");
  if (size["ep"] > 1) add("ep" + std::to_string(size["ep"]));
  if (name.empty()) name = "single";
  if (size["pp"] == 1) {
    LOOM_CHECK(!given.count("v"), "--parallel ", spec, ": ", given["v"], " sets the model chunks per pipeline stage, "
               "but the layout ", name, " has none (add ppN)");
    LOOM_CHECK(!a.schedule_given, "--schedule ", a.schedule, " orders the work of pipeline stages, but the layout ",
               name, " has none (add ppN to --parallel)");
  }
  const auto known = a.device == "cuda" ? cuda_layouts() : layouts();
  if (std::find(known.begin(), known.end(), name) == known.end()) {
    if (a.device == "cuda") {
      std::string all;
      for (const auto& n : known) all += (all.empty() ? "" : ", ") + n;
      throw Error(loom::detail::cat("loom: --parallel ", spec, " is not among the layouts --device cuda trains (",
                                    all.empty() ? "none: this build has no CUDA" : all, ")"));
    }
    const int ranks = size["tp"] * size["cp"] * size["pp"] * size["dp"];
    throw Error(loom::detail::cat("loom: --parallel ", spec, " needs ", ranks,
                                  " ranks in a layout this build does not have (compiled layouts: ", compiled(), ")"));
  }
  return name;
}

namespace {

//! FNV-1a (64 bits) over the tokens, each as 4 little-endian bytes, in hex.
std::string fnv1a(const std::vector<std::int32_t>& tokens) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const std::int32_t t : tokens)
    for (int b = 0; b < 4; ++b) {
      h ^= (static_cast<std::uint32_t>(t) >> (8 * b)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

//! FNV-1a (64 bits) over a file's bytes, in hex; a file that cannot be read is refused with its name.
std::string file_fnv1a(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error("loom: cannot read " + path);
  std::uint64_t h = 0xcbf29ce484222325ull;
  std::vector<char> buf(1 << 20);
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    for (std::streamsize i = 0; i < f.gcount(); ++i) {
      h ^= static_cast<unsigned char>(buf[static_cast<std::size_t>(i)]);
      h *= 0x100000001b3ull;
    }
  }
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
  return out;
}

//! The data a run record names, in words: "'my.txt' (337 tokens, FNV-1a 5d...)", or the built-in corpus.
std::string describe_data(const std::string& path, std::uint64_t tokens, const std::string& hash) {
  return (path.empty() ? std::string("built-in corpus") : "'" + path + "'") + " (" + std::to_string(tokens) +
         " tokens, FNV-1a " + hash + ")";
}

}  // namespace

train::TrainerOptions<models::GptOptions> trainer_options(const Args& a) {
  train::TrainerOptions<models::GptOptions> o;
  o.seed = a.seed;
  o.model.dropout = static_cast<float>(a.dropout);
  o.model.recompute = *models::recompute_named(a.recompute);  // checked by parse
  o.model.moe.capacity_factor = a.capacity_factor;
  o.model.moe.aux_loss_coeff = a.aux_loss_coeff;
  o.model.moe.z_loss_coeff = a.z_loss_coeff;
  o.model.moe.sigmoid = a.router == "sigmoid";
  o.model.ln_eps = a.norm_eps;
  o.split = a.layer_split;
  auto& c = o.step;
  c.batch = a.batch, c.seq = a.seq, c.micro_batches = a.micro_batches, c.lr = a.lr, c.warmup = a.warmup;
  c.schedule = lr_schedule(a);
  c.grad_clip = a.grad_clip, c.bucket_bytes = static_cast<std::size_t>(a.bucket_mb * (1 << 20));
  return o;
}

//! Where the schedule's decay ends: --decay-steps, else --steps; 0 for a constant rate, which has none.
int decay_steps(const Args& a) {
  if (a.lr_schedule == "constant") return 0;
  return a.decay_steps > 0 ? a.decay_steps : a.steps;
}

optim::LrSchedule lr_schedule(const Args& a) {
  return {*optim::lr_shape_named(a.lr_schedule), a.lr,         a.min_lr, a.warmup,
          a.decay_steps > 0 ? a.decay_steps : a.steps, a.wsd_decay_fraction};
}

double peak_flops(const Args& a) {
  if (a.peak_flops > 0) return a.peak_flops;
  if (a.device == "cuda") return 989e12;
  return 64e9 * std::max(1u, std::thread::hardware_concurrency());
}

DataSet open_data(const Args& a, int vocab) {
  const auto order = a.batch_order == "shuffle" ? train::BatchOrder::shuffle : train::BatchOrder::sequential;
  DataSet d;
  if (a.train_data.empty()) {
    auto tokens = a.data.empty() ? train::builtin_corpus() : train::read_bytes(a.data);
    for (auto t : tokens)
      LOOM_CHECK(t < vocab, "the data has token ", t, " outside the model's vocabulary of ", vocab);
    d.tokens = tokens.size();
    d.hash = fnv1a(tokens);
    d.source = std::make_unique<train::Batches>(std::move(tokens), a.batch, a.seq, order, a.seed, a.data);
    return d;
  }
  const auto paths = data::expand_glob(a.train_data);
  auto shards = std::make_unique<data::TokenShards>(paths, a.batch, a.seq, order, a.seed, vocab);
  std::string all;
  for (const auto& s : shards->shards()) {
    const std::string h = file_fnv1a(s->path());
    d.shards.push_back({{"name", std::filesystem::path(s->path()).filename().string()}, {"tokens", s->tokens()},
                        {"fnv1a", h}});
    all += h;
  }
  d.tokens = static_cast<std::uint64_t>(shards->tokens());
  d.hash = fnv1a(std::vector<std::int32_t>(all.begin(), all.end()));
  d.source = std::move(shards);
  return d;
}

std::unique_ptr<data::TokenShards> open_validation(const Args& a, int vocab) {
  if (a.val_data.empty()) return nullptr;
  return std::make_unique<data::TokenShards>(data::expand_glob(a.val_data), a.batch, a.seq,
                                             train::BatchOrder::sequential, 0, vocab);
}

nlohmann::json run_record(const Args& a, const std::string& layout, const DataSet& data) {
  nlohmann::json r = {{"model", a.model},
          {"optimizer", a.optimizer},
          {"dtype", a.dtype},
          {"seed", a.seed},
          {"batch", a.batch},
          {"seq", a.seq},
          {"lr", a.lr},
          {"warmup", a.warmup},
          {"weight_decay", a.weight_decay},
          {"grad_clip", a.grad_clip},
          {"dropout", a.dropout},
          {"batch_order", a.batch_order},
          {"data", a.train_data.empty() ? a.data : a.train_data},
          {"data_tokens", data.tokens},
          {"data_fnv1a", data.hash},
          {"lr_schedule", a.lr_schedule},
          {"min_lr", a.min_lr},
          {"decay_steps", decay_steps(a)},
          {"wsd_decay_fraction", a.wsd_decay_fraction},
          {"micro_batches", a.micro_batches},
          {"capacity_factor", a.capacity_factor},
          {"aux_loss_coeff", a.aux_loss_coeff},
          {"z_loss_coeff", a.z_loss_coeff},
          {"router", a.router},
          {"parallel", layout}};
  if (!data.shards.empty()) r["data_shards"] = data.shards;
  if (!a.tokenizer.empty())  // where loom-generate finds it
    r["tokenizer"] = std::filesystem::absolute(a.tokenizer).lexically_normal().string();
  return r;
}

void check_resume(const Args& a, const nlohmann::json& run) {
  const std::string dir = checkpoint::resolve_checkpoint(a.resume), file = dir + "/index.json";
  const checkpoint::ShardedIndex ix = checkpoint::read_index(dir);
  LOOM_CHECK(a.steps > ix.next_step, "--steps ", a.steps, " leaves nothing to train: --resume ", a.resume,
             " continues at step ", ix.next_step, " and --steps counts every step of the run (give more than ",
             ix.next_step, ")");
  if (ix.run.is_null()) {
    LOOM_CHECK(a.allow_changed_run, "--resume ", a.resume, ": ", file, " records no run settings (it was saved "
               "without them), so this run cannot be checked against it: --allow-changed-run resumes it unchecked");
    return;
  }
  const nlohmann::json j = {{"run", ix.run}};
  auto saved = [&](const char* key, auto given) {
    return checkpoint::json_value<decltype(given)>(j, file, std::string("run.") + key);
  };
  // The model and the optimizer (whose state the checkpoint holds) are the run's own: no flag changes them.
  const std::string model = saved("model", a.model), optimizer = saved("optimizer", a.optimizer);
  LOOM_CHECK(model == a.model, "--resume ", a.resume, ": --model ", a.model, " differs from the checkpoint's ", model,
             " (a checkpoint loads into the shape it was saved from)");
  LOOM_CHECK(optimizer == a.optimizer, "--resume ", a.resume, ": --optimizer ", a.optimizer,
             " differs from the checkpoint's ", optimizer, ", whose state it holds (--init-from starts a new run from "
             "its weights)");
  // The settings that make the run what it is: resuming with others is refused unless --allow-changed-run.
  std::string changed;
  auto differs = [&](const std::string& flag, const std::string& given, const std::string& was) {
    changed += (changed.empty() ? "" : ", ") + flag + " " + given + " differs from the checkpoint's " + was;
  };
  auto compare = [&](const char* key, const char* flag, auto given) {
    const auto was = saved(key, given);
    if (was == given) return;
    if constexpr (std::is_same_v<decltype(given), std::string>) differs(flag, given, was);
    else if constexpr (std::is_floating_point_v<decltype(given)>) differs(flag, show(given), show(was));
    else differs(flag, std::to_string(given), std::to_string(was));
  };
  compare("dtype", "--dtype", a.dtype);
  compare("seed", "--seed", a.seed);
  compare("batch", "--batch", a.batch);
  compare("seq", "--seq", a.seq);
  compare("lr", "--lr", a.lr);
  compare("warmup", "--warmup", a.warmup);
  compare("weight_decay", "--weight-decay", a.weight_decay);
  compare("grad_clip", "--grad-clip", a.grad_clip);
  compare("dropout", "--dropout", a.dropout);
  compare("batch_order", "--batch-order", a.batch_order);
  // A mixture of experts' routing (kept for every model; a checkpoint written before it has none to compare).
  if (ix.run.contains("capacity_factor")) {
    compare("capacity_factor", "--capacity-factor", a.capacity_factor);
    compare("aux_loss_coeff", "--aux-loss-coeff", a.aux_loss_coeff);
    compare("z_loss_coeff", "--z-loss-coeff", a.z_loss_coeff);
    compare("router", "--router", a.router);
  }
  // The schedule (a checkpoint written before schedules has none to compare: it ran a constant rate).
  if (ix.run.contains("lr_schedule")) {
    compare("lr_schedule", "--lr-schedule", a.lr_schedule);
    compare("min_lr", "--min-lr", a.min_lr);
    compare("decay_steps", "--decay-steps", decay_steps(a));
    compare("wsd_decay_fraction", "--wsd-decay-fraction", a.wsd_decay_fraction);
  }
  // Token shards, one by one: the first that differs is named.
  if (ix.run.contains("data_shards") && run.contains("data_shards")) {
    const auto& was = ix.run["data_shards"];
    const auto& now = run["data_shards"];
    for (std::size_t k = 0; k < std::max(was.size(), now.size()); ++k) {
      auto say = [](const nlohmann::json& s) {
        return "'" + s.value("name", std::string()) + "' (" + std::to_string(s.value("tokens", std::int64_t{0})) +
               " tokens, FNV-1a " + s.value("fnv1a", std::string()) + ")";
      };
      if (k < was.size() && k < now.size() && was[k] == now[k]) continue;
      LOOM_CHECK(a.allow_changed_run, "--resume ", a.resume, ": the data set changed: shard ", k, " of --train-data ",
                 a.train_data, " is ", k < now.size() ? say(now[k]) : std::string("missing"),
                 " but the checkpoint's run read ", k < was.size() ? say(was[k]) : std::string("no such shard"),
                 " (--allow-changed-run continues on the new data)");
      break;
    }
  }
  // The data by content: the same bytes under another path are the same data.
  const auto tokens = saved("data_tokens", std::uint64_t{});
  const auto hash = saved("data_fnv1a", std::string());
  if (tokens != run["data_tokens"].get<std::uint64_t>() || hash != run["data_fnv1a"].get<std::string>())
    differs("--data",
            describe_data(a.data, run["data_tokens"].get<std::uint64_t>(), run["data_fnv1a"].get<std::string>()),
            describe_data(saved("data", std::string()), tokens, hash));
  if (changed.empty()) return;
  LOOM_CHECK(a.allow_changed_run, "--resume ", a.resume, ": ", changed,
             " (--allow-changed-run continues the run with the new values)");
  if (comm::launch().rank == 0)
    std::printf("train_gpt: --allow-changed-run: --resume %s continues with other settings: %s\n", a.resume.c_str(),
                changed.c_str());
}

#ifdef LOOM_TRAIN_GPT_ONLY
//! The layout this build was configured for (LOOM_TRAIN_GPT_LAYOUT), by its name: any layout LayoutOf spells, the
//! only one this build compiles on the host.
struct NamedLayout {
  using Cfg = LayoutOf<LOOM_TRAIN_GPT_ONLY>;
  static std::vector<std::string> names() { return {std::string(Cfg::name())}; }
  static std::optional<int> run(const std::string& layout, const Args& a, int& argc, char**& argv) {
    if (layout != Cfg::name()) return std::nullopt;
    return train_model<Cfg, Host>(a, argc, argv);
  }
};
#endif

std::vector<std::string> layouts() {
  std::vector<std::string> all;
#ifdef LOOM_TRAIN_GPT_ONLY
  all = NamedLayout::names();
#endif
  for (auto* f : {&replicated_layouts, &tensor_parallel_layouts, &context_parallel_layouts})
    for (auto& n : (*f)()) all.push_back(n);
  return all;
}

#ifndef LOOM_TRAIN_GPT_CUDA
std::optional<int> run_cuda(const std::string&, const Args&, int&, char**&) {
  throw Error("loom: --device cuda: this train_gpt was built without CUDA (configure with -DLOOM_WITH_CUDA=ON)");
}
std::vector<std::string> cuda_layouts() { return {}; }
#endif

}  // namespace train_gpt

int main(int argc, char** argv) {
  using namespace train_gpt;
  try {
    install_fault_injection();
    Args a = parse(argc, argv);
    if (!a.write_corpus.empty()) return write_corpus(a.write_corpus);
    if (auto done = auto_resume(a)) return *done;
    const std::string layout = parse_parallel(a.parallel, a);
    if (a.device == "cuda") {
      if (auto rc = run_cuda(layout, a, argc, argv)) return *rc;
      throw Error("loom: no family compiled the layout " + layout + " for --device cuda");
    }
#ifdef LOOM_TRAIN_GPT_ONLY
    if (auto rc = NamedLayout::run(layout, a, argc, argv)) return *rc;
#endif
    for (auto* run : {&run_replicated, &run_tensor_parallel, &run_context_parallel})
      if (auto rc = (*run)(layout, a, argc, argv)) return *rc;
    throw Error("loom: no family compiled the layout " + layout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

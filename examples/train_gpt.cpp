// train_gpt: trains a GPT with a compile-time shape on a parallel layout picked by --parallel, following the
// command-line contract in DESIGN.md. Layouts: one rank, data parallelism, tensor parallelism with and without sequence
// parallelism, and their combinations up to 8 ranks; ranks as threads (--backend local) or MPI processes
// (mpirun -np N train_gpt --backend mpi --parallel SPEC).
//
//   train_gpt [--model tiny|small|gpt2] [--steps N] [--batch B] [--micro-batches M] [--seq T] [--lr LR]
//             [--seed S] [--optimizer adamw|sgd] [--weight-decay W] [--grad-clip C] [--warmup N] [--dropout P]
//             [--dtype f64|f32|bf16] [--device cpu|cuda] [--backend local|mpi] [--parallel dpN] [--bucket-mb MB]
//             [--schedule NAME] [--layer-split N,N,...]
//             [--data FILE] [--batch-order sequential|shuffle] [--log-json FILE] [--save DIR] [--init-from DIR]
#include "train_gpt.hpp"

#include <map>
#include <sstream>

namespace train_gpt {

const char* usage =
    "usage: train_gpt [--model tiny|small|gpt2] [--steps N] [--batch B] [--micro-batches M] [--seq T] [--lr LR]\n"
    "                 [--seed S] [--optimizer adamw|sgd] [--weight-decay W] [--grad-clip C (0: off)] [--warmup N]\n"
    "                 [--dropout P] [--dtype f64|f32|bf16] [--device cpu|cuda] [--backend local|mpi]\n"
    "                 [--parallel SPEC]\n"
    "                 [--bucket-mb MB]\n"
    "                 [--schedule gpipe|1f1b|interleaved|zb-h1|zb-v] [--layer-split N,N,... (per pipeline part)]\n"
    "                 [--data FILE]\n"
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
    else if (f == "--layer-split") {
      std::stringstream ss(v);
      for (std::string n; std::getline(ss, n, ',');) a.layer_split.push_back(number<int>(f, n));
    }
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
  LOOM_CHECK(a.device == "cpu" || a.device == "cuda", "--device must be cpu or cuda, got '", a.device, "'");
  if (a.device == "cpu")
    LOOM_CHECK(a.dtype == "f32" || a.dtype == "f64", "--dtype ", a.dtype,
               ": the CPU trains in f32 or f64 (bf16 training needs --device cuda)");
  else
    LOOM_CHECK(a.dtype == "f32" || a.dtype == "bf16" || a.dtype == "f64", "--dtype ", a.dtype,
               ": CUDA trains in f32, bf16 or f64");
  LOOM_CHECK(a.resume.empty() || a.init_from.empty(), "--resume and --init-from exclude each other: --resume "
             "continues a run (weights, optimizer state, step), --init-from starts a new one from weights");
  for (const char* s : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"})
    if (a.schedule == s) return a;
  throw Error("loom: --schedule must be gpipe, 1f1b, interleaved, zb-h1 or zb-v, got '" + a.schedule + "'");
}

//! The layout --parallel names, as Parallel<...>::name() spells it ("tp2.sp.dp2"; "single" for one rank).
std::string parse_parallel(const std::string& spec, Args& a) {
  std::map<std::string, int> size{{"tp", 1}, {"pp", 1}, {"dp", 1}, {"cp", 1}, {"ep", 1}};
  bool sp = false;
  std::stringstream ss(spec);
  auto compiled = [] {
    std::string all;
    for (const auto& n : layouts()) all += (all.empty() ? "" : ", ") + n;
    return all;
  };
  for (std::string tok; std::getline(ss, tok, ',');) {
    if (tok.empty()) continue;
    if (tok == "sp") {
      sp = true;
      continue;
    }
    if (tok == "single") continue;
    if (tok[0] == 'v' && tok.size() > 1) {
      a.chunks = number<int>("--parallel " + tok, tok.substr(1));
      LOOM_CHECK(a.chunks >= 1, "--parallel ", tok, ": chunks per stage must be at least 1");
      continue;
    }
    if (tok.rfind("zero", 0) == 0) {
      if (tok == "zero0") continue;
      throw Error("loom: --parallel " + spec + ": '" + tok + "' is not in this build's layouts (" + compiled() + ")");
    }
    const std::string axis = tok.substr(0, 2);
    if (size.count(axis) && tok.size() > 2) {
      size[axis] = number<int>("--parallel " + tok, tok.substr(2));
      LOOM_CHECK(size[axis] >= 1, "--parallel ", tok, ": a size must be at least 1");
      continue;
    }
    throw Error("loom: --parallel: unknown part '" + tok + "' (tpN, ppN, dpN, cpN, epN, sp, vN, zeroK)");
  }
  LOOM_CHECK(!sp || size["tp"] > 1, "--parallel ", spec, ": sp (sequence parallelism) splits over the tp ranks and "
             "needs tp >= 2");
  std::string name;
  auto part = [&](const std::string& p) { name += (name.empty() ? "" : ".") + p; };
  if (size["tp"] > 1) part("tp" + std::to_string(size["tp"]));
  if (sp) part("sp");
  for (const char* axis : {"cp", "pp", "dp", "ep"})
    if (size[axis] > 1) part(axis + std::to_string(size[axis]));
  if (name.empty()) name = "single";
  const auto known = a.device == "cuda" ? cuda_layouts() : layouts();
  if (std::find(known.begin(), known.end(), name) == known.end()) {
    int ranks = 1;
    for (const char* axis : {"tp", "pp", "dp", "cp"}) ranks *= size[axis];
    if (a.device == "cuda") {
      std::string all;
      for (const auto& n : known) all += (all.empty() ? "" : ", ") + n;
      throw Error(loom::detail::cat("loom: --parallel ", spec, " is not among the layouts --device cuda trains (",
                                    all.empty() ? "none: this build has no CUDA" : all, ")"));
    }
    throw Error(loom::detail::cat("loom: --parallel ", spec, " needs ", ranks, " ranks in a layout this build does "
                                  "not have (compiled layouts: ", compiled(), ")"));
  }
  return name;
}

std::vector<std::string> layouts() {
  std::vector<std::string> all;
  for (auto* f : {&data_parallel_layouts, &tensor_parallel_layouts, &sequence_parallel_layouts,
                  &pipeline_parallel_layouts})
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
    Args a = parse(argc, argv);
    const std::string layout = parse_parallel(a.parallel, a);
    if (a.device == "cuda") {
      if (auto rc = run_cuda(layout, a, argc, argv)) return *rc;
      throw Error("loom: no family compiled the layout " + layout + " for --device cuda");
    }
    for (auto* run : {&run_data_parallel, &run_tensor_parallel, &run_sequence_parallel, &run_pipeline_parallel})
      if (auto rc = (*run)(layout, a, argc, argv)) return *rc;
    throw Error("loom: no family compiled the layout " + layout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

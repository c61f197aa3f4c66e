// The data path's speeds, each beside what it is measured against in the same run:
//   shards    reading token shards (data::TokenShards, memory-mapped) into a rank's rows, in tokens/s, against the
//             tokens/s one rank's training step of `small` consumes (forward and backward, f32);
//   tokenize  loom-tokenize's MB/s on a corpus of documents against Hugging Face tokenizers' encode_batch in Python
//             (bench/hf_tokenize.py) on the same files, tokenizer and threads;
//   generate  greedy decoding with the key/value cache (models::GptDecoder), tokens/s after the first token, against
//             transformers' model of the same configuration decoding with past_key_values (bench/hf_generate.py),
//             same prompt length, tokens and threads.
// Prints a table; --json FILE writes one record per row.
//   data [--sections shards,tokenize,generate] [--models gpt2,llama-small] [--prompt 16] [--new-tokens 64]
//        [--threads 2] [--tokenizers tests/tokenizers/gpt2-512.json,...] [--corpus-mb 4] [--loom-tokenize PATH]
//        [--hf-python PATH] [--no-reference] [--json FILE]
#include <loom/core/threads.hpp>
#include <loom/data/shards.hpp>
#include <loom/models/gpt.hpp>
#include <loom/models/gpt/checkpoint.hpp>
#include <loom/models/gpt/generate.hpp>

#include "cli.hpp"
#include "gpt_step.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#ifndef LOOM_SOURCE_DIR
#define LOOM_SOURCE_DIR "."
#endif
#ifndef LOOM_TOKENIZE_EXE
#define LOOM_TOKENIZE_EXE "loom-tokenize"
#endif

namespace {

using namespace loom;
namespace fs = std::filesystem;

struct DataOptions {
  std::vector<std::string> sections{"shards", "tokenize", "generate"};
  std::vector<std::string> models{"gpt2", "llama-small"};
  std::vector<std::string> tokenizers{std::string(LOOM_SOURCE_DIR) + "/tests/tokenizers/gpt2-512.json",
                                      std::string(LOOM_SOURCE_DIR) + "/tests/tokenizers/llama3-512.json"};
  int prompt = 16, new_tokens = 64, threads = 2;
  double corpus_mb = 4;
  std::string loom_tokenize = LOOM_TOKENIZE_EXE, hf_python = "python3", json;
  bool reference = true;
};

struct Row {
  std::string section, what, backend;
  int threads;
  double value;
  std::string unit;
  std::string against;  //!< the ratio to the row it is measured against, as "12.3x transformers"
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string ratio(double a, double b, const std::string& of) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.1fx %s", a / b, of.c_str());
  return buf;
}

//! A scratch directory removed at the end.
struct Scratch {
  fs::path path;
  explicit Scratch(const std::string& name)
      : path(fs::temp_directory_path() / (name + "-" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

//! One rank reading its rows of the batches of a 32 Mi-token shard (uint16, shuffled windows), against the tokens
//! per second of a training step of `model` on one rank.
std::vector<Row> shards(const std::string& model) {
  const Scratch dir("loom-bench-shards");
  const std::int64_t n = std::int64_t{1} << 25;
  {
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) tokens[std::size_t(i)] = static_cast<std::int32_t>((i * 2654435761u) % 50257);
    data::write_shard((dir.path / "train_000000.bin").string(), tokens);
  }
  const int B = 16, T = 1024;
  data::TokenShards src({(dir.path / "train_000000.bin").string()}, B, T, train::BatchOrder::shuffle, 7);
  std::vector<std::int32_t> in(std::size_t(B) * T), tg(in.size());
  src.fill(0, 0, B, in.data(), tg.data());  // the pages mapped once
  const int batches = 64;
  const auto t0 = std::chrono::steady_clock::now();
  for (int b = 0; b < batches; ++b) src.fill(b, 0, B, in.data(), tg.data());
  const double read = double(batches) * B * T / seconds_since(t0);

  const models::GptShape S = *models::shape_named(model);
  const int seq = std::min(256, S.max_seq), batch = 8;
  models::GptModel<float> m(S, 1);
  std::vector<std::int32_t> ids, targets;
  gpt_step::tokens(S.vocab, std::size_t(batch) * seq, ids, targets);
  const double step = gpt_step::median_step(3, [&] {
    m.zero_grad();
    m.forward(ids.data(), targets.data(), batch, seq);
    m.backward();
  }, [] {});
  const double consumed = batch * seq / step;
  return {{"shards", "read a rank's rows (16 x 1024, shuffled)", "loom", 1, read, "tokens/s",
           ratio(read, consumed, "a step's need")},
          {"shards", model + " forward + backward, " + std::to_string(batch) + " x " + std::to_string(seq), "loom",
           threads_in_use(), consumed, "tokens/s", ""}};
}

//! loom-tokenize and Hugging Face tokenizers on the same corpus: the repository's docs, each file a document,
//! repeated until the corpus holds corpus_mb.
std::vector<Row> tokenize(const DataOptions& o, const std::string& tokenizer) {
  const Scratch dir("loom-bench-tokenize");
  std::vector<std::string> files;
  std::size_t bytes = 0;
  std::vector<std::string> texts;
  for (const auto& e : fs::directory_iterator(fs::path(LOOM_SOURCE_DIR) / "docs"))
    if (e.path().extension() == ".md") {
      std::ifstream f(e.path(), std::ios::binary);
      texts.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
  LOOM_CHECK(!texts.empty(), "no documents under ", LOOM_SOURCE_DIR, "/docs");
  for (std::size_t k = 0; bytes < o.corpus_mb * 1e6; ++k) {
    const std::string name = (dir.path / ("doc" + std::to_string(k) + ".txt")).string();
    std::ofstream(name, std::ios::binary) << texts[k % texts.size()];
    bytes += texts[k % texts.size()].size();
    files.push_back(name);
  }
  std::ostringstream cmd;
  cmd << o.loom_tokenize << " --tokenizer " << tokenizer << " --out " << (dir.path / "out").string()
      << " --threads " << o.threads << " --no-progress";
  for (const auto& f : files) cmd << " " << f;
  FILE* p = popen((cmd.str() + " 2>&1").c_str(), "r");
  LOOM_CHECK(p, "cannot run ", o.loom_tokenize);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  LOOM_CHECK(pclose(p) == 0, "loom-tokenize failed: ", out);
  std::smatch mb;
  LOOM_CHECK(std::regex_search(out, mb, std::regex("\\(([0-9.]+) MB/s\\)")), "no MB/s in loom-tokenize's output: ",
             out);
  const double loom_rate = std::stod(mb[1]);
  const std::string name = fs::path(tokenizer).filename().string();
  std::vector<Row> rows{{"tokenize", name + ", " + std::to_string(files.size()) + " documents, " +
                                         std::to_string(bytes / 1000000) + " MB",
                         "loom-tokenize", o.threads, loom_rate, "MB/s", ""}};
  if (!o.reference) return rows;
  std::ostringstream hf;
  hf << "RAYON_NUM_THREADS=" << o.threads << " RAYON_RS_NUM_CPUS=" << o.threads << " " << o.hf_python << " "
     << LOOM_SOURCE_DIR << "/bench/hf_tokenize.py " << tokenizer;
  for (const auto& f : files) hf << " " << f;
  const auto j = bench::run_json(hf.str(), "tokenizers (run scripts/install-deps, pass --hf-python or --no-reference)");
  const double theirs = j.at("mb_per_s");
  rows.back().against = ratio(loom_rate, theirs, "tokenizers");
  rows.push_back({"tokenize", rows.back().what, "tokenizers " + j.at("version").get<std::string>(), o.threads, theirs,
                  "MB/s", ""});
  return rows;
}

//! Greedy decoding of o.new_tokens tokens after a prompt of o.prompt, loom's decoder against transformers'.
std::vector<Row> generate(const DataOptions& o, const std::string& model) {
  const models::GptShape S = *models::shape_named(model);
  models::GptModel<float> m(S, 1);
  models::GptDecoder<float> dec(m, o.prompt + o.new_tokens);
  std::vector<std::int32_t> prompt;
  for (int i = 0; i < o.prompt; ++i) prompt.push_back((i * 7919 + 13) % S.vocab);
  dec.generate(prompt, 4, {});  // warm-up
  auto t0 = std::chrono::steady_clock::now(), first = t0;
  int n = 0;
  dec.generate(prompt, o.new_tokens, {}, {}, [&](std::int32_t) {
    if (n++ == 0) first = std::chrono::steady_clock::now();
  });
  const double mine = (o.new_tokens - 1) / seconds_since(first);
  const double prefill = o.prompt / std::chrono::duration<double>(first - t0).count();
  const std::string what = model + ", prompt " + std::to_string(o.prompt) + ", " + std::to_string(o.new_tokens) +
                           " new tokens (f32)";
  std::vector<Row> rows{{"generate", what, "loom", threads_in_use(), mine, "tokens/s", ""},
                        {"generate", model + ": the prompt (prefill)", "loom", threads_in_use(), prefill, "tokens/s",
                         ""}};
  if (!o.reference) return rows;
  const std::string config = (fs::temp_directory_path() / ("loom-bench-generate-" + model + ".json")).string();
  std::ofstream(config) << checkpoint::gpt_config(S).dump();
  std::ostringstream cmd;
  cmd << "OMP_NUM_THREADS=" << o.threads << " " << o.hf_python << " " << LOOM_SOURCE_DIR << "/bench/hf_generate.py "
      << config << " " << o.prompt << " " << o.new_tokens << " " << o.threads;
  const auto j =
      bench::run_json(cmd.str(), "transformers (run scripts/install-deps, pass --hf-python or --no-reference)");
  fs::remove(config);
  const double theirs = j.at("tokens_per_s"), their_prefill = j.at("prefill_tokens_per_s");
  const std::string v = "transformers " + j.at("version").get<std::string>();
  rows[0].against = ratio(mine, theirs, "transformers");
  rows[1].against = ratio(prefill, their_prefill, "transformers");
  rows.push_back({"generate", what, v, o.threads, theirs, "tokens/s", ""});
  rows.push_back({"generate", model + ": the prompt (prefill)", v, o.threads, their_prefill, "tokens/s", ""});
  return rows;
}

std::vector<std::string> names(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(x);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  return bench::guarded([&] {
    DataOptions o;
    bench::CommandLine cl(argc, argv);
    const bool go = cl.parse(
        "usage: data [--sections shards,tokenize,generate] [--models gpt2,llama-small] [--prompt 16]\n"
        "            [--new-tokens 64] [--threads 2] [--tokenizers FILE,...] [--corpus-mb 4]\n"
        "            [--loom-tokenize PATH] [--hf-python PATH] [--no-reference] [--json FILE]\n",
        [&](const std::string& a) {
          if (a == "--sections") o.sections = names(cl.value());
          else if (a == "--models") o.models = names(cl.value());
          else if (a == "--tokenizers") o.tokenizers = names(cl.value());
          else if (a == "--prompt") o.prompt = std::stoi(cl.value());
          else if (a == "--new-tokens") o.new_tokens = std::stoi(cl.value());
          else if (a == "--threads") o.threads = std::stoi(cl.value());
          else if (a == "--corpus-mb") o.corpus_mb = std::stod(cl.value());
          else if (a == "--loom-tokenize") o.loom_tokenize = cl.value();
          else if (a == "--hf-python") o.hf_python = cl.value();
          else if (a == "--no-reference") o.reference = false;
          else if (a == "--json") o.json = cl.value();
          else throw Error("loom: unknown flag " + a);
        });
    if (!go) return 0;
    LOOM_CHECK(o.threads >= 1 && o.prompt >= 1 && o.new_tokens >= 2, "--threads, --prompt and --new-tokens ",
               "(at least 2) must be positive");
    for (const auto& m : o.models)
      LOOM_CHECK(models::shape_named(m).has_value(), "unknown model '", m, "'");
    use_threads(o.threads);
    std::vector<Row> rows;
    for (const auto& s : o.sections) {
      std::vector<Row> r;
      if (s == "shards") r = shards("small");
      else if (s == "tokenize")
        for (const auto& t : o.tokenizers) {
          auto one = tokenize(o, t);
          r.insert(r.end(), one.begin(), one.end());
        }
      else if (s == "generate")
        for (const auto& m : o.models) {
          auto one = generate(o, m);
          r.insert(r.end(), one.begin(), one.end());
        }
      else throw Error("loom: unknown section '" + s + "' (shards, tokenize, generate)");
      rows.insert(rows.end(), r.begin(), r.end());
    }
    std::printf("%-9s %-58s %-22s %7s %14s %-9s %s\n", "section", "what", "backend", "threads", "value", "unit",
                "against");
    std::vector<nlohmann::json> records;
    for (const auto& r : rows) {
      std::printf("%-9s %-58s %-22s %7d %14.1f %-9s %s\n", r.section.c_str(), r.what.c_str(), r.backend.c_str(),
                  r.threads, r.value, r.unit.c_str(), r.against.c_str());
      records.push_back({{"section", r.section}, {"what", r.what}, {"backend", r.backend}, {"threads", r.threads},
                         {"value", r.value}, {"unit", r.unit}, {"against", r.against}});
    }
    if (!o.json.empty()) bench::write_json_lines(o.json, records);
    return 0;
  });
}

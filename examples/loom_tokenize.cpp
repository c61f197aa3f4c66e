// loom-tokenize: text files into token shards (llm.c's format, data/shards.hpp) with a Hugging Face tokenizer.json.
// Each input file is one document, preceded by the tokenizer's document separator (<|endoftext|>, or
// <|begin_of_text|>); the first ceil(F x documents) documents go to OUT/val_NNNNNN.bin, the others to
// OUT/train_NNNNNN.bin, each shard at most --shard-tokens tokens. Documents are encoded on --threads threads; the
// shards hold them in the order given.
#include <loom/data/shards.hpp>
#include <loom/data/tokenizer.hpp>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <mutex>
#include <thread>
#include <vector>

namespace {

const char* usage =
    "usage: loom-tokenize --tokenizer FILE --out DIR [--val-fraction F] [--threads N] [--shard-tokens N]\n"
    "                     [--no-progress] [--help] FILES...\n";

struct Options {
  std::string tokenizer, out;
  double val_fraction = 0;
  int threads = 0;  // 0: the hardware's
  std::int64_t shard_tokens = 100'000'000;
  bool progress = true;
  std::vector<std::string> files;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--help" || f == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (f == "--no-progress") {
      o.progress = false;
      continue;
    }
    if (f.rfind("--", 0) != 0) {
      o.files.push_back(f);
      continue;
    }
    if (i + 1 >= argc) throw loom::Error("loom: " + f + " needs a value");
    const std::string v = argv[++i];
    auto number = [&](auto x) {
      try {
        std::size_t used = 0;
        const double d = std::stod(v, &used);
        if (used != v.size() || !std::isfinite(d)) throw 0;
        return static_cast<decltype(x)>(d);
      } catch (...) {
        throw loom::Error("loom: " + f + " needs a number, got '" + v + "'");
      }
    };
    if (f == "--tokenizer") o.tokenizer = v;
    else if (f == "--out") o.out = v;
    else if (f == "--val-fraction") o.val_fraction = number(0.0);
    else if (f == "--threads") o.threads = number(0);
    else if (f == "--shard-tokens") o.shard_tokens = number(std::int64_t{0});
    else throw loom::Error("loom: unknown flag '" + f + "'\n" + usage);
  }
  LOOM_CHECK(!o.tokenizer.empty() && !o.out.empty(), "--tokenizer FILE and --out DIR are needed\n", usage);
  LOOM_CHECK(!o.files.empty(), "no input files\n", usage);
  LOOM_CHECK(o.val_fraction >= 0 && o.val_fraction < 1, "--val-fraction must be in [0, 1), got ", o.val_fraction);
  LOOM_CHECK(o.threads >= 0, "--threads must not be negative, got ", o.threads);
  LOOM_CHECK(o.shard_tokens >= 1 && o.shard_tokens <= INT32_MAX, "--shard-tokens must be in 1..", INT32_MAX,
             ", got ", o.shard_tokens);
  return o;
}

//! Writes the tokens of one split as shards PREFIX_NNNNNN.bin of at most `most` tokens; returns how many.
int write_split(const std::string& dir, const std::string& prefix, const std::vector<std::int32_t>& tokens,
                std::int64_t most) {
  int n = 0;
  for (std::size_t at = 0; at < tokens.size(); at += static_cast<std::size_t>(most), ++n) {
    char name[32];
    std::snprintf(name, sizeof name, "%s_%06d.bin", prefix.c_str(), n);
    const std::size_t end = std::min(tokens.size(), at + static_cast<std::size_t>(most));
    loom::data::write_shard(dir + "/" + name,
                            std::vector<std::int32_t>(tokens.begin() + static_cast<std::ptrdiff_t>(at),
                                                      tokens.begin() + static_cast<std::ptrdiff_t>(end)));
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    const loom::data::Tokenizer tok(o.tokenizer);
    const int sep = tok.document_separator();
    LOOM_CHECK(sep >= 0, o.tokenizer, " has no document separator (<|endoftext|>, <|begin_of_text|> or another "
               "special token)");
    std::vector<std::string> texts(o.files.size());
    std::size_t bytes = 0;
    for (std::size_t i = 0; i < o.files.size(); ++i) {
      std::ifstream f(o.files[i], std::ios::binary);
      if (!f) throw loom::Error("loom: cannot read the input file " + o.files[i]);
      texts[i].assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
      bytes += texts[i].size();
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::vector<std::int32_t>> docs(texts.size());
    std::atomic<std::size_t> next{0}, done_bytes{0};
    std::exception_ptr failed;
    std::mutex m;
    const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&] {
        for (std::size_t i; (i = next++) < texts.size();) {
          try {
            docs[i] = tok.encode(texts[i]);
          } catch (...) {
            const std::lock_guard<std::mutex> lock(m);
            failed = std::current_exception();
          }
          done_bytes += texts[i].size();
        }
      });
    const bool bar = o.progress && isatty(fileno(stderr));
    while (bar && next < texts.size()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const double f = bytes ? double(done_bytes) / double(bytes) : 1.0;
      const int width = 30, fill = static_cast<int>(f * width);
      std::fprintf(stderr, "\r[%.*s%*s] %.0f%% of %.1f MB", fill, "##############################", width - fill, "",
                   100 * f, double(bytes) / 1e6);
    }
    for (auto& th : pool) th.join();
    if (bar) std::fputc('\n', stderr);
    if (failed) std::rethrow_exception(failed);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto val_docs = static_cast<std::size_t>(std::ceil(o.val_fraction * double(docs.size())));
    std::vector<std::int32_t> val, train;
    for (std::size_t i = 0; i < docs.size(); ++i) {
      auto& into = i < val_docs ? val : train;
      into.push_back(sep);
      into.insert(into.end(), docs[i].begin(), docs[i].end());
    }
    std::filesystem::create_directories(o.out);
    const int nv = val.empty() ? 0 : write_split(o.out, "val", val, o.shard_tokens);
    const int nt = train.empty() ? 0 : write_split(o.out, "train", train, o.shard_tokens);
    std::printf("loom-tokenize: %zu documents, %.1f MB into %zu tokens in %.2f s on %d threads (%.1f MB/s): %zu "
                "validation tokens in %d shard%s, %zu training tokens in %d shard%s, in %s\n",
                docs.size(), double(bytes) / 1e6, val.size() + train.size(), secs, threads,
                double(bytes) / 1e6 / std::max(secs, 1e-9), val.size(), nv, nv == 1 ? "" : "s", train.size(), nt,
                nt == 1 ? "" : "s", o.out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

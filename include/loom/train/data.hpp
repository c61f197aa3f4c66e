// Token data for training: what the trainer reads (DataSource: the rows of the global batch of a step, the same
// whatever the layout), a byte file (each byte one token of a 256-entry vocabulary) or a deterministic built-in
// corpus, and the batches drawn from it in sequential or seeded-shuffle order. Token shards are data/shards.hpp's.
#pragma once

#include <loom/core/error.hpp>
#include <loom/core/random.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace loom::train {

//! Reads a file as tokens, one per byte. A missing or unreadable file, a directory, or an empty file is an error
//! naming the path. Whether the file holds enough tokens for one sequence is Batches' check, which knows the
//! sequence length: give it the path too, and its message names the file.
inline std::vector<std::int32_t> read_bytes(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw Error("loom: the data path '" + path + "' is a directory, not a file");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error("loom: cannot open the data file '" + path + "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.empty()) throw Error("loom: the data file '" + path + "' is empty");
  std::vector<std::int32_t> tokens(bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i) tokens[i] = static_cast<unsigned char>(bytes[i]);
  return tokens;
}

//! A deterministic English-like corpus of about `bytes` bytes: sentences drawn from a small grammar by a seeded
//! counter-based generator, so every machine and every run sees the same text.
inline std::vector<std::int32_t> builtin_corpus(std::size_t bytes = 1 << 20, std::uint64_t seed = 1) {
  static const char* subjects[] = {"the weaver", "a small loom", "the old mill", "every thread", "the river",
                                   "a quiet town", "the north wind", "my grandmother", "the red cloth", "a child"};
  static const char* verbs[] = {"carries", "remembers", "follows", "pulls", "crosses", "holds", "finds", "turns",
                                "warms", "watches"};
  static const char* objects[] = {"the morning light", "a long blue line", "the sound of water", "seven colours",
                                  "the hill road", "an empty basket", "the market square", "a wooden frame",
                                  "the winter stars", "a bright pattern"};
  static const char* endings[] = {".", ".", ".", "!", "?", ", and then it rests.", " again and again.",
                                  " before the rain.", " without a word.", " all day long."};
  std::string text;
  text.reserve(bytes + 128);
  const auto k = random::key(seed, 0x636f72707573);
  for (std::uint64_t i = 0; text.size() < bytes; ++i) {
    auto pick = [&](std::uint64_t j, std::size_t n) {
      return static_cast<std::size_t>(random::uniform(k, 4 * i + j) * static_cast<double>(n));
    };
    std::string s = std::string(subjects[pick(0, 10)]) + " " + verbs[pick(1, 10)] + " " + objects[pick(2, 10)] +
                    endings[pick(3, 10)];
    s[0] = static_cast<char>(s[0] - 'a' + 'A');
    text += s;
    text += (i % 5 == 4) ? "\n" : " ";
  }
  return std::vector<std::int32_t>(text.begin(), text.end());
}

enum class BatchOrder { sequential, shuffle };

//! What the trainer reads: rows [r0, r0 + rows) of the global batch `b` (the step's, or a validation batch's), each
//! row a sequence of the source's length, as inputs and their targets (the next tokens), rows × seq each. A rank
//! asks for its rows only; the global batch depends on b alone, so every layout trains on the same data. Implement
//! it to feed the trainer from a loader of one's own.
class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual void fill(std::int64_t b, std::int64_t r0, int rows, std::int32_t* inputs, std::int32_t* targets) const = 0;
};

//! Where row r of global batch b of B windows of T tokens starts in a stream of n tokens: ((b·B + r)·T) mod
//! (n − T − 1) in sequential order, a seeded uniform position in [0, n − T − 1) in shuffle order.
inline std::int64_t window_start(std::int64_t b, std::int64_t r, int B, int T, std::int64_t n, BatchOrder order,
                                 std::uint64_t seed) {
  const std::int64_t span = n - T - 1;
  const std::int64_t i = b * B + r;
  if (order == BatchOrder::sequential) return (i * T) % span;
  return static_cast<std::int64_t>(random::uniform(random::key(seed, 0x73687566), static_cast<std::uint64_t>(i)) *
                                   static_cast<double>(span));
}

//! Rows [r0, r0 + rows) of global batch b of B windows of T tokens from a stream of n tokens (window_start), each
//! token read as token(i): inputs, and targets shifted by one (rows × T each).
template <class Token>
void fill_windows(std::int64_t b, std::int64_t r0, int rows, int B, int T, std::int64_t n, BatchOrder order,
                  std::uint64_t seed, const Token& token, std::int32_t* inputs, std::int32_t* targets) {
  for (int r = 0; r < rows; ++r) {
    const auto s = window_start(b, r0 + r, B, T, n, order, seed);
    for (int t = 0; t < T; ++t) {
      inputs[std::size_t(r) * T + t] = token(s + t);
      targets[std::size_t(r) * T + t] = token(s + t + 1);
    }
  }
}

//! Draws batches of B sequences of T tokens (inputs, and targets shifted by one). In sequential order row r of
//! batch b is the window starting at ((b*B + r)*T) mod (N - T - 1); in shuffle order at a seeded position.
class Batches final : public DataSource {
 public:
  //! tokens must hold at least T + 2: a window of T inputs and their targets spans T + 1 tokens, and starts are
  //! taken mod N - T - 1, which must be positive. `path`, the file the tokens were read from (if any), is named by
  //! the message when they are too few.
  Batches(std::vector<std::int32_t> tokens, int B, int T, BatchOrder order = BatchOrder::sequential,
          std::uint64_t seed = 0, const std::string& path = {})
      : tokens_(std::move(tokens)), B_(B), T_(T), order_(order), seed_(seed) {
    LOOM_CHECK(B >= 1 && T >= 1, "batches of ", B, " sequences of ", T, " tokens");
    const std::string data = path.empty() ? std::string("the data") : "the data file '" + path + "'";
    LOOM_CHECK(tokens_.size() >= static_cast<std::size_t>(T) + 2, data, " holds ", tokens_.size(),
               " tokens, too few for one sequence of ", T, " tokens and its targets (", T + 2, " needed)");
  }

  //! The window start of row r of batch b (window_start).
  std::int64_t start(std::int64_t b, std::int64_t r) const {
    return window_start(b, r, B_, T_, static_cast<std::int64_t>(tokens_.size()), order_, seed_);
  }

  //! Rows [r0, r0 + rows) of batch b into inputs and targets (rows*T each).
  void fill(std::int64_t b, std::int64_t r0, int rows, std::int32_t* inputs, std::int32_t* targets) const override {
    fill_windows(b, r0, rows, B_, T_, static_cast<std::int64_t>(tokens_.size()), order_, seed_,
                 [&](std::int64_t i) { return tokens_[static_cast<std::size_t>(i)]; }, inputs, targets);
  }

  std::size_t tokens() const { return tokens_.size(); }

 private:
  std::vector<std::int32_t> tokens_;
  int B_, T_;
  BatchOrder order_;
  std::uint64_t seed_;
};

}  // namespace loom::train

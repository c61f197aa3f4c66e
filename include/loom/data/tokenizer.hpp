// A Hugging Face tokenizer.json of the byte-level BPE kind (GPT-2's, Llama 3's, and any trained like them): added and
// special tokens matched first, the pre-tokenizer's pattern (GPT-2's built into ByteLevel, or a Split pattern such as
// Llama 3's) cutting the rest into pieces, each piece's UTF-8 bytes mapped to GPT-2's printable characters and merged
// by the BPE merges in rank order; decoding maps them back. The ids are those HF `tokenizers` gives (encode without
// the post-processor's special tokens). The patterns run on PCRE2 (Unicode properties, UCP), which the program links
// (pkg-config libpcre2-8; loom's CMake target loom::tokenizer).
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <loom/core/error.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace loom::data {

namespace detail {

//! The UTF-8 encoding of code point c.
inline std::string utf8(std::uint32_t c) {
  std::string s;
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xc0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3f));
  } else if (c < 0x10000) {
    s += static_cast<char>(0xe0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (c & 0x3f));
  } else {
    s += static_cast<char>(0xf0 | (c >> 18));
    s += static_cast<char>(0x80 | ((c >> 12) & 0x3f));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (c & 0x3f));
  }
  return s;
}

//! GPT-2's map of the 256 bytes to printable characters (as UTF-8): the printable Latin-1 bytes stand for
//! themselves, the others for 256, 257, ... in byte order.
inline const std::array<std::string, 256>& byte_chars() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    std::uint32_t next = 256;
    for (std::uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
      t[b] = utf8(printable ? b : next++);
    }
    return t;
  }();
  return table;
}

//! The length of the UTF-8 character that starts with byte c.
inline std::size_t utf8_length(unsigned char c) { return c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4; }

//! A compiled PCRE2 pattern, in UTF mode with Unicode properties.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& file) {
    int err = 0;
    PCRE2_SIZE at = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err,
                          &at, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw Error("loom: " + file + ": the pre-tokenizer's pattern does not compile at offset " +
                  std::to_string(at) + " (" + reinterpret_cast<const char*>(msg) + "): " + pattern);
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }
  //! The pieces of `text`: every match, and every stretch between matches (HF's Split, behaviour Isolated). Safe to
  //! call from several threads at once.
  void split(std::string_view text, std::vector<std::string_view>& out) const {
    std::size_t at = 0, gap = 0;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    bool checked = false;  // the text's UTF-8 is checked on the first match only (else every match rereads it)
    while (at < text.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), at,
                                 checked ? PCRE2_NO_UTF_CHECK : 0, md, nullptr);
      checked = true;
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        pcre2_match_data_free(md);
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        throw Error(std::string("loom: the text cannot be tokenized: ") + reinterpret_cast<const char*>(msg));
      }
      const PCRE2_SIZE* v = pcre2_get_ovector_pointer(md);
      if (v[0] > gap) out.push_back(text.substr(gap, v[0] - gap));
      if (v[1] > v[0]) {
        out.push_back(text.substr(v[0], v[1] - v[0]));
        at = gap = v[1];
      } else {  // an empty match: step over one character
        at = v[0] + utf8_length(static_cast<unsigned char>(text[v[0]]));
      }
    }
    if (gap < text.size()) out.push_back(text.substr(gap));
    pcre2_match_data_free(md);
  }

 private:
  pcre2_code* code_ = nullptr;
};

}  // namespace detail

//! GPT-2's pre-tokenizer pattern (ByteLevel with use_regex).
inline constexpr const char* gpt2_pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

//! A byte-level BPE tokenizer read from a Hugging Face tokenizer.json.
class Tokenizer {
 public:
  //! Reads `path`. What loom does not follow is refused with the file's name and the part: a model other than BPE,
  //! a normalizer, a pre-tokenizer other than ByteLevel or a Sequence of Splits and a ByteLevel, BPE options other
  //! than the defaults (dropout, a continuing-subword prefix, an end-of-word suffix, byte fallback).
  explicit Tokenizer(const std::string& path) : path_(path) {
    std::ifstream f(path);
    if (!f) throw Error("loom: cannot open the tokenizer " + path);
    const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
    if (j.is_discarded() || !j.is_object()) throw Error("loom: " + path + " is not a JSON object");
    auto refuse = [&](const std::string& what) {
      throw Error("loom: " + path + ": " + what + " is not supported (loom reads byte-level BPE tokenizers, as "
                  "GPT-2's and Llama 3's)");
    };
    const auto& m = j.value("model", nlohmann::json());
    if (!m.is_object() || m.value("type", std::string()) != "BPE")
      refuse("the model type " + (m.is_object() ? m.value("type", std::string("(none)")) : std::string("(none)")));
    for (const char* k : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(k) && !m[k].is_null()) refuse(std::string("the BPE option ") + k);
    if (m.value("byte_fallback", false)) refuse("byte_fallback");
    ignore_merges_ = m.value("ignore_merges", false);
    if (j.contains("normalizer") && !j["normalizer"].is_null()) refuse("a normalizer");
    for (const auto& [token, id] : m.at("vocab").items()) vocab_.emplace(token, id.get<int>());
    int rank = 0;
    for (const auto& merge : m.at("merges")) {
      std::string a, b;
      if (merge.is_string()) {
        const std::string s = merge.get<std::string>();
        const auto sp = s.find(' ');
        if (sp == std::string::npos) refuse("the merge '" + s + "'");
        a = s.substr(0, sp), b = s.substr(sp + 1);
      } else {
        a = merge.at(0).get<std::string>(), b = merge.at(1).get<std::string>();
      }
      ranks_.emplace(a + '\x01' + b, rank++);
    }
    read_pre_tokenizer(j.value("pre_tokenizer", nlohmann::json()), refuse);
    for (const auto& t : j.value("added_tokens", nlohmann::json::array())) {
      added_.push_back({t.at("content").get<std::string>(), t.at("id").get<int>(), t.value("special", false)});
      size_ = std::max(size_, added_.back().id + 1);
    }
    std::sort(added_.begin(), added_.end(), [](const Added& x, const Added& y) {
      return x.content.size() > y.content.size();  // the longest first where two start alike
    });
    for (const auto& [token, id] : vocab_) {
      size_ = std::max(size_, id + 1);
      if (static_cast<std::size_t>(id) >= tokens_.size()) tokens_.resize(static_cast<std::size_t>(id) + 1);
      tokens_[static_cast<std::size_t>(id)] = token;
    }
    for (const auto& a : added_) {
      if (static_cast<std::size_t>(a.id) >= tokens_.size()) tokens_.resize(static_cast<std::size_t>(a.id) + 1);
      tokens_[static_cast<std::size_t>(a.id)] = a.content;
    }
    const auto& bytes = detail::byte_chars();
    for (int b = 0; b < 256; ++b) char_byte_.emplace(bytes[std::size_t(b)], static_cast<char>(b));
  }

  //! Ids below this: the vocabulary and the added tokens.
  int size() const { return size_; }
  //! The id of an added token (such as "<|endoftext|>" or "<|begin_of_text|>"), or -1.
  int token_id(const std::string& content) const {
    for (const auto& a : added_)
      if (a.content == content) return a.id;
    const auto it = vocab_.find(content);
    return it == vocab_.end() ? -1 : it->second;
  }
  //! The token that ends a text, where generation stops: GPT-2's <|endoftext|> or Llama 3's <|end_of_text|>; -1
  //! where the tokenizer has neither.
  int end_of_text() const {
    for (const char* name : {"<|endoftext|>", "<|end_of_text|>"})
      if (int id = token_id(name); id >= 0) return id;
    return -1;
  }
  //! The special token that separates documents: GPT-2's <|endoftext|>, Llama 3's <|begin_of_text|>, or the first
  //! special token; -1 without one.
  int document_separator() const {
    for (const char* name : {"<|endoftext|>", "<|begin_of_text|>"})
      if (int id = token_id(name); id >= 0) return id;
    for (const auto& a : added_)
      if (a.special) return a.id;
    return -1;
  }

  //! The ids of `text` (UTF-8): added tokens where their text stands, the rest pre-tokenized and merged.
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> ids;
    std::size_t from = 0;
    for (std::size_t i = 0; i < text.size();) {
      const Added* hit = nullptr;
      for (const auto& a : added_)
        if (text.compare(i, a.content.size(), a.content) == 0) {
          hit = &a;
          break;
        }
      if (!hit) {
        ++i;
        continue;
      }
      encode_plain(text.substr(from, i - from), ids);
      ids.push_back(hit->id);
      i += hit->content.size();
      from = i;
    }
    encode_plain(text.substr(from), ids);
    return ids;
  }

  //! The text of `ids`: each token's bytes (an added token's text as it is). An id outside the vocabulary is refused.
  std::string decode(const std::vector<std::int32_t>& ids) const {
    std::string out;
    for (const auto id : ids) {
      if (id < 0 || static_cast<std::size_t>(id) >= tokens_.size() || tokens_[std::size_t(id)].empty())
        throw Error(loom::detail::cat("loom: token ", id, " is not in the tokenizer ", path_));
      const std::string& t = tokens_[std::size_t(id)];
      if (is_added(id)) {
        out += t;
        continue;
      }
      for (std::size_t k = 0; k < t.size();) {
        const std::size_t n = detail::utf8_length(static_cast<unsigned char>(t[k]));
        const auto it = char_byte_.find(t.substr(k, n));
        out += it == char_byte_.end() ? t.substr(k, n) : std::string(1, it->second);
        k += n;
      }
    }
    return out;
  }

 private:
  struct Added {
    std::string content;
    int id;
    bool special;
  };

  template <class Refuse>
  void read_pre_tokenizer(const nlohmann::json& p, Refuse&& refuse) {
    if (!p.is_object()) refuse("a tokenizer without a pre-tokenizer");
    const std::string type = p.value("type", std::string());
    if (type == "ByteLevel") {
      prefix_space_ = p.value("add_prefix_space", false);
      if (p.value("use_regex", true)) regex_ = std::make_unique<detail::Regex>(gpt2_pattern, path_);
      return;
    }
    if (type != "Sequence") refuse("the pre-tokenizer " + type);
    bool byte_level = false;
    for (const auto& q : p.at("pretokenizers")) {
      const std::string t = q.value("type", std::string());
      if (t == "Split" && !regex_ && q.value("behavior", std::string()) == "Isolated" && !q.value("invert", false) &&
          q.contains("pattern") && q["pattern"].contains("Regex")) {
        regex_ = std::make_unique<detail::Regex>(q["pattern"]["Regex"].get<std::string>(), path_);
      } else if (t == "ByteLevel" && !q.value("use_regex", true)) {
        prefix_space_ = q.value("add_prefix_space", false);
        byte_level = true;
      } else {
        refuse("the pre-tokenizer step " + q.dump());
      }
    }
    if (!byte_level) refuse("a pre-tokenizer without ByteLevel");
  }

  bool is_added(int id) const {
    return std::any_of(added_.begin(), added_.end(), [&](const Added& a) { return a.id == id; });
  }

  //! Text without added tokens: pre-tokenized, each piece merged.
  void encode_plain(std::string_view text, std::vector<std::int32_t>& ids) const {
    if (text.empty()) return;
    std::string with_space;
    if (prefix_space_ && text.front() != ' ') {
      with_space = " " + std::string(text);
      text = with_space;
    }
    std::vector<std::string_view> pieces;
    if (regex_) regex_->split(text, pieces);
    else pieces.push_back(text);
    const auto& bytes = detail::byte_chars();
    // The ids of the pieces seen before, per thread (text repeats its words); for this tokenizer alone.
    thread_local const Tokenizer* owner = nullptr;
    thread_local std::uint64_t generation = 0;
    thread_local std::unordered_map<std::string, std::vector<std::int32_t>> seen;
    if (owner != this || generation != generation_ || seen.size() > 100000) {
      seen.clear();
      owner = this, generation = generation_;
    }
    std::vector<std::string> word;
    for (const auto piece : pieces) {
      const std::string key(piece);
      if (const auto it = seen.find(key); it != seen.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        continue;
      }
      word.clear();
      for (const char c : piece) word.push_back(bytes[static_cast<unsigned char>(c)]);
      const std::size_t before = ids.size();
      merge(word, ids);
      seen.emplace(key, std::vector<std::int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(before), ids.end()));
    }
  }

  //! BPE: the adjacent pair of the lowest rank merged, the leftmost first, until no pair has a rank.
  void merge(std::vector<std::string>& word, std::vector<std::int32_t>& ids) const {
    if (ignore_merges_) {
      std::string whole;
      for (const auto& w : word) whole += w;
      if (const auto it = vocab_.find(whole); it != vocab_.end()) return ids.push_back(it->second);
    }
    while (word.size() > 1) {
      int best = -1;
      std::size_t at = 0;
      for (std::size_t i = 0; i + 1 < word.size(); ++i) {
        const auto it = ranks_.find(word[i] + '\x01' + word[i + 1]);
        if (it != ranks_.end() && (best < 0 || it->second < best)) best = it->second, at = i;
      }
      if (best < 0) break;
      word[at] += word[at + 1];
      word.erase(word.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    for (const auto& w : word) {
      const auto it = vocab_.find(w);
      if (it == vocab_.end()) throw Error("loom: " + path_ + " has no token for '" + w + "' (a byte-level vocabulary "
                                          "holds every byte)");
      ids.push_back(it->second);
    }
  }

  std::string path_;
  std::unordered_map<std::string, int> vocab_;
  std::unordered_map<std::string, int> ranks_;  //!< "a\x01b": the merge's rank
  std::vector<Added> added_;                    //!< longest first
  std::vector<std::string> tokens_;             //!< by id
  std::map<std::string, char> char_byte_;       //!< GPT-2's characters back to bytes
  std::unique_ptr<detail::Regex> regex_;
  bool prefix_space_ = false, ignore_merges_ = false;
  int size_ = 0;
  //! Tells this tokenizer's cached pieces from another's built at the same address.
  std::uint64_t generation_ = next_generation();
  static std::uint64_t next_generation() {
    static std::atomic<std::uint64_t> n{0};
    return ++n;
  }
};

}  // namespace loom::data

// Token shards in llm.c's format, memory-mapped: a header of 256 little-endian int32 (magic 20240520, a version, the
// token count, the rest 0), then the tokens: version 1 holds them as uint16 (vocabularies up to 65536), version 2,
// loom's extension of the format, as uint32 (Llama 3's 128256 and beyond). A data set is a list of shards read as
// one stream of tokens in the order given; the batches drawn from it (train::DataSource) depend on the step alone,
// so every layout sees the same global batch, and a rank reads only the pages its rows touch.
#pragma once

#include <loom/core/error.hpp>
#include <loom/core/random.hpp>
#include <loom/train/data.hpp>

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace loom::data {

//! The magic number of a shard's header (llm.c's).
inline constexpr std::int32_t shard_magic = 20240520;
//! Bytes of a shard's header: 256 int32.
inline constexpr std::size_t shard_header_bytes = 256 * sizeof(std::int32_t);

//! The files a pattern names, sorted: a glob (*, ?, [...]) or one path. A pattern that names no file is refused
//! with the pattern.
inline std::vector<std::string> expand_glob(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0)
    for (std::size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (out.empty()) throw Error("loom: the data pattern '" + pattern + "' names no file");
  std::sort(out.begin(), out.end());
  return out;
}

//! Writes `tokens` as a shard at `path`: version 1 (uint16) when every token is below 65536, else version 2 (uint32);
//! under a temporary name that is then renamed. A negative token or one above uint32 is refused.
inline void write_shard(const std::string& path, const std::vector<std::int32_t>& tokens) {
  LOOM_CHECK(tokens.size() <= std::size_t(INT32_MAX), "a shard holds at most ", INT32_MAX, " tokens, got ",
             tokens.size());
  std::int32_t top = 0;
  for (auto t : tokens) {
    LOOM_CHECK(t >= 0, "a token shard holds no negative token, got ", t);
    top = std::max(top, t);
  }
  const int version = top < 65536 ? 1 : 2;
  std::vector<std::int32_t> header(256, 0);
  header[0] = shard_magic, header[1] = version, header[2] = static_cast<std::int32_t>(tokens.size());
  std::string bytes(reinterpret_cast<const char*>(header.data()), shard_header_bytes);
  bytes.reserve(shard_header_bytes + tokens.size() * (version == 1 ? 2 : 4));
  for (auto t : tokens) {
    if (version == 1) {
      const auto v = static_cast<std::uint16_t>(t);
      bytes.append(reinterpret_cast<const char*>(&v), 2);
    } else {
      const auto v = static_cast<std::uint32_t>(t);
      bytes.append(reinterpret_cast<const char*>(&v), 4);
    }
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error("loom: cannot write " + tmp);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.flush();
    if (!f) throw Error("loom: writing " + tmp + " failed (disk full?)");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw Error("loom: cannot rename " + tmp + " to " + path + ": " + ec.message());
}

//! One shard, mapped read-only: its path, version and tokens.
class Shard {
 public:
  //! Maps `path` and checks its header: the magic, a version of 1 or 2, and a size that holds exactly the tokens the
  //! header counts. Each failure names the file and what is wrong.
  explicit Shard(std::string path) : path_(std::move(path)) {
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error("loom: cannot open the token shard '" + path_ + "': " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw Error("loom: the token shard '" + path_ + "' is not a regular file");
    }
    bytes_ = static_cast<std::size_t>(st.st_size);
    if (bytes_ < shard_header_bytes) {
      ::close(fd);
      throw Error(loom::detail::cat("loom: the token shard '", path_, "' holds ", bytes_, " bytes, less than its ",
                                    shard_header_bytes, "-byte header: it is truncated or not a shard"));
    }
    void* p = ::mmap(nullptr, bytes_, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw Error("loom: cannot map the token shard '" + path_ + "': " + std::strerror(errno));
    map_ = static_cast<const char*>(p);
    std::int32_t h[3];
    std::memcpy(h, map_, sizeof h);
    try {
      if (h[0] != shard_magic)
        throw Error(loom::detail::cat("loom: the token shard '", path_, "' starts with ", h[0], ", not the magic ",
                                      shard_magic, ": it is not a token shard"));
      if (h[1] != 1 && h[1] != 2)
        throw Error(loom::detail::cat("loom: the token shard '", path_, "' has version ", h[1],
                                      "; loom reads 1 (uint16 tokens) and 2 (uint32 tokens)"));
      width_ = h[1] == 1 ? 2 : 4;
      if (h[2] < 0) throw Error(loom::detail::cat("loom: the token shard '", path_, "' counts ", h[2], " tokens"));
      count_ = h[2];
      const std::size_t want = shard_header_bytes + std::size_t(count_) * width_;
      if (bytes_ != want)
        throw Error(loom::detail::cat("loom: the token shard '", path_, "' has ", bytes_, " bytes but its header "
                                      "counts ", count_, " tokens of ", width_, " bytes (", want, " bytes with the "
                                      "header): it is ", bytes_ < want ? "truncated" : "longer than its header says"));
    } catch (...) {
      ::munmap(const_cast<char*>(map_), bytes_);
      throw;
    }
  }
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;
  ~Shard() {
    if (map_) ::munmap(const_cast<char*>(map_), bytes_);
  }

  const std::string& path() const { return path_; }
  std::int64_t tokens() const { return count_; }
  int version() const { return width_ == 2 ? 1 : 2; }
  //! Token i of the shard.
  std::int64_t operator[](std::int64_t i) const {
    const char* at = map_ + shard_header_bytes + std::size_t(i) * width_;
    if (width_ == 2) {
      std::uint16_t v;
      std::memcpy(&v, at, 2);
      return v;
    }
    std::uint32_t v;
    std::memcpy(&v, at, 4);
    return v;
  }

 private:
  std::string path_;
  const char* map_ = nullptr;
  std::size_t bytes_ = 0, width_ = 2;
  std::int64_t count_ = 0;
};

//! The global batches of a list of shards, read as one stream of N tokens: row r of the batch of step b is the
//! window of T + 1 tokens starting at ((b·B + r)·T) mod (N − T − 1) in sequential order, at a seeded position in
//! shuffle order (as train::Batches draws from one buffer), whatever the layout. With `vocab` set, a token at or
//! above it is refused naming its shard and position.
class TokenShards final : public train::DataSource {
 public:
  TokenShards(const std::vector<std::string>& paths, int B, int T, train::BatchOrder order = train::BatchOrder::sequential,
              std::uint64_t seed = 0, std::int64_t vocab = 0)
      : B_(B), T_(T), order_(order), seed_(seed), vocab_(vocab) {
    LOOM_CHECK(B >= 1 && T >= 1, "batches of ", B, " sequences of ", T, " tokens");
    LOOM_CHECK(!paths.empty(), "no token shards given");
    starts_.push_back(0);
    for (const auto& p : paths) {
      shards_.push_back(std::make_unique<Shard>(p));
      starts_.push_back(starts_.back() + shards_.back()->tokens());
    }
    LOOM_CHECK(tokens() >= std::int64_t{T} + 2, "the token shards (", paths.front(), paths.size() > 1 ? ", ..." : "",
               ") hold ", tokens(), " tokens, too few for one sequence of ", T, " tokens and its targets (", T + 2,
               " needed)");
  }

  //! Tokens in all shards.
  std::int64_t tokens() const { return starts_.back(); }
  const std::vector<std::unique_ptr<Shard>>& shards() const { return shards_; }

  //! The stream's token i.
  std::int32_t token(std::int64_t i) const {
    const auto k = static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin() - 1);
    const std::int64_t v = (*shards_[k])[i - starts_[k]];
    if (vocab_ > 0 && v >= vocab_)
      throw Error(loom::detail::cat("loom: the token shard '", shards_[k]->path(), "' holds token ", v,
                                    " at position ", i - starts_[k], ", at or above the model's vocabulary of ",
                                    vocab_));
    return static_cast<std::int32_t>(v);
  }

  void fill(std::int64_t b, std::int64_t r0, int rows, std::int32_t* inputs, std::int32_t* targets) const override {
    train::fill_windows(b, r0, rows, B_, T_, tokens(), order_, seed_, [&](std::int64_t i) { return token(i); },
                        inputs, targets);
  }

 private:
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<std::int64_t> starts_;  //!< the stream position of each shard's first token, then N
  int B_, T_;
  train::BatchOrder order_;
  std::uint64_t seed_;
  std::int64_t vocab_;
};

}  // namespace loom::data

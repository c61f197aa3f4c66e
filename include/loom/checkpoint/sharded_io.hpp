// Sharded checkpoints, the I/O: files written piece by piece and fsynced, directories synced (what makes a save
// atomic), and reading stored bytes back one checksum block at a time, each verified before it is used: a tensor, a
// whole checkpoint's verification, and a checkpoint written out as stored (checkpoint/sharded.hpp describes the
// whole).
#pragma once

#include <loom/checkpoint/sharded_format.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace loom::checkpoint {

namespace detail {

//! A file written piece by piece and fsynced when closed; an error names the file.
class SyncedFile {
 public:
  explicit SyncedFile(std::string file) : file_(std::move(file)) {
    fd_ = ::open(file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd_ < 0) throw Error("loom: cannot create " + file_ + ": " + std::strerror(errno));
  }
  SyncedFile(const SyncedFile&) = delete;
  SyncedFile& operator=(const SyncedFile&) = delete;
  ~SyncedFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const char* p, std::size_t n) {
    while (n) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw Error("loom: writing " + file_ + " failed: " + std::strerror(errno));
      p += w, n -= static_cast<std::size_t>(w);
    }
  }
  //! fsyncs and closes the file.
  void close() {
    if (::fsync(fd_) != 0) throw Error("loom: fsync of " + file_ + " failed: " + std::strerror(errno));
    ::close(std::exchange(fd_, -1));
  }

 private:
  std::string file_;
  int fd_ = -1;
};

//! Writes bytes to `file` and fsyncs it; an error names the file.
inline void write_synced(const std::string& file, const std::vector<const std::string*>& pieces) {
  SyncedFile f(file);
  for (const std::string* s : pieces) f.write(s->data(), s->size());
  f.close();
}
inline void write_synced(const std::string& file, const std::string& text) { write_synced(file, {&text}); }

inline void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace detail

namespace detail {

//! Copies of stored bytes into a rank's buffers, gathered before any is read.
struct Segment {
  const Chunk* chunk;
  const std::string* tensor;
  std::uint64_t at;  //!< bytes into the chunk
  std::uint64_t bytes;
  char* dst;
};

//! Reads the segments, file by file in order of their bytes, one checksum block in memory at a time; each block is
//! verified before its bytes are used.
inline void read_segments(const std::string& dir, std::vector<Segment>& segs, std::int64_t block) {
  std::sort(segs.begin(), segs.end(), [](const Segment& a, const Segment& b) {
    if (a.chunk->file != b.chunk->file) return a.chunk->file < b.chunk->file;
    return a.chunk->offset + a.at < b.chunk->offset + b.at;
  });
  std::string buf;  // one checksum block at a time
  const Chunk* held = nullptr;
  std::uint64_t held_block = 0;
  int fd = -1;
  std::string open_file;
  auto close_fd = [&] {
    if (fd >= 0) ::close(fd);
    fd = -1;
  };
  std::uint64_t largest = 0;  // the largest block read: the buffer's one allocation
  for (const auto& s : segs) largest = std::max(largest, std::min<std::uint64_t>(s.chunk->bytes, block));
  buf.reserve(largest);
  const ChargedBytes charge(MemoryUse::checkpoint, segs.empty() ? 0 : buf.capacity());  // on the rank's ledger
  try {
    for (const auto& s : segs) {
      const std::string path = dir + "/" + s.chunk->file;
      if (s.chunk->file != open_file) {
        close_fd();
        fd = ::open(path.c_str(), O_RDONLY);
        if (fd < 0)
          throw Error("loom: " + path + " is missing or unreadable (" + std::strerror(errno) + "); the index puts '" +
                      *s.tensor + "' there");
        open_file = s.chunk->file;
        held = nullptr;
      }
      for (std::uint64_t done = 0; done < s.bytes;) {
        const std::uint64_t at = s.at + done, b = at / static_cast<std::uint64_t>(block);
        if (held != s.chunk || held_block != b) {
          const std::uint64_t from = b * static_cast<std::uint64_t>(block);
          const std::uint64_t len = std::min<std::uint64_t>(static_cast<std::uint64_t>(block), s.chunk->bytes - from);
          buf.resize(len);
          std::uint64_t got = 0;
          while (got < len) {
            const auto at_byte = static_cast<off_t>(s.chunk->offset + from + got);
            const ssize_t r = ::pread(fd, buf.data() + got, len - got, at_byte);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0)
              throw Error(loom::detail::cat("loom: ", path, " is truncated: reading bytes [", s.chunk->offset + from,
                                            ", ", s.chunk->offset + from + len, ") of tensor '", *s.tensor,
                                            "' found ", got, " of them"));
            got += static_cast<std::uint64_t>(r);
          }
          if (crc32_of(buf.data(), len) != s.chunk->crc[b])
            throw Error(loom::detail::cat("loom: ", path, ": tensor '", *s.tensor, "' is corrupt: bytes [",
                                          s.chunk->offset + from, ", ", s.chunk->offset + from + len,
                                          ") do not match their checksum"));
          held = s.chunk, held_block = b;
        }
        const std::uint64_t in = at - held_block * static_cast<std::uint64_t>(block);
        const std::uint64_t n = std::min<std::uint64_t>(s.bytes - done, buf.size() - in);
        std::memcpy(s.dst + done, buf.data() + in, n);
        done += n;
      }
    }
  } catch (...) {
    close_fd();
    throw;
  }
  close_fd();
}

}  // namespace detail

//! Reads the whole of tensor `name` of checkpoint directory `dir` into out (its elements, row-major), verifying
//! every block it reads.
inline void read_tensor(const std::string& dir, const ShardedIndex& ix, const std::string& name, char* out) {
  const auto it = ix.tensors.find(name);
  if (it == ix.tensors.end()) throw Error("loom: " + dir + " holds no tensor '" + name + "'");
  const TensorIndex& t = it->second;
  const Box whole = whole_box(t.shape);
  const std::size_t es = size_of(t.dtype);
  std::vector<detail::Segment> segs;
  std::int64_t covered = 0;
  for (const Chunk& k : t.chunks) {
    covered += k.box.numel();
    for_each_row(k.box, [&](const std::vector<std::int64_t>& row, std::int64_t len) {
      segs.push_back({&k, &it->first, static_cast<std::uint64_t>(flat_in(k.box, row)) * es,
                      static_cast<std::uint64_t>(len) * es, out + static_cast<std::size_t>(flat_in(whole, row)) * es});
    });
  }
  if (covered != whole.numel())
    throw Error(loom::detail::cat("loom: ", dir, ": the chunks of tensor '", name, "' hold ", covered, " elements, ",
                                  "the tensor ", whole.numel()));
  detail::read_segments(dir, segs, ix.block);
}

//! Reads every chunk of checkpoint directory `dir` and checks every block's checksum; returns the bytes verified.
inline std::uint64_t verify_sharded(const std::string& dir) {
  const ShardedIndex ix = read_index(dir);
  std::uint64_t bytes = 0;
  for (const auto& [name, t] : ix.tensors) {
    std::vector<char> buf(static_cast<std::size_t>(numel_of(t.shape)) * size_of(t.dtype));
    read_tensor(dir, ix, name, buf.data());
    bytes += buf.size();
  }
  return bytes;
}

//! Writes the model of checkpoint `dir` (ROOT or a checkpoint directory) as it is stored: OUT/model.safetensors
//! (the parameters, by their names, in their stored dtype) and OUT/config.json (the index's "model"), tensor by
//! tensor, one tensor in memory at a time; each file under a temporary name that is then renamed. For a model whose
//! stored names are its Hugging Face names (GPT-2's), Hugging Face's files.
inline void export_stored(const std::string& path, const std::string& out) {
  namespace fs = std::filesystem;
  const std::string dir = resolve_checkpoint(path);
  const ShardedIndex ix = read_index(dir);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) throw Error("loom: cannot create the directory " + out + ": " + ec.message());
  std::vector<std::string> names;
  for (const auto& [name, t] : ix.tensors)
    if (name.find('/') == std::string::npos) names.push_back(name);
  std::vector<SafetensorsEntry> entries;
  for (const auto& name : names) {
    const auto& t = ix.tensors.at(name);
    entries.push_back({name, t.dtype, t.shape, static_cast<std::size_t>(numel_of(t.shape)) * size_of(t.dtype)});
  }
  const std::string prefix = safetensors_prefix(entries, {{"format", "pt"}});
  const std::string file = out + "/model.safetensors", tmp = file + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error("loom: cannot write " + tmp);
    f.write(prefix.data(), static_cast<std::streamsize>(prefix.size()));
    std::vector<char> buf;
    for (const auto& name : names) {
      const auto& t = ix.tensors.at(name);
      buf.assign(static_cast<std::size_t>(numel_of(t.shape)) * size_of(t.dtype), 0);
      read_tensor(dir, ix, name, buf.data());
      f.write(buf.data(), static_cast<std::streamsize>(buf.size()));
    }
    f.flush();
    if (!f) throw Error("loom: writing " + tmp + " failed (disk full?)");
  }
  fs::rename(tmp, file, ec);
  if (ec) throw Error("loom: cannot rename " + tmp + " to " + file + ": " + ec.message());
  detail::write_synced(out + "/config.json.tmp", ix.model.dump(2) + "\n");
  fs::rename(out + "/config.json.tmp", out + "/config.json", ec);
  if (ec) throw Error("loom: cannot rename " + out + "/config.json.tmp: " + ec.message());
}

}  // namespace loom::checkpoint

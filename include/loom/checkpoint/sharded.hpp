// Sharded checkpoints: every rank writes only what it owns, and any layout reads what it needs.
//
// A checkpoint is a directory ROOT/step-NNNNNNNN holding one safetensors file per writing rank (rank-RRRRR.safetensors)
// and index.json. The index records, for every tensor of the whole model (the parameters by their Hugging Face
// names, each optimizer state as "<state>/<parameter>", e.g. "adamw.exp_avg/h.0.attn.c_attn.weight"), its global
// shape and dtype and the chunks that hold it: boxes of the tensor (offsets and sizes along each dimension), each with
// its file, its byte offset there and a CRC-32 of every block of `block` bytes. With it the step, the optimizer and its
// counter, the layout and model shape it was written on, and whatever the caller records under "run" (the schedule,
// the data position, the random seed).
//
// What a rank writes: its tensor-parallel part of each parameter (a part held by several tensor-parallel ranks is
// written by the first), of its pipeline parts (the tied table by the part with the embedding), restricted to the
// elements it writes over data parallelism (Holding::written: under ZeRO its shard, written once over hybrid
// replicas; otherwise an even share of the replicated buffers). Nothing is written twice.
//
// Writing is atomic: every rank writes and fsyncs its file into ROOT/.step-NNNNNNNN.tmp; after a barrier rank 0
// puts the ranks' manifests together into index.json, fsyncs it, renames the directory into place, and then points
// ROOT/latest at it (written to a temporary name and renamed). A crash leaves the previous checkpoint and `latest`
// as they were.
//
// Reading: a rank computes the boxes it holds on its own layout and, for each, the chunks that meet it; it reads the
// checksum blocks that hold those bytes (one block in memory at a time), verifies each, and copies the elements
// straight into its parameters and optimizer state. It never holds more of the model than its own part.
#pragma once

#include <loom/checkpoint/boxes.hpp>
#include <loom/checkpoint/gpt.hpp>
#include <loom/checkpoint/training.hpp>
#include <loom/train/trainer.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace loom::checkpoint {

//! The sharded format's version: a checkpoint of a later version is refused.
inline constexpr int sharded_version = 1;
//! Bytes per checksum block of a chunk.
inline constexpr std::int64_t checksum_block = std::int64_t{1} << 20;

//! One chunk of a tensor in a rank's file.
struct Chunk {
  Box box;
  std::string file;                 //!< in the checkpoint's directory
  std::uint64_t offset = 0;         //!< of its first byte in the file
  std::uint64_t bytes = 0;
  std::vector<std::uint32_t> crc;   //!< CRC-32 of each checksum block
};

//! A tensor of the whole model and where its chunks are.
struct TensorIndex {
  DType dtype;
  Shape shape;
  std::vector<Chunk> chunks;
};

//! index.json.
struct ShardedIndex {
  int version = sharded_version;
  int next_step = 0;
  std::string optimizer;
  int counter = 0;
  std::string layout;
  nlohmann::json model, run;
  std::int64_t block = checksum_block;
  std::map<std::string, std::uint64_t> files;  //!< name -> bytes
  std::map<std::string, TensorIndex> tensors;
};

namespace detail {

inline std::uint32_t crc32_of(const char* p, std::size_t n) {
  uLong c = crc32(0L, Z_NULL, 0);
  while (n) {
    const auto k = static_cast<uInt>(std::min<std::size_t>(n, std::size_t{1} << 30));
    c = crc32(c, reinterpret_cast<const Bytef*>(p), k);
    p += k, n -= k;
  }
  return static_cast<std::uint32_t>(c);
}

inline std::vector<std::uint32_t> block_crcs(const char* p, std::size_t n, std::int64_t block) {
  std::vector<std::uint32_t> out;
  for (std::size_t at = 0; at < n; at += static_cast<std::size_t>(block))
    out.push_back(crc32_of(p + at, std::min(n - at, static_cast<std::size_t>(block))));
  return out;
}

inline std::string step_name(int step) {
  char b[32];
  std::snprintf(b, sizeof b, "step-%08d", step);
  return b;
}
inline std::string rank_file(int rank, const char* ext) {
  char b[40];
  std::snprintf(b, sizeof b, "rank-%05d.%s", rank, ext);
  return b;
}

//! Writes bytes to `file` and fsyncs it; an error names the file.
inline void write_synced(const std::string& file, const std::vector<const std::string*>& pieces) {
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw Error("loom: cannot create " + file + ": " + std::strerror(errno));
  for (const std::string* s : pieces) {
    const char* p = s->data();
    std::size_t n = s->size();
    while (n) {
      const ssize_t w = ::write(fd, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const std::string why = std::strerror(errno);
        ::close(fd);
        throw Error("loom: writing " + file + " failed: " + why);
      }
      p += w, n -= static_cast<std::size_t>(w);
    }
  }
  if (::fsync(fd) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw Error("loom: fsync of " + file + " failed: " + why);
  }
  ::close(fd);
}
inline void write_synced(const std::string& file, const std::string& text) { write_synced(file, {&text}); }

inline void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

inline nlohmann::json box_json(const Box& b) { return {{"offsets", b.offsets}, {"sizes", b.sizes}}; }

//! A chunk this rank writes: the tensor, its dtype and global shape, the box and its bytes.
struct Written {
  std::string tensor;
  DType dtype;
  Shape shape;
  Box box;
  std::string data;
};

//! Calls f(k, n) for the runs [k, k + n) of box-order elements [lo, hi) of `run` that are contiguous in the part.
template <class F>
void each_contiguous(const RunBox& run, std::int64_t lo, std::int64_t hi, F&& f) {
  for (std::int64_t k = lo; k < hi;) {
    const std::int64_t n = std::min(hi, (k / run.slab + 1) * run.slab) - k;
    f(k, n);
    k += n;
  }
}

//! The boxes of `run` that hold elements [lo, hi) of the part (a range Holding gives, relative to the parameter),
//! each with where it starts in the run's box order.
inline std::vector<std::pair<Box, std::int64_t>> boxes_in(const RunBox& run, std::int64_t lo, std::int64_t hi) {
  std::vector<std::pair<Box, std::int64_t>> out;
  std::int64_t at = run.first_at_or_after(lo);
  split_window(run.box, at, run.first_at_or_after(hi), [&](Box b) {
    const auto n = b.numel();
    out.emplace_back(std::move(b), at);
    at += n;
  });
  return out;
}

}  // namespace detail

//! Reads ROOT's latest complete checkpoint directory (ROOT/latest), or DIR itself when it holds index.json.
inline std::string resolve_checkpoint(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(path + "/index.json", ec)) return path;
  std::ifstream f(path + "/latest");
  if (!f) {
    if (!fs::exists(path, ec)) throw Error("loom: no checkpoint at " + path + ": it does not exist");
    throw Error("loom: " + path + " holds no checkpoint: neither index.json nor latest is there");
  }
  std::string name;
  std::getline(f, name);
  if (name.empty() || name.find('/') != std::string::npos)
    throw Error("loom: " + path + "/latest names '" + name + "', not a checkpoint in " + path);
  if (!fs::exists(path + "/" + name + "/index.json", ec))
    throw Error("loom: " + path + "/latest names " + name + ", which has no index.json");
  return path + "/" + name;
}

//! Reads and checks DIR/index.json (a checkpoint directory, not its root).
inline ShardedIndex read_index(const std::string& dir) {
  const std::string file = dir + "/index.json";
  std::ifstream f(file);
  if (!f) throw Error("loom: cannot open " + file);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw Error("loom: " + file + " is not a JSON object");
  if (json_value<std::string>(j, file, "format") != "loom-sharded")
    throw Error("loom: " + file + " is not a loom sharded checkpoint's index");
  ShardedIndex ix;
  ix.version = json_value<int>(j, file, "version");
  if (ix.version > sharded_version)
    throw Error(loom::detail::cat("loom: ", file, " was written in format version ", ix.version,
                                  ", newer than this build reads (", sharded_version, "); use a newer loom"));
  ix.next_step = json_value<int>(j, file, "next_step");
  ix.optimizer = json_value<std::string>(j, file, "optimizer");
  ix.counter = json_value<int>(j, file, "counter");
  ix.layout = json_value<std::string>(j, file, "layout");
  ix.block = json_value<std::int64_t>(j, file, "block");
  if (ix.block <= 0) throw Error(loom::detail::cat("loom: ", file, ": 'block' must be positive, got ", ix.block));
  ix.model = j.value("model", nlohmann::json::object());
  ix.run = j.value("run", nlohmann::json());
  for (const auto& [name, v] : j.at("files").items()) ix.files[name] = v.get<std::uint64_t>();
  for (const auto& [name, v] : j.at("tensors").items()) {
    const std::string at = file + ": tensor '" + name + "'";
    TensorIndex t;
    t.dtype = parse_safetensors_dtype(v.at("dtype").get<std::string>(), file, name);
    t.shape = v.at("shape").get<Shape>();
    for (const auto& c : v.at("chunks")) {
      Chunk k;
      k.box = {c.at("offsets").get<std::vector<std::int64_t>>(), c.at("sizes").get<std::vector<std::int64_t>>()};
      k.file = c.at("file").get<std::string>();
      k.offset = c.at("offset").get<std::uint64_t>();
      k.bytes = c.at("bytes").get<std::uint64_t>();
      k.crc = c.at("crc32").get<std::vector<std::uint32_t>>();
      if (k.box.offsets.size() != t.shape.size() || k.box.sizes.size() != t.shape.size())
        throw Error("loom: " + at + " has a chunk of " + std::to_string(k.box.sizes.size()) +
                    " dimensions, the tensor " + std::to_string(t.shape.size()));
      for (std::size_t d = 0; d < t.shape.size(); ++d)
        if (k.box.offsets[d] < 0 || k.box.sizes[d] < 0 || k.box.offsets[d] + k.box.sizes[d] > t.shape[d])
          throw Error("loom: " + at + " has a chunk outside its shape " + to_string(t.shape));
      if (k.bytes != static_cast<std::uint64_t>(k.box.numel()) * size_of(t.dtype))
        throw Error(loom::detail::cat("loom: ", at, ": a chunk of ", k.box.numel(), " elements holds ", k.bytes,
                                      " bytes"));
      const auto blocks = (k.bytes + static_cast<std::uint64_t>(ix.block) - 1) / static_cast<std::uint64_t>(ix.block);
      if (k.crc.size() != blocks)
        throw Error(loom::detail::cat("loom: ", at, ": a chunk of ", k.bytes, " bytes has ", k.crc.size(),
                                      " checksums, not ", blocks));
      const auto f = ix.files.find(k.file);
      if (f == ix.files.end()) throw Error("loom: " + at + " is in " + k.file + ", which the index does not list");
      if (k.offset + k.bytes > f->second)
        throw Error(loom::detail::cat("loom: ", at, ": the index puts a chunk at bytes [", k.offset, ", ",
                                      k.offset + k.bytes, ") of ", k.file, ", which holds ", f->second, " bytes"));
      t.chunks.push_back(std::move(k));
    }
    ix.tensors.emplace(name, std::move(t));
  }
  return ix;
}

//! Writes a sharded checkpoint of `trainer` at step `next_step` into ROOT/step-NNNNNNNN and points ROOT/latest at it;
//! `layout` names the layout (recorded), `run` is recorded under "run". A collective over the world: every rank
//! calls it. Returns the checkpoint's directory.
template <class Model, class Optimizer>
std::string save_sharded(const std::string& root, train::TrainerOf<Model, Optimizer>& trainer, int next_step,
                         const std::string& layout, const nlohmann::json& run = nullptr) {
  namespace fs = std::filesystem;
  using T = typename Model::value_type;
  using A = loom::acc_t<T>;
  const int rank = trainer.world_rank();
  const std::string name = detail::step_name(next_step);
  const std::string tmp = root + "/." + name + ".tmp", final_dir = root + "/" + name;
  if (rank == 0) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    if (ec) throw Error("loom: cannot create " + tmp + ": " + ec.message());
  }
  trainer.barrier();

  // This rank's chunks: of each part, each parameter's runs it writes, within the ranges it writes.
  std::vector<detail::Written> chunks;
  for (std::size_t c = 0; c < trainer.parts().size(); ++c) {
    auto& part = *trainer.parts()[c];
    const train::Holding held = trainer.holding(c);
    std::vector<T> host;
    const T* params = part.params().data();
    if constexpr (!kernels::is_host_v<typename Model::device>) {
      host.resize(static_cast<std::size_t>(part.params().numel()));
      part.ops().to_host(part.params().data(), host.data(), host.size());
      params = host.data();
    }
    const auto states = trainer.optimizers()[c].state();
    std::vector<std::vector<A>> state_host(states.size());
    std::vector<const A*> state(states.size());
    for (std::size_t k = 0; k < states.size(); ++k) {
      state[k] = states[k].second.data();
      if constexpr (!kernels::is_host_v<typename Model::device>) {
        state_host[k].resize(static_cast<std::size_t>(states[k].second.numel()));
        part.ops().to_host(states[k].second.data(), state_host[k].data(), state_host[k].size());
        state[k] = state_host[k].data();
      }
    }
    for (const auto& s : part.specs()) {
      if (s.index == 0 && !part.embedding()) continue;  // the tied table: written by the part with the embedding
      const std::int64_t n = numel_of(s.shape);
      for (const auto& run : run_boxes(s.layout)) {
        if (!first_holder(s.layout, run, part.tp_rank())) continue;
        for (const auto& w : held.written) {
          const std::int64_t lo = std::max(w.lo, s.offset), hi = std::min(w.hi, s.offset + n);
          if (lo >= hi) continue;
          for (const auto& [box, at] : detail::boxes_in(run, lo - s.offset, hi - s.offset)) {
            const std::int64_t end = at + box.numel();
            auto pack = [&](const std::string& tensor, DType dtype, std::size_t esize, auto&& source) {
              detail::Written out{tensor, dtype, s.layout.global_shape(), box, {}};
              out.data.resize(static_cast<std::size_t>(box.numel()) * esize);
              char* dst = out.data.data();
              detail::each_contiguous(run, at, end, [&](std::int64_t k, std::int64_t len) {
                std::memcpy(dst, source(s.offset + run.local(k)), static_cast<std::size_t>(len) * esize);
                dst += len * static_cast<std::int64_t>(esize);
              });
              chunks.push_back(std::move(out));
            };
            pack(s.name, dtype_of<T>, sizeof(T), [&](std::int64_t x) { return params + x; });
            for (std::size_t k = 0; k < states.size(); ++k)
              pack(states[k].first + "/" + s.name, dtype_of<A>, sizeof(A),
                   [&](std::int64_t x) { return state[k] + w.at + (x - w.lo); });
          }
        }
      }
    }
  }

  // The rank's file (safetensors) and its manifest, each fsynced.
  nlohmann::json manifest = nlohmann::json::array();
  if (!chunks.empty()) {
    const std::string file = detail::rank_file(rank, "safetensors");
    std::vector<SafetensorsEntry> entries;
    for (std::size_t i = 0; i < chunks.size(); ++i)
      entries.push_back({chunks[i].tensor + "#" + std::to_string(i), chunks[i].dtype, chunks[i].box.sizes,
                         chunks[i].data.size()});
    const std::string prefix = safetensors_prefix(entries);
    std::vector<const std::string*> pieces{&prefix};
    std::uint64_t offset = prefix.size();
    for (const auto& w : chunks) {
      pieces.push_back(&w.data);
      manifest.push_back({{"tensor", w.tensor},
                          {"dtype", safetensors_dtype(w.dtype)},
                          {"shape", w.shape},
                          {"offsets", w.box.offsets},
                          {"sizes", w.box.sizes},
                          {"file", file},
                          {"offset", offset},
                          {"bytes", w.data.size()},
                          {"crc32", detail::block_crcs(w.data.data(), w.data.size(), checksum_block)}});
      offset += w.data.size();
    }
    detail::write_synced(tmp + "/" + file, pieces);
    detail::write_synced(tmp + "/" + detail::rank_file(rank, "json"), manifest.dump());
  }
  chunks.clear();
  trainer.barrier();  // every rank's file is on disk

  if (rank == 0) {
    nlohmann::ordered_json index;
    index["format"] = "loom-sharded";
    index["version"] = sharded_version;
    index["next_step"] = next_step;
    index["optimizer"] = Optimizer::name;
    index["counter"] = trainer.optimizers().front().counter();
    index["layout"] = layout;
    index["world_size"] = trainer.world_size();
    index["block"] = checksum_block;
    index["model"] = gpt_config(trainer.shape(), trainer.parts().front()->options().ln_eps);
    if (!run.is_null()) index["run"] = run;
    nlohmann::ordered_json files = nlohmann::ordered_json::object(), tensors = nlohmann::ordered_json::object();
    for (int r = 0; r < trainer.world_size(); ++r) {
      const std::string mf = tmp + "/" + detail::rank_file(r, "json");
      std::ifstream f(mf);
      if (!f) continue;  // the rank wrote nothing
      const auto m = nlohmann::json::parse(f);
      const std::string file = detail::rank_file(r, "safetensors");
      std::error_code ec;
      files[file] = fs::file_size(tmp + "/" + file, ec);
      if (ec) throw Error("loom: " + tmp + "/" + file + " is missing: " + ec.message());
      for (const auto& c : m) {
        const std::string t = c.at("tensor").get<std::string>();
        if (!tensors.contains(t)) tensors[t] = {{"dtype", c["dtype"]}, {"shape", c["shape"]}, {"chunks", {}}};
        tensors[t]["chunks"].push_back({{"offsets", c["offsets"]}, {"sizes", c["sizes"]}, {"file", c["file"]},
                                        {"offset", c["offset"]}, {"bytes", c["bytes"]}, {"crc32", c["crc32"]}});
      }
      fs::remove(mf, ec);
    }
    index["files"] = files;
    index["tensors"] = tensors;
    detail::write_synced(tmp + "/index.json", index.dump(1));
    detail::sync_directory(tmp);
    std::error_code ec;
    fs::remove_all(final_dir, ec);
    fs::rename(tmp, final_dir, ec);
    if (ec) throw Error("loom: cannot rename " + tmp + " to " + final_dir + ": " + ec.message());
    detail::sync_directory(root);
    detail::write_synced(root + "/latest.tmp", name + "\n");
    fs::rename(root + "/latest.tmp", root + "/latest", ec);
    if (ec) throw Error("loom: cannot rename " + root + "/latest.tmp to " + root + "/latest: " + ec.message());
    detail::sync_directory(root);
  }
  trainer.barrier();  // the checkpoint is in place before any rank goes on (or reads it)
  return final_dir;
}

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
  std::string buf;
  const Chunk* held = nullptr;
  std::uint64_t held_block = 0;
  int fd = -1;
  std::string open_file;
  auto close_fd = [&] {
    if (fd >= 0) ::close(fd);
    fd = -1;
  };
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
            const ssize_t r = ::pread(fd, buf.data() + got, len - got, static_cast<off_t>(s.chunk->offset + from + got));
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

//! Writes the model of checkpoint `dir` (ROOT or a checkpoint directory) as Hugging Face writes GPT-2: OUT/
//! model.safetensors (the parameters, by name, in their stored dtype) and OUT/config.json, tensor by tensor, one
//! tensor in memory at a time; each file under a temporary name that is then renamed.
inline void export_hf(const std::string& path, const std::string& out) {
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

//! Loads a sharded checkpoint (ROOT, whose `latest` names it, or its directory) into `trainer`, whatever layout it
//! was written on: each rank reads its own part of the parameters and of the optimizer state. Returns the next step.
//! A collective over the world (it ends with a barrier, so that a rank that fails stops the others).
template <class Model, class Optimizer>
int load_sharded(const std::string& path, train::TrainerOf<Model, Optimizer>& trainer) {
  using T = typename Model::value_type;
  using A = loom::acc_t<T>;
  const std::string dir = resolve_checkpoint(path);
  const ShardedIndex ix = read_index(dir);
  const auto& front = *trainer.parts().front();
  const auto want = gpt_config(trainer.shape(), front.options().ln_eps);
  for (const auto& [key, value] : want.items())
    if (!ix.model.contains(key) || ix.model[key] != value)
      throw Error("loom: " + dir + " holds a model with " + key + " = " +
                  (ix.model.contains(key) ? ix.model[key].dump() : std::string("(none)")) + ", this run's has " +
                  value.dump() + " (the checkpoint's model: " + ix.model.dump() + ")");
  if (ix.optimizer != Optimizer::name)
    throw Error("loom: " + dir + " was saved with the optimizer " + ix.optimizer + ", not " + Optimizer::name);

  for (std::size_t c = 0; c < trainer.parts().size(); ++c) {
    auto& part = *trainer.parts()[c];
    const train::Holding held = trainer.holding(c);
    auto& opt = trainer.optimizers()[c];
    auto states = opt.state();
    std::vector<T> host;
    T* params = const_cast<T*>(part.params().data());
    if constexpr (!kernels::is_host_v<typename Model::device>) {
      host.assign(static_cast<std::size_t>(part.params().numel()), T(0));
      params = host.data();
    }
    std::vector<std::vector<A>> state_host(states.size());
    std::vector<A*> state(states.size());
    for (std::size_t k = 0; k < states.size(); ++k) {
      state[k] = const_cast<A*>(states[k].second.data());
      if constexpr (!kernels::is_host_v<typename Model::device>) {
        state_host[k].assign(static_cast<std::size_t>(states[k].second.numel()), A(0));
        state[k] = state_host[k].data();
      }
    }
    std::vector<detail::Segment> segs;
    // The segments of tensor `name` that fill elements `ranges` of part parameter s, through dst(x, range).
    auto plan = [&](const layers::ParamSpec& s, const std::string& name, DType dtype, std::size_t esize,
                    const std::vector<train::Holding::Range>& ranges, auto&& dst) {
      const auto it = ix.tensors.find(name);
      if (it == ix.tensors.end()) throw Error("loom: " + dir + " holds no tensor '" + name + "'");
      const TensorIndex& t = it->second;
      if (t.dtype != dtype || t.shape != s.layout.global_shape())
        throw Error("loom: " + dir + ": tensor '" + name + "' is " + std::string(name_of(t.dtype)) + " " +
                    to_string(t.shape) + ", this run needs " + std::string(name_of(dtype)) + " " +
                    to_string(s.layout.global_shape()));
      const std::int64_t n = numel_of(s.shape);
      for (const auto& run : run_boxes(s.layout))
        for (const auto& w : ranges) {
          const std::int64_t lo = std::max(w.lo, s.offset), hi = std::min(w.hi, s.offset + n);
          if (lo >= hi) continue;
          for (const auto& [box, at] : detail::boxes_in(run, lo - s.offset, hi - s.offset)) {
            std::int64_t covered = 0;
            for (const Chunk& k : t.chunks) {
              const auto meet = intersect(box, k.box);
              if (!meet) continue;
              covered += meet->numel();
              for_each_row(*meet, [&](const std::vector<std::int64_t>& row, std::int64_t len) {
                const std::int64_t x = s.offset + run.local(at + flat_in(box, row));
                segs.push_back({&k, &it->first, static_cast<std::uint64_t>(flat_in(k.box, row)) * esize,
                                static_cast<std::uint64_t>(len) * esize, reinterpret_cast<char*>(dst(x, w))});
              });
            }
            if (covered != box.numel())
              throw Error(loom::detail::cat("loom: ", dir, ": tensor '", name, "' holds ", covered, " of the ",
                                            box.numel(), " elements at offsets ", to_string(box.offsets), " sizes ",
                                            to_string(box.sizes), " (chunks missing or overlapping)"));
          }
        }
    };
    for (const auto& s : part.specs()) {
      plan(s, s.name, dtype_of<T>, sizeof(T), held.params,
           [&](std::int64_t x, const train::Holding::Range&) { return params + x; });
      for (std::size_t k = 0; k < states.size(); ++k)
        plan(s, states[k].first + "/" + s.name, dtype_of<A>, sizeof(A), held.state,
             [&, k](std::int64_t x, const train::Holding::Range& w) { return state[k] + w.at + (x - w.lo); });
    }
    detail::read_segments(dir, segs, ix.block);
    if constexpr (!kernels::is_host_v<typename Model::device>) {
      part.ops().from_host(host.data(), const_cast<T*>(part.params().data()), host.size());
      for (std::size_t k = 0; k < states.size(); ++k)
        part.ops().from_host(state_host[k].data(), const_cast<A*>(states[k].second.data()), state_host[k].size());
    }
    opt.set_counter(ix.counter);
  }
  trainer.barrier();
  return ix.next_step;
}

}  // namespace loom::checkpoint

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
// Writing is atomic: every rank takes its chunks (snapshot_into), writes and fsyncs its file into
// ROOT/.step-NNNNNNNN.tmp (write_snapshot); once every rank has, rank 0 puts the ranks' manifests together into
// index.json, fsyncs it, renames the directory into place, and then points ROOT/latest at it (commit_snapshot). A
// crash leaves the previous checkpoint and `latest` as they were. save_sharded does it all in place; CheckpointWriter
// can write in a background thread while training goes on.
//
// Reading: a rank computes the boxes it holds on its own layout and, for each, the chunks that meet it; it reads the
// checksum blocks that hold those bytes (one block in memory at a time), verifies each, and copies the elements
// straight into its parameters and optimizer state. It never holds more of the model than its own part.
#pragma once

#include <loom/checkpoint/boxes.hpp>
#include <loom/checkpoint/training.hpp>
#include <loom/train/trainer.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
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

inline nlohmann::json box_json(const Box& b) { return {{"offsets", b.offsets}, {"sizes", b.sizes}}; }

//! A chunk this rank writes: the tensor, its dtype and global shape, the box, and its bytes: copied (data), or
//! copied from the trainer as they are written (fill, which writes `bytes` bytes; a save in place on the host).
struct Written {
  std::string tensor;
  DType dtype;
  Shape shape;
  Box box;
  std::size_t bytes = 0;
  std::string data;
  std::function<void(char*)> fill;
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

//! Reads and checks DIR/index.json (a checkpoint directory, not its root), and that every file it lists has the
//! size it says.
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
  // Every file as large as the index says, before a byte is read: a file cut short (or replaced) is refused on every
  // load, also where the load reads none of what it lost (--init-from reads the parameters alone).
  for (const auto& [name, bytes] : ix.files) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(dir + "/" + name, ec);
    if (ec) throw Error("loom: " + dir + "/" + name + " is missing (" + file + " lists it): " + ec.message());
    if (size == bytes) continue;
    std::string lost;  // the first tensor whose bytes are gone
    for (const auto& [tname, t] : ix.tensors)
      for (const auto& k : t.chunks)
        if (lost.empty() && k.file == name && k.offset + k.bytes > size)
          lost = loom::detail::cat(" (tensor '", tname, "' lies at bytes [", k.offset, ", ", k.offset + k.bytes,
                                   ") of it)");
    throw Error(loom::detail::cat("loom: ", dir, "/", name, " is ", size < bytes ? "truncated" : "not the file written",
                                  ": it holds ", size, " bytes, ", file, " says ", bytes, lost,
                                  "; the checkpoint is damaged"));
  }
  return ix;
}

//! How checkpoints are saved.
struct SaveOptions {
  bool asynchronous = false;             //!< CheckpointWriter: written by a background thread
  int keep = 0;                          //!< the newest `keep` checkpoints of the root stay (0: all)
  std::int64_t block = checksum_block;   //!< bytes per checksum block: what a reader holds at most at a time
};

//! A rank's part of a checkpoint (snapshot_into): what write_snapshot puts on disk and, on rank 0, what
//! commit_snapshot records in the index.
struct Snapshot {
  std::string root, name;  //!< ROOT and step-NNNNNNNN
  int rank = 0, world_size = 1, next_step = 0;
  std::int64_t block = checksum_block;
  nlohmann::ordered_json header;  //!< rank 0: the index but its files and tensors
  std::vector<detail::Written> chunks;
  ChargedBytes charge;  //!< the chunks' bytes, on the rank's ledger

  std::string temporary_dir() const { return root + "/." + name + ".tmp"; }
  std::string final_dir() const { return root + "/" + name; }
};

namespace detail {

//! The fault-injection hook of the crash tests: LOOM_CHECKPOINT_FAULT=POINT or POINT@STEP kills the process
//! (SIGKILL, as a job that is killed) when a save of that step (any step) reaches POINT: `write` (a rank's file is on
//! disk, its manifest not), `index` (index.json is on disk in the temporary directory), `rename` (the checkpoint is
//! in place, `latest` still names the previous one).
inline void fault_point(const char* point, int step) {
  const char* env = std::getenv("LOOM_CHECKPOINT_FAULT");
  if (!env || !*env) return;
  const std::string v = env;
  const auto at = v.find('@');
  if (v.substr(0, at) != point) return;
  if (at != std::string::npos && v.substr(at + 1) != std::to_string(step)) return;
  std::fprintf(stderr, "loom: LOOM_CHECKPOINT_FAULT=%s: killing the process at '%s' of the save of step %d\n", env,
               point, step);
  std::fflush(stderr);
  std::raise(SIGKILL);
}

}  // namespace detail

//! Makes ROOT/.step-NNNNNNNN.tmp empty (rank 0: a crashed save may have left one); every rank calls it, and a
//! barrier must follow before any rank writes there.
inline void prepare_snapshot(const std::string& root, int next_step, int rank) {
  namespace fs = std::filesystem;
  if (rank != 0) return;
  const std::string tmp = root + "/." + detail::step_name(next_step) + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) throw Error("loom: cannot create " + tmp + ": " + ec.message());
}

//! Copies what this rank writes of `trainer` (its chunks of every parameter and optimizer state) to host memory,
//! charged to its ledger as checkpoint buffers, into `snap`, whose buffers it reuses (a writer that saves again and
//! again allocates them once). No communication: training may change the trainer once it returns. With copy = false
//! (on the host) it records where the chunks are instead, and write_snapshot copies each as it writes it: the
//! trainer must not change until then (a save in place holds one chunk at a time).
template <class Model, class Optimizer>
void snapshot_into(Snapshot& snap, const std::string& root, train::TrainerOf<Model, Optimizer>& trainer,
                   int next_step, const std::string& layout, const nlohmann::json& run = nullptr,
                   std::int64_t block = checksum_block, bool copy = true) {
  static_assert(checkpointable<typename train::TrainerOf<Model, Optimizer>::Part>());
  using T = typename Model::value_type;
  using A = loom::acc_t<T>;
  LOOM_CHECK(block > 0, "the checksum block must be positive, got ", block);
  std::vector<detail::Written> before = std::move(snap.chunks);  // their buffers, to reuse in order
  snap.chunks.clear();
  snap.header = nlohmann::ordered_json();
  snap.block = block;
  snap.root = root, snap.name = detail::step_name(next_step), snap.next_step = next_step;
  snap.rank = trainer.world_rank(), snap.world_size = trainer.world_size();
  // This rank's chunks: of each part, each parameter's runs it writes, within the ranges it writes.
  std::vector<detail::Written>& chunks = snap.chunks;
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
    ChargedBytes staged;  // on a GPU: the host copy of the part, while its chunks are cut
    if constexpr (!kernels::is_host_v<typename Model::device>) {
      std::size_t b = host.size() * sizeof(T);
      for (const auto& v : state_host) b += v.size() * sizeof(A);
      staged = ChargedBytes(MemoryUse::checkpoint, b);
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
            // The chunk's bytes from `base` (its element x of the part's flat buffer is base + x).
            auto pack = [&](const std::string& tensor, DType dtype, std::size_t esize, const char* base) {
              detail::Written out{tensor, dtype, s.layout.global_shape(), box,
                                  static_cast<std::size_t>(box.numel()) * esize, {}, {}};
              out.fill = [run, at, end, esize, base, offset = s.offset](char* dst) {
                detail::each_contiguous(run, at, end, [&](std::int64_t k, std::int64_t len) {
                  const auto x = static_cast<std::size_t>(offset + run.local(k));
                  std::memcpy(dst, base + x * esize, static_cast<std::size_t>(len) * esize);
                  dst += len * static_cast<std::int64_t>(esize);
                });
              };
              if (copy || !kernels::is_host_v<typename Model::device>) {  // a GPU's part is in `host` for now
                if (chunks.size() < before.size()) out.data = std::move(before[chunks.size()].data);
                out.data.resize(out.bytes);
                out.fill(out.data.data());
                out.fill = nullptr;
              }
              chunks.push_back(std::move(out));
            };
            pack(s.name, dtype_of<T>, sizeof(T), reinterpret_cast<const char*>(params));
            for (std::size_t k = 0; k < states.size(); ++k)  // the state of range w starts at w.at, element w.lo
              pack(states[k].first + "/" + s.name, dtype_of<A>, sizeof(A),
                   reinterpret_cast<const char*>(state[k] + w.at) - w.lo * static_cast<std::int64_t>(sizeof(A)));
          }
        }
      }
    }
  }
  std::size_t copied = 0;
  for (const auto& w : chunks)
    if (!w.fill) copied += w.data.capacity();
  snap.charge = ChargedBytes();  // released before the new charge: the reused buffers are in both
  before.clear();
  snap.charge = ChargedBytes(MemoryUse::checkpoint, copied);
  if (snap.rank == 0) {
    auto& index = snap.header;
    index["format"] = "loom-sharded";
    index["version"] = sharded_version;
    index["next_step"] = next_step;
    index["optimizer"] = Optimizer::name;
    index["counter"] = trainer.optimizers().front().counter();
    index["layout"] = layout;
    index["world_size"] = trainer.world_size();
    index["block"] = block;
    index["model"] = model_config(*trainer.parts().front());
    if (!run.is_null()) index["run"] = run;
  }
}

//! Writes a snapshot's chunks as the rank's file in the temporary directory (safetensors, then its manifest), each
//! fsynced, and frees them, unless keep_buffers (for the next snapshot_into); a chunk not copied yet is copied into
//! a buffer of its size, one at a time. No communication: a background thread may run it.
inline void write_snapshot(Snapshot& snap, bool keep_buffers = false) {
  const std::string tmp = snap.temporary_dir();
  nlohmann::json manifest = nlohmann::json::array();
  if (!snap.chunks.empty()) {
    const std::string file = detail::rank_file(snap.rank, "safetensors");
    std::vector<SafetensorsEntry> entries;
    std::size_t largest = 0;
    for (std::size_t i = 0; i < snap.chunks.size(); ++i) {
      const auto& w = snap.chunks[i];
      entries.push_back({w.tensor + "#" + std::to_string(i), w.dtype, w.box.sizes, w.bytes});
      if (w.fill) largest = std::max(largest, w.bytes);
    }
    const std::string prefix = safetensors_prefix(entries);
    std::string buffer;  // the chunks copied as they are written
    buffer.reserve(largest);
    const ChargedBytes charge(MemoryUse::checkpoint, buffer.capacity());
    detail::SyncedFile out(tmp + "/" + file);
    out.write(prefix.data(), prefix.size());
    std::uint64_t offset = prefix.size();
    for (auto& w : snap.chunks) {
      const std::string* bytes = &w.data;
      if (w.fill) {
        buffer.resize(w.bytes);
        w.fill(buffer.data());
        bytes = &buffer;
      }
      out.write(bytes->data(), bytes->size());
      manifest.push_back({{"tensor", w.tensor},
                          {"dtype", safetensors_dtype(w.dtype)},
                          {"shape", w.shape},
                          {"offsets", w.box.offsets},
                          {"sizes", w.box.sizes},
                          {"file", file},
                          {"offset", offset},
                          {"bytes", w.bytes},
                          {"crc32", detail::block_crcs(bytes->data(), bytes->size(), snap.block)}});
      offset += w.bytes;
      if (!keep_buffers) std::string().swap(w.data);
    }
    out.close();
    detail::fault_point("write", snap.next_step);
    detail::write_synced(tmp + "/" + detail::rank_file(snap.rank, "json"), manifest.dump());
  }
  if (keep_buffers) return;
  snap.chunks.clear();
  snap.chunks.shrink_to_fit();
  snap.charge.release();
}

//! Rank 0, once every rank's write_snapshot has finished: puts the manifests together into index.json, renames the
//! temporary directory into place, points ROOT/latest at it, and, with keep > 0, removes all but the `keep` newest
//! checkpoints of ROOT. Returns the checkpoint's directory.
inline std::string commit_snapshot(const Snapshot& snap, int keep = 0) {
  namespace fs = std::filesystem;
  const std::string tmp = snap.temporary_dir(), final_dir = snap.final_dir(), root = snap.root;
  nlohmann::ordered_json index = snap.header;
  nlohmann::ordered_json files = nlohmann::ordered_json::object(), tensors = nlohmann::ordered_json::object();
  for (int r = 0; r < snap.world_size; ++r) {
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
    f.close();
    fs::remove(mf, ec);
  }
  index["files"] = files;
  index["tensors"] = tensors;
  detail::write_synced(tmp + "/index.json", index.dump(1));
  detail::sync_directory(tmp);
  detail::fault_point("index", snap.next_step);
  std::error_code ec;
  fs::remove_all(final_dir, ec);
  fs::rename(tmp, final_dir, ec);
  if (ec) throw Error("loom: cannot rename " + tmp + " to " + final_dir + ": " + ec.message());
  detail::sync_directory(root);
  detail::fault_point("rename", snap.next_step);
  detail::write_synced(root + "/latest.tmp", snap.name + "\n");
  fs::rename(root + "/latest.tmp", root + "/latest", ec);
  if (ec) throw Error("loom: cannot rename " + root + "/latest.tmp to " + root + "/latest: " + ec.message());
  detail::sync_directory(root);
  if (keep > 0) {  // the names sort as the steps do (step-NNNNNNNN)
    std::vector<std::string> steps;
    for (const auto& e : fs::directory_iterator(root, ec)) {
      const std::string n = e.path().filename().string();
      if (n.starts_with("step-") && e.is_directory()) steps.push_back(n);
    }
    std::sort(steps.begin(), steps.end());
    for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < steps.size(); ++i)
      if (steps[i] != snap.name) fs::remove_all(root + "/" + steps[i], ec);
  }
  return final_dir;
}

//! Saves a run's checkpoints into ROOT, synchronously or in the background. Each rank owns one; save() and finish()
//! are collectives over the world.
//! - synchronous: save() returns once the checkpoint is in place, holding one chunk at a time as it writes.
//! - asynchronous: save() copies the rank's part to host memory and returns; a background thread writes it while
//!   training goes on. The checkpoint is put in place (index, rename, `latest`) when the next save() begins or at
//!   finish(), once every rank's file is on disk: until then `latest` names the one before. Each save waits for the
//!   previous one's writing. The host copy's buffers stay allocated from one save to the next (checkpoint buffers on
//!   the rank's ledger), so that only the first save allocates them.
class CheckpointWriter {
 public:
  explicit CheckpointWriter(std::string root, SaveOptions options = {}) : root_(std::move(root)), options_(options) {
    LOOM_CHECK(options.keep >= 0, "the number of checkpoints to keep must not be negative, got ", options.keep);
  }
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  //! Waits for the background writer; a snapshot it has not put in place stays a temporary directory.
  ~CheckpointWriter() {
    if (writer_.joinable()) writer_.join();
  }

  //! Saves `trainer` at `next_step` (see the class).
  template <class Model, class Optimizer>
  void save(train::TrainerOf<Model, Optimizer>& trainer, int next_step, const std::string& layout,
            const nlohmann::json& run = nullptr) {
    const auto t0 = std::chrono::steady_clock::now();
    complete([&] { trainer.barrier(); });
    prepare_snapshot(root_, next_step, trainer.world_rank());
    trainer.barrier();
    const bool async = options_.asynchronous;
    snapshot_into(snap_, root_, trainer, next_step, layout, run, options_.block, /*copy=*/async);
    pending_ = true;
    if (async) {
      writer_ = std::thread([this] {
        try {
          write_snapshot(snap_, /*keep_buffers=*/true);
        } catch (...) {
          failure_ = std::current_exception();
        }
      });
    } else {
      write_snapshot(snap_);
      complete([&] { trainer.barrier(); });
    }
    blocked_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++saves_;
  }

  //! Puts the last checkpoint in place (asynchronous: waits for its writing). Every rank calls it at the end.
  template <class Model, class Optimizer>
  void finish(train::TrainerOf<Model, Optimizer>& trainer) {
    const auto t0 = std::chrono::steady_clock::now();
    complete([&] { trainer.barrier(); });
    snap_ = Snapshot();  // the host copy's buffers
    finish_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  bool asynchronous() const { return options_.asynchronous; }
  int saves() const { return saves_; }
  //! Seconds save() held its caller, summed over the saves (asynchronous: the host copy and the wait for the
  //! previous save's writing).
  double blocked_seconds() const { return blocked_; }
  //! Seconds finish() waited.
  double finish_seconds() const { return finish_; }
  //! The directory of the last checkpoint put in place (empty before the first).
  const std::string& last() const { return last_; }

 private:
  //! Waits for the pending snapshot's writing, then (after a barrier: every rank's file is on disk) rank 0 puts it
  //! in place; a barrier ends it.
  template <class Barrier>
  void complete(Barrier&& barrier) {
    if (writer_.joinable()) writer_.join();
    if (!pending_) return;
    pending_ = false;
    if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
    barrier();
    if (snap_.rank == 0) commit_snapshot(snap_, options_.keep);
    last_ = snap_.final_dir();
    barrier();
  }

  std::string root_;
  SaveOptions options_;
  Snapshot snap_;  // the pending one, and then its buffers for the next
  bool pending_ = false;
  std::thread writer_;
  std::exception_ptr failure_;
  double blocked_ = 0, finish_ = 0;
  int saves_ = 0;
  std::string last_;
};

namespace detail {
//! Sharded checkpoints do not yet know that expert-parallel ranks hold different experts: refused.
template <class Trainer>
void check_not_expert_parallel(Trainer& trainer, const char* what) {
  const auto& part = *trainer.parts().front();
  if constexpr (requires { part.ep(); })
    LOOM_CHECK(part.ep() == nullptr, "a sharded checkpoint cannot be ", what, " on an expert-parallel layout yet ",
               "(EP<", part.ep()->size(), ">); save_training writes the whole model, which any layout loads");
}
}  // namespace detail

//! Writes a sharded checkpoint of `trainer` at step `next_step` into ROOT/step-NNNNNNNN and points ROOT/latest at it
//! (one CheckpointWriter's save and finish); `layout` names the layout (recorded), `run` is recorded under "run".
//! A collective over the world: every rank calls it. Returns the checkpoint's directory, in place.
template <class Model, class Optimizer>
std::string save_sharded(const std::string& root, train::TrainerOf<Model, Optimizer>& trainer, int next_step,
                         const std::string& layout, const nlohmann::json& run = nullptr, SaveOptions options = {}) {
  detail::check_not_expert_parallel(trainer, "saved");
  CheckpointWriter writer(root, options);
  writer.save(trainer, next_step, layout, run);
  writer.finish(trainer);
  return writer.last();
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

//! What load_sharded reads: the training state (parameters, optimizer state and counter: --resume) or the
//! parameters alone (a new run from the weights: --init-from).
enum class LoadWhat { training, parameters };

//! Loads a sharded checkpoint (ROOT, whose `latest` names it, or its directory) into `trainer`, whatever layout it
//! was written on: each rank reads its own part of the parameters and of the optimizer state. Returns the next step.
//! Besides what it holds, a rank holds one checksum block of the files at a time (charged to its ledger as
//! checkpoint buffers) and, on a GPU, a host copy of its part. A collective over the world (it ends with a barrier,
//! so that a rank that fails stops the others).
template <class Model, class Optimizer>
int load_sharded(const std::string& path, train::TrainerOf<Model, Optimizer>& trainer,
                 LoadWhat what = LoadWhat::training) {
  static_assert(checkpointable<typename train::TrainerOf<Model, Optimizer>::Part>());
  detail::check_not_expert_parallel(trainer, "loaded");
  using T = typename Model::value_type;
  using A = loom::acc_t<T>;
  const std::string dir = resolve_checkpoint(path);
  const ShardedIndex ix = read_index(dir);
  const auto& front = *trainer.parts().front();
  // (as nlohmann::json, the index's own kind: comparing the two kinds is ambiguous to some compilers)
  const auto want = nlohmann::json::parse(model_config(front).dump());
  for (const auto& [key, value] : want.items())
    if (!ix.model.contains(key) || ix.model[key] != value)
      throw Error("loom: " + dir + " holds a model with " + key + " = " +
                  (ix.model.contains(key) ? ix.model[key].dump() : std::string("(none)")) + ", this run's has " +
                  value.dump() + " (the checkpoint's model: " + ix.model.dump() + ")");
  const bool state_too = what == LoadWhat::training;
  if (state_too && ix.optimizer != Optimizer::name)
    throw Error("loom: " + dir + " was saved with the optimizer " + ix.optimizer + ", not " + Optimizer::name);

  for (std::size_t c = 0; c < trainer.parts().size(); ++c) {
    auto& part = *trainer.parts()[c];
    const train::Holding held = trainer.holding(c);
    auto& opt = trainer.optimizers()[c];
    auto states = opt.state();
    if (!state_too) states.clear();
    std::vector<T> host;
    ChargedBytes staged;  // on a GPU: the host copy of the part
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
    if constexpr (!kernels::is_host_v<typename Model::device>) {
      std::size_t b = host.size() * sizeof(T);
      for (const auto& v : state_host) b += v.size() * sizeof(A);
      staged = ChargedBytes(MemoryUse::checkpoint, b);
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
    if (state_too) opt.set_counter(ix.counter);
  }
  trainer.barrier();
  return ix.next_step;
}

}  // namespace loom::checkpoint

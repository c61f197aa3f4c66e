// Sharded checkpoints, the format: the index of a checkpoint directory (index.json: every tensor's dtype, global
// shape and chunks, each chunk's file, byte offset and CRC-32 of every block), its version, the names of its files,
// and reading and checking an index (checkpoint/sharded.hpp describes the whole).
#pragma once

#include <loom/checkpoint/boxes.hpp>
#include <loom/checkpoint/safetensors.hpp>
#include <loom/checkpoint/training.hpp>

#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
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

inline nlohmann::json box_json(const Box& b) { return {{"offsets", b.offsets}, {"sizes", b.sizes}}; }

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

}  // namespace loom::checkpoint

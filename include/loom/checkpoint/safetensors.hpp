// The safetensors format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
// and byte range, then the raw little-endian data. Writing goes to a temporary name that is then renamed, so an
// interrupted write never leaves a half-written file in place. Needs nlohmann-json.
#pragma once

#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace loom::checkpoint {

inline const char* safetensors_dtype(DType d) {
  switch (d) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
  }
  return "?";
}
inline DType parse_safetensors_dtype(const std::string& s, const std::string& file) {
  for (DType d : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64})
    if (s == safetensors_dtype(d)) return d;
  throw Error("loom: " + file + " holds a tensor of dtype " + s + ", which loom does not read");
}

//! One tensor to write or that was read.
struct StoredTensor {
  DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<char> bytes;  // read: the data; write: ignored when `data` is set
  const void* data = nullptr;
  std::size_t size_bytes() const { return data ? byte_count : bytes.size(); }
  std::size_t byte_count = 0;
};

//! Writes file atomically (file.tmp, then rename) with tensors in the order given.
inline void write_safetensors(const std::string& file, const std::vector<std::pair<std::string, StoredTensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::size_t at = 0;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", safetensors_dtype(t.dtype)}, {"shape", t.shape}, {"data_offsets", {at, at + t.size_bytes()}}};
    at += t.size_bytes();
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // align the data to 8 bytes
  const std::string tmp = file + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error("loom: cannot write " + tmp);
    const std::uint64_t n = h.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
    f.write(reinterpret_cast<const char*>(len), 8);
    f.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const auto& [name, t] : tensors)
      f.write(t.data ? static_cast<const char*>(t.data) : t.bytes.data(), static_cast<std::streamsize>(t.size_bytes()));
    f.flush();
    if (!f) throw Error("loom: writing " + tmp + " failed (disk full?)");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file, ec);
  if (ec) throw Error("loom: cannot rename " + tmp + " to " + file + ": " + ec.message());
}

//! Reads every tensor of a safetensors file; a truncated or malformed file is an error naming it.
inline std::map<std::string, StoredTensor> read_safetensors(const std::string& file) {
  std::ifstream f(file, std::ios::binary);
  if (!f) throw Error("loom: cannot open " + file);
  unsigned char len[8];
  if (!f.read(reinterpret_cast<char*>(len), 8)) throw Error("loom: " + file + " is not a safetensors file (too short)");
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t{len[i]} << (8 * i);
  const auto size = std::filesystem::file_size(file);
  if (n > size - 8) throw Error("loom: " + file + " is not a safetensors file (header of " + std::to_string(n) + " bytes)");
  std::string h(n, '\0');
  f.read(h.data(), static_cast<std::streamsize>(n));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(h);
  } catch (const std::exception& e) {
    throw Error("loom: " + file + " has a malformed header: " + e.what());
  }
  const std::uint64_t data_at = 8 + n;
  std::map<std::string, StoredTensor> out;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    StoredTensor t;
    t.dtype = parse_safetensors_dtype(v.at("dtype").get<std::string>(), file);
    t.shape = v.at("shape").get<std::vector<std::int64_t>>();
    const auto b = v.at("data_offsets")[0].get<std::uint64_t>(), e = v.at("data_offsets")[1].get<std::uint64_t>();
    std::uint64_t expect = size_of(t.dtype);
    for (auto s : t.shape) expect *= static_cast<std::uint64_t>(s);
    if (e < b || e - b != expect || data_at + e > size)
      throw Error("loom: " + file + ": tensor " + name + " has byte range [" + std::to_string(b) + ", " +
                  std::to_string(e) + ") which does not fit its shape or the file (truncated?)");
    t.bytes.resize(e - b);
    f.seekg(static_cast<std::streamoff>(data_at + b));
    f.read(t.bytes.data(), static_cast<std::streamsize>(e - b));
    if (!f) throw Error("loom: " + file + ": reading tensor " + name + " failed");
    out.emplace(name, std::move(t));
  }
  return out;
}

}  // namespace loom::checkpoint

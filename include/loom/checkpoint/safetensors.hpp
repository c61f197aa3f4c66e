// The safetensors format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
// and byte range, then the raw little-endian data. Writing goes to a temporary name that is then renamed, so an
// interrupted write never leaves a half-written file in place. Needs nlohmann-json.
#pragma once

#include <loom/core/half.hpp>
#include <loom/core/error.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
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

//! The DType of a safetensors dtype name; one loom does not read is an error naming the file (and the tensor).
inline DType parse_safetensors_dtype(const std::string& s, const std::string& file, const std::string& tensor = {}) {
  for (DType d : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64})
    if (s == safetensors_dtype(d)) return d;
  if (tensor.empty()) throw Error("loom: " + file + " holds a tensor of dtype " + s + ", which loom does not read");
  throw Error("loom: " + file + ": tensor '" + tensor + "' has dtype " + s + ", which loom does not read");
}

//! F32, F64, BF16 and F16: the dtypes a model's parameters can be read from.
constexpr bool is_floating(DType d) {
  return d == DType::f32 || d == DType::f64 || d == DType::bf16 || d == DType::f16;
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

//! What a safetensors header says of one tensor: its name, dtype, shape and bytes.
struct SafetensorsEntry {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::size_t bytes;
};

//! The bytes a safetensors file starts with: the header's length (8 bytes, little-endian) and the header, padded to
//! 8 bytes, for tensors whose data follows in the order given.
inline std::string safetensors_prefix(const std::vector<SafetensorsEntry>& tensors,
                                      const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::size_t at = 0;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", safetensors_dtype(t.dtype)}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes}}};
    at += t.bytes;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // align the data to 8 bytes
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[std::size_t(i)] = static_cast<char>(std::uint64_t(h.size()) >> (8 * i));
  return out + h;
}

//! Writes file atomically (file.tmp, then rename) with tensors in the order given.
inline void write_safetensors(const std::string& file, const std::vector<std::pair<std::string, StoredTensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : tensors) entries.push_back({name, t.dtype, t.shape, t.size_bytes()});
  const std::string prefix = safetensors_prefix(entries, metadata);
  const std::string tmp = file + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error("loom: cannot write " + tmp);
    f.write(prefix.data(), static_cast<std::streamsize>(prefix.size()));
    for (const auto& [name, t] : tensors)
      f.write(t.data ? static_cast<const char*>(t.data) : t.bytes.data(), static_cast<std::streamsize>(t.size_bytes()));
    f.flush();
    if (!f) throw Error("loom: writing " + tmp + " failed (disk full?)");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file, ec);
  if (ec) throw Error("loom: cannot rename " + tmp + " to " + file + ": " + ec.message());
}

}  // namespace loom::checkpoint

namespace loom::detail {

//! "[2, 3]": a shape as the messages print it.
inline std::string safetensors_shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

//! Sets out to j when j is a non-negative integer; false when it is not.
inline bool json_non_negative(const nlohmann::json& j, std::uint64_t& out) {
  if (j.is_number_unsigned()) {
    out = j.get<std::uint64_t>();
    return true;
  }
  if (!j.is_number_integer() || j.get<std::int64_t>() < 0) return false;
  out = static_cast<std::uint64_t>(j.get<std::int64_t>());
  return true;
}

}  // namespace loom::detail

namespace loom::checkpoint {

//! Reads every tensor of a safetensors file. A file that is truncated, or whose header is malformed (a tensor
//! without a dtype, shape or data_offsets, or with one of the wrong type, a negative dimension, a byte range that
//! runs backwards, does not match its dtype and shape, overlaps another's or reaches past the end of the file), is
//! an error naming the file and the tensor.
inline std::map<std::string, StoredTensor> read_safetensors(const std::string& file) {
  using loom::detail::cat;
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec))
    throw Error("loom: " + file + " is a directory, not a safetensors file");
  std::ifstream f(file, std::ios::binary);
  if (!f) throw Error("loom: cannot open " + file);
  const std::uint64_t size = std::filesystem::file_size(file, ec);
  if (ec) throw Error("loom: cannot read the size of " + file + ": " + ec.message());
  if (size < 8)
    throw Error(cat("loom: ", file, " is not a safetensors file (truncated?): it holds ", size,
                    " bytes, fewer than the 8 of its header length"));
  unsigned char len[8];
  if (!f.read(reinterpret_cast<char*>(len), 8)) throw Error("loom: reading " + file + " failed");
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t{len[i]} << (8 * i);
  if (n > size - 8)
    throw Error(cat("loom: ", file, " is not a safetensors file (truncated?): its header length is ", n,
                    " bytes but only ", size - 8, " bytes follow"));
  std::string h(n, '\0');
  if (!f.read(h.data(), static_cast<std::streamsize>(n)))
    throw Error("loom: reading the header of " + file + " failed");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(h);
  } catch (const std::exception& e) {
    throw Error("loom: " + file + " has a malformed header: " + e.what());
  }
  if (!header.is_object()) throw Error("loom: " + file + " has a malformed header: it is not a JSON object");
  const std::uint64_t data_at = 8 + n, data_size = size - data_at;
  struct Range {
    std::uint64_t begin, end;
    std::string name;
  };
  std::vector<Range> ranges;
  std::map<std::string, StoredTensor> out;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string at = "loom: " + file + ": tensor '" + name + "' ";
    if (!v.is_object()) throw Error(at + "is described by " + v.dump() + ", not by an object");
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!v.contains(key)) throw Error(at + "has no " + key);
    const auto& dtype = v["dtype"];
    if (!dtype.is_string()) throw Error(at + "has dtype " + dtype.dump() + ", which is not a string");
    StoredTensor t;
    t.dtype = parse_safetensors_dtype(dtype.get<std::string>(), file, name);
    const auto& shape = v["shape"];
    if (!shape.is_array() ||
        !std::all_of(shape.begin(), shape.end(), [](const auto& d) { return d.is_number_integer(); }))
      throw Error(at + "has shape " + shape.dump() + ", which is not a list of integers");
    std::uint64_t expect = size_of(t.dtype);
    for (const auto& d : shape) {
      std::uint64_t u = 0;
      if (!loom::detail::json_non_negative(d, u))
        throw Error(at + "has a negative dimension in its shape " + shape.dump());
      if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
          (u != 0 && expect > std::numeric_limits<std::uint64_t>::max() / u))
        throw Error(at + "has shape " + shape.dump() + ", too large to be held in memory");
      t.shape.push_back(static_cast<std::int64_t>(u));
      expect *= u;
    }
    const auto& offsets = v["data_offsets"];
    std::uint64_t b = 0, e = 0;
    if (!offsets.is_array() || offsets.size() != 2 || !loom::detail::json_non_negative(offsets[0], b) ||
        !loom::detail::json_non_negative(offsets[1], e))
      throw Error(at + "has data_offsets " + offsets.dump() + ", which are not two non-negative integers");
    if (e < b) throw Error(cat(at, "has data_offsets [", b, ", ", e, "], which end before they begin"));
    if (e - b != expect)
      throw Error(cat(at, "has data_offsets [", b, ", ", e, "], ", e - b, " bytes, but its dtype ",
                      safetensors_dtype(t.dtype), " and shape ", loom::detail::safetensors_shape_text(t.shape),
                      " need ", expect));
    ranges.push_back({b, e, name});
    out.emplace(name, std::move(t));
  }
  // In the order of the data: the first tensor the end of the file cuts, or the first that overlaps the one before.
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& x, const Range& y) { return x.begin != y.begin ? x.begin < y.begin : x.end < y.end; });
  const Range* last = nullptr;  // the non-empty range before
  for (const Range& r : ranges) {
    if (r.end > data_size)
      throw Error(cat("loom: ", file, ": tensor '", r.name, "' has data_offsets [", r.begin, ", ", r.end,
                      "], past the end of the ", data_size, " bytes of data the file holds (truncated?)"));
    if (r.begin == r.end) continue;
    if (last && r.begin < last->end)
      throw Error(cat("loom: ", file, ": tensor '", r.name, "' (data_offsets [", r.begin, ", ", r.end,
                      "]) overlaps tensor '", last->name, "' (data_offsets [", last->begin, ", ", last->end, "])"));
    last = &r;
  }
  for (const Range& r : ranges) {
    auto& bytes = out.at(r.name).bytes;
    bytes.resize(r.end - r.begin);
    f.seekg(static_cast<std::streamoff>(data_at + r.begin));
    f.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f) throw Error("loom: " + file + ": reading tensor '" + r.name + "' failed");
  }
  return out;
}

}  // namespace loom::checkpoint

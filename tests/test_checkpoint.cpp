// Checkpoint files: safetensors round-trip; a truncated file or a malformed header is an error naming the file and
// the tensor; a GPT checkpoint whose config.json lacks a key or holds one of the wrong type, or whose weights are
// integers, is refused with the key or the tensor named.
#include "catch.hpp"
#include "temp_dir.hpp"

#include <loom/models/gpt/checkpoint.hpp>
#include <loom/models/gpt.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>

using namespace loom;

namespace {

//! A safetensors file with the header text given as is (no check, no padding) and `data` bytes after it.
void write_raw(const std::string& file, const std::string& header, std::size_t data) {
  std::ofstream f(file, std::ios::binary | std::ios::trunc);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>(n >> (8 * i)));
  f << header << std::string(data, '\0');
  REQUIRE(f.good());
}

//! The message read_safetensors throws for `header` over `data` bytes, "" when it reads the file.
std::string read_error(const std::string& file, const std::string& header, std::size_t data) {
  write_raw(file, header, data);
  try {
    checkpoint::read_safetensors(file);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("safetensors files round-trip and are written atomically", "[checkpoint]") {
  test::TempDir dir;
  const auto file = dir / "w.safetensors";
  std::vector<float> w{1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f};
  std::vector<double> b{1e-300, 2.0};
  checkpoint::StoredTensor tw{DType::f32, {2, 3}, {}, w.data(), w.size() * 4};
  checkpoint::StoredTensor tb{DType::f64, {2}, {}, b.data(), b.size() * 8};
  checkpoint::write_safetensors(file, {{"w", tw}, {"b", tb}}, {{"format", "pt"}});
  CHECK(!std::filesystem::exists(file + ".tmp"));
  auto r = checkpoint::read_safetensors(file);
  REQUIRE(r.size() == 2);
  CHECK(r.at("w").shape == std::vector<std::int64_t>{2, 3});
  CHECK(r.at("w").dtype == DType::f32);
  CHECK(r.at("b").dtype == DType::f64);
  REQUIRE(r.at("w").bytes.size() == 24);
  REQUIRE(r.at("b").bytes.size() == 16);
  CHECK(std::memcmp(r.at("w").bytes.data(), w.data(), 24) == 0);
  CHECK(std::memcmp(r.at("b").bytes.data(), b.data(), 16) == 0);
}

TEST_CASE("a truncated safetensors file is refused wherever it was cut", "[checkpoint]") {
  test::TempDir dir;
  const auto file = dir / "cut.safetensors";
  // "z" comes first in the data and last by name (the reader sees the header's keys sorted): the message names the
  // tensor the cut reaches first in the data, whatever the order of the names.
  std::vector<float> z{1, 2, 3};  // data bytes [0, 12)
  std::vector<double> a{4, 5};    // data bytes [12, 28)
  checkpoint::write_safetensors(file, {{"z", {DType::f32, {3}, {}, z.data(), 12}},
                                       {"a", {DType::f64, {2}, {}, a.data(), 16}}});
  const auto whole = std::filesystem::file_size(file);
  const std::uint64_t header = whole - 8 - 28;  // the JSON header's length, padded by the writer
  REQUIRE(checkpoint::read_safetensors(file).size() == 2);
  auto cut = [&](std::uint64_t size) {
    std::filesystem::resize_file(file, size);
    std::string msg;
    try {
      checkpoint::read_safetensors(file);
    } catch (const Error& e) {
      msg = e.what();
    }
    // put the bytes back for the next cut
    checkpoint::write_safetensors(file, {{"z", {DType::f32, {3}, {}, z.data(), 12}},
                                         {"a", {DType::f64, {2}, {}, a.data(), 16}}});
    return msg;
  };
  const std::string f = "loom: " + file;
  CHECK(cut(0) == f + " is not a safetensors file (truncated?): it holds 0 bytes, fewer than the 8 of its header "
                      "length");
  CHECK(cut(5) == f + " is not a safetensors file (truncated?): it holds 5 bytes, fewer than the 8 of its header "
                      "length");
  CHECK(cut(8 + header / 2) == f + " is not a safetensors file (truncated?): its header length is " +
                                   std::to_string(header) + " bytes but only " + std::to_string(header / 2) +
                                   " bytes follow");
  CHECK(cut(8 + header) == f + ": tensor 'z' has data_offsets [0, 12], past the end of the 0 bytes of data the file "
                               "holds (truncated?)");
  CHECK(cut(8 + header + 6) == f + ": tensor 'z' has data_offsets [0, 12], past the end of the 6 bytes of data the "
                                   "file holds (truncated?)");
  CHECK(cut(8 + header + 17) == f + ": tensor 'a' has data_offsets [12, 28], past the end of the 17 bytes of data "
                                    "the file holds (truncated?)");
  CHECK(cut(whole - 1) == f + ": tensor 'a' has data_offsets [12, 28], past the end of the 27 bytes of data the "
                              "file holds (truncated?)");
}

TEST_CASE("a malformed safetensors header is refused naming the file and the tensor", "[checkpoint]") {
  test::TempDir dir;
  const auto file = dir / "bad.safetensors";
  const std::string w = "loom: " + file + ": tensor 'w' ";
  // What is missing.
  CHECK(read_error(file, R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", 8) == w + "has no dtype");
  CHECK(read_error(file, R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", 8) == w + "has no shape");
  CHECK(read_error(file, R"({"w": {"dtype": "F32", "shape": [2]}})", 8) == w + "has no data_offsets");
  CHECK(read_error(file, R"({"w": [0, 8]})", 8) == w + "is described by [0,8], not by an object");
  // What has the wrong type.
  CHECK(read_error(file, R"({"w": {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}})", 8) ==
        w + "has dtype 4, which is not a string");
  CHECK(read_error(file, R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})", 8) ==
        w + "has dtype U8, which loom does not read");
  CHECK(read_error(file, R"({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}})", 8) ==
        w + "has shape \"2\", which is not a list of integers");
  CHECK(read_error(file, R"({"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}})", 8) ==
        w + "has shape [2.0], which is not a list of integers");
  CHECK(read_error(file, R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8]}})", 8) ==
        w + "has data_offsets [8], which are not two non-negative integers");
  CHECK(read_error(file, R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}})", 8) ==
        w + "has data_offsets [\"0\",\"8\"], which are not two non-negative integers");
  CHECK(read_error(file, R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})", 8) ==
        w + "has data_offsets [-8,0], which are not two non-negative integers");
  // Negative dimensions: [-2, -1] holds 2 elements if the signs are dropped, and wraps to huge ones as uint64.
  CHECK(read_error(file, R"({"w": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}})", 8) ==
        w + "has a negative dimension in its shape [-2,-1]");
  // Byte ranges: backwards, of the wrong size, overlapping, past the end.
  CHECK(read_error(file, R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", 8) ==
        w + "has data_offsets [8, 0], which end before they begin");
  CHECK(read_error(file, R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", 8) ==
        w + "has data_offsets [0, 4], 4 bytes, but its dtype F32 and shape [2] need 8");
  CHECK(read_error(file,
                   R"({"v": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                       "w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                   12) == w + "(data_offsets [4, 12]) overlaps tensor 'v' (data_offsets [0, 8])");
  CHECK(read_error(file,
                   R"({"v": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                       "w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                   12) == w + "has data_offsets [8, 16], past the end of the 12 bytes of data the file holds "
                              "(truncated?)");
  CHECK(read_error(file, R"([1, 2])", 0) == "loom: " + file + " has a malformed header: it is not a JSON object");
  // The same tensors, well formed, are read (an empty tensor may share an offset with another).
  CHECK(read_error(file,
                   R"({"__metadata__": {"format": "pt"}, "e": {"dtype": "I64", "shape": [0, 3], "data_offsets": [8, 8]},
                       "v": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                       "w": {"dtype": "I32", "shape": [1, 2], "data_offsets": [8, 16]}})",
                   16) == "");
  CHECK(read_error(file, "", 0).find("loom: " + file + " has a malformed header: ") == 0);
  REQUIRE_THROWS_WITH(checkpoint::read_safetensors(dir.path().string()),
                      "loom: " + dir.path().string() + " is a directory, not a safetensors file");
}

namespace {

constexpr models::GptShape mha{1, 2, 2, 8, 11, 6};
constexpr models::GptShape gqa{1, 4, 2, 16, 13, 8};  // 4 query heads over 2 key/value heads

//! Replaces DIR/config.json by what edit makes of it.
template <class F>
void edit_config(const std::string& dir, F&& edit) {
  nlohmann::json c;
  {
    std::ifstream f(dir + "/config.json");
    c = nlohmann::json::parse(f);
  }
  edit(c);
  std::ofstream(dir + "/config.json", std::ios::trunc) << c.dump(2);
}

template <models::GptShape S>
std::string load_error(const std::string& dir) {
  models::Gpt<S, float> m(2);
  try {
    checkpoint::load_gpt(dir, m);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("config.json: a missing key or one of the wrong type is named", "[checkpoint][gpt]") {
  test::TempDir tmp;
  const std::string dir = tmp / "ckpt";
  models::Gpt<mha, float> a(1);
  checkpoint::save_gpt(dir, a);
  REQUIRE(load_error<mha>(dir).empty());
  const std::string cfg = "loom: " + dir + "/config.json";

  edit_config(dir, [](auto& c) { c.erase("n_embd"); });
  CHECK(load_error<mha>(dir) == cfg + " has no n_embd (the model has n_embd = 8)");
  edit_config(dir, [](auto& c) { c["n_embd"] = 8; c.erase("vocab_size"); });
  CHECK(load_error<mha>(dir) == cfg + " has no vocab_size (the model has vocab_size = 11)");
  edit_config(dir, [](auto& c) { c["vocab_size"] = 11; c["n_layer"] = "1"; });
  CHECK(load_error<mha>(dir) == cfg + " has n_layer = \"1\", which is not an integer (the model has n_layer = 1)");
  edit_config(dir, [](auto& c) { c["n_layer"] = 1; c["n_head"] = 2.0; });
  CHECK(load_error<mha>(dir) == cfg + " has n_head = 2.0, which is not an integer (the model has n_head = 2)");
  edit_config(dir, [](auto& c) { c["n_head"] = 2; c["n_positions"] = nullptr; });
  CHECK(load_error<mha>(dir) == cfg + " has n_positions = null, which is not an integer (the model has n_positions "
                                      "= 6)");
  edit_config(dir, [](auto& c) { c["n_positions"] = -6; });
  CHECK(load_error<mha>(dir) == cfg + " has n_positions = -6 but the model has 6");
  // n_inner may be null, as Hugging Face writes it: 4 n_embd.
  edit_config(dir, [](auto& c) { c["n_positions"] = 6; c["n_inner"] = nullptr; });
  CHECK(load_error<mha>(dir).empty());
  edit_config(dir, [](auto& c) { c["n_inner"] = 16; });
  CHECK(load_error<mha>(dir) == cfg + " has n_inner = 16 but the model has 32");
  edit_config(dir, [](auto& c) { c = nlohmann::json::array({1, 2}); });
  CHECK(load_error<mha>(dir) == cfg + " is not a JSON object");

  // Without n_kv_head every head has its own keys and values, which a grouped-query model does not.
  const std::string gdir = tmp / "gqa";
  models::Gpt<gqa, float> g(1);
  checkpoint::save_gpt(gdir, g);
  REQUIRE(load_error<gqa>(gdir).empty());
  edit_config(gdir, [](auto& c) { c.erase("n_kv_head"); });
  CHECK(load_error<gqa>(gdir) == "loom: " + gdir + "/config.json has no n_kv_head (so n_kv_head = n_head = 4) but "
                                                   "the model has n_kv_head = 2");
}

TEST_CASE("an integer tensor where the model reads weights is refused", "[checkpoint][gpt]") {
  test::TempDir tmp;
  const std::string dir = tmp / "ckpt";
  models::Gpt<mha, float> a(1);
  checkpoint::save_gpt(dir, a);
  const std::string file = dir + "/model.safetensors";
  auto stored = checkpoint::read_safetensors(file);
  // wpe.weight as I32 of the same shape and size, every other tensor as it was.
  std::vector<std::pair<std::string, checkpoint::StoredTensor>> tensors;
  for (auto& [name, t] : stored) {
    if (name == "wpe.weight") t.dtype = DType::i32;
    tensors.emplace_back(name, std::move(t));
  }
  checkpoint::write_safetensors(file, tensors);
  CHECK(load_error<mha>(dir) == "loom: " + file + ": tensor 'wpe.weight' has dtype I32, an integer dtype, where the "
                                                  "model reads floating-point weights into F32");
  for (auto& [name, t] : tensors)
    if (name == "wpe.weight") t.dtype = DType::f32;
  checkpoint::write_safetensors(file, tensors);
  CHECK(load_error<mha>(dir).empty());
}

// Tensors and their views, host memory accounting, the data loader's batch order, and safetensors files.
#include "catch.hpp"

#include <loom/checkpoint/safetensors.hpp>
#include <loom/tensor/tensor.hpp>
#include <loom/train/data.hpp>

#include <filesystem>
#include <fstream>

using namespace loom;

TEST_CASE("tensor views share storage and index by strides", "[tensor]") {
  Tensor<float> t({2, 3, 4});
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<float>(i);
  CHECK(t(1, 2, 3) == 23.0f);
  CHECK(t.strides() == Shape{12, 4, 1});
  auto v = t.view({6, -1});
  CHECK(v.shape() == Shape{6, 4});
  CHECK(v(5, 1) == 21.0f);
  auto s = t.slice(2, 1, 3);  // non-contiguous
  CHECK(s.shape() == Shape{2, 3, 2});
  CHECK(!s.is_contiguous());
  CHECK(s(1, 0, 1) == 14.0f);
  auto row = t.select(0, 1).select(0, 2);
  CHECK(row.shape() == Shape{4});
  CHECK(row(0) == 20.0f);
  row(0) = -1.0f;  // writes through to t
  CHECK(t(1, 2, 0) == -1.0f);
  auto c = s.clone();
  CHECK(c.is_contiguous());
  CHECK(c(1, 2, 1) == t(1, 2, 2));
  c(0, 0, 0) = 99.0f;
  CHECK(t(0, 0, 1) == 1.0f);  // clone does not share
  s.fill(7.0f);
  CHECK(t(0, 1, 1) == 7.0f);
  CHECK(t(0, 1, 0) == 4.0f);
}

TEST_CASE("bad shapes and indices are reported with their values", "[tensor]") {
  Tensor<double> t({4, 5});
  CHECK_THROWS_WITH(t.view({3, -1}), "loom: view: shape [3, 6] does not hold the 20 elements of [4, 5]");
  CHECK_THROWS_WITH(t.slice(1, 2, 9), "loom: slice [2, 9) of dimension 1 of shape [4, 5]");
  CHECK_THROWS_WITH(t.slice(1, 0, 2).view({10}), "loom: view of a non-contiguous tensor of shape [4, 2]");
}

TEST_CASE("host memory is counted with its peak", "[tensor]") {
  const auto before = host_memory().in_use();
  host_memory().reset_peak();
  {
    Tensor<float> a({1024});
    CHECK(host_memory().in_use() == before + 4096);
    Tensor<float> b({256});
    CHECK(host_memory().peak() == before + 4096 + 1024);
  }
  CHECK(host_memory().in_use() == before);
  CHECK(host_memory().peak() == before + 5120);
}

TEST_CASE("sequential batches follow the documented window formula", "[data]") {
  std::vector<std::int32_t> tok(100);
  for (int i = 0; i < 100; ++i) tok[i] = i;
  train::Batches b(tok, 3, 8);
  // row r of batch b starts at ((b*B + r)*T) mod (N - T - 1) = ((b*3 + r)*8) mod 91
  CHECK(b.start(0, 0) == 0);
  CHECK(b.start(0, 2) == 16);
  CHECK(b.start(4, 1) == (13 * 8) % 91);
  std::vector<std::int32_t> in(8), tg(8);
  b.fill(4, 1, 1, in.data(), tg.data());
  CHECK(in[0] == 13);
  CHECK(tg[7] == 21);
  train::Batches s(tok, 3, 8, train::BatchOrder::shuffle, 7), s2(tok, 3, 8, train::BatchOrder::shuffle, 7),
      s3(tok, 3, 8, train::BatchOrder::shuffle, 8);
  CHECK(s.start(5, 2) == s2.start(5, 2));
  CHECK((s.start(5, 2) != s3.start(5, 2) || s.start(6, 0) != s3.start(6, 0)));
  CHECK_THROWS_WITH(train::Batches(std::vector<std::int32_t>(5), 1, 8),
                    "loom: the data holds 5 tokens, too few for one sequence of 8 tokens and its targets (10 needed)");
}

TEST_CASE("data files: missing and empty ones are errors; the built-in corpus is deterministic", "[data]") {
  CHECK_THROWS_WITH(train::read_bytes("/nonexistent/x"), "loom: cannot open the data file '/nonexistent/x'");
  const auto empty = std::filesystem::temp_directory_path() / "loom-empty.txt";
  std::ofstream(empty).close();
  CHECK_THROWS_WITH(train::read_bytes(empty.string()), "loom: the data file '" + empty.string() + "' is empty");
  const auto a = train::builtin_corpus(5000), b = train::builtin_corpus(5000);
  CHECK(a == b);
  CHECK(a.size() >= 5000);
  CHECK(std::all_of(a.begin(), a.end(), [](auto t) { return t > 0 && t < 128; }));
}

TEST_CASE("safetensors files round-trip and are written atomically", "[checkpoint]") {
  const auto file = (std::filesystem::temp_directory_path() / "loom-test.safetensors").string();
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
  CHECK(std::memcmp(r.at("w").bytes.data(), w.data(), 24) == 0);
  CHECK(std::memcmp(r.at("b").bytes.data(), b.data(), 16) == 0);
  // A truncated file is reported, not read past its end.
  std::filesystem::resize_file(file, std::filesystem::file_size(file) - 4);
  std::string msg;
  try {
    checkpoint::read_safetensors(file);
  } catch (const Error& e) {
    msg = e.what();
  }
  CHECK(msg.find("does not fit its shape or the file (truncated?)") != std::string::npos);
}

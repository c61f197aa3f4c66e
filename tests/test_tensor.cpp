// Tensors and their views, host memory accounting, the data loader's batch order and its files (safetensors files:
// test_checkpoint.cpp).
#include "catch.hpp"
#include "temp_dir.hpp"

#include <loom/tensor/tensor.hpp>
#include <loom/train/data.hpp>

#include <algorithm>
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

TEST_CASE("data files: a missing or empty file and a directory are errors; the built-in corpus is deterministic",
          "[data]") {
  test::TempDir dir;
  const std::string missing = dir / "missing.txt";
  CHECK_THROWS_WITH(train::read_bytes(missing), "loom: cannot open the data file '" + missing + "'");
  const std::string empty = dir / "empty.txt";
  std::ofstream(empty).close();
  CHECK_THROWS_WITH(train::read_bytes(empty), "loom: the data file '" + empty + "' is empty");
  CHECK_THROWS_WITH(train::read_bytes(dir.path().string()),
                    "loom: the data path '" + dir.path().string() + "' is a directory, not a file");
  const auto a = train::builtin_corpus(5000), b = train::builtin_corpus(5000);
  CHECK(a == b);
  CHECK(a.size() >= 5000);
  CHECK(std::all_of(a.begin(), a.end(), [](auto t) { return t > 0 && t < 128; }));
}

TEST_CASE("a data file too short for one sequence is refused with its name", "[data]") {
  test::TempDir dir;
  const std::string file = dir / "short.txt";
  for (const int bytes : {1, 9, 10}) {
    INFO(bytes << " bytes");
    std::ofstream(file, std::ios::binary | std::ios::trunc) << std::string(static_cast<std::size_t>(bytes), 'x');
    const auto tokens = train::read_bytes(file);
    REQUIRE(tokens.size() == static_cast<std::size_t>(bytes));
    // A sequence of 8 inputs, their 8 targets (one token later), and a window start mod N - 8 - 1 > 0: 10 tokens.
    if (bytes < 10) {
      CHECK_THROWS_WITH(train::Batches(tokens, 2, 8, train::BatchOrder::sequential, 0, file),
                        "loom: the data file '" + file + "' holds " + std::to_string(bytes) +
                            " tokens, too few for one sequence of 8 tokens and its targets (10 needed)");
    } else {
      const train::Batches b(tokens, 2, 8, train::BatchOrder::sequential, 0, file);
      CHECK(b.start(3, 1) == 0);  // (3*2 + 1)*8 mod 1
    }
  }
}

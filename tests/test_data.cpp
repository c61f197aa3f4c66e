// Training data and its schedule: llm.c's token shards (written, mapped, read back as one stream, refused with the
// file's name when broken) drawn into the same batches as one buffer of the same tokens, the learning-rate schedules
// against values worked out by hand, and validation through the trainer, equal on every layout.
#include "catch.hpp"
#include "temp_dir.hpp"

#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/data/shards.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/optim/schedule.hpp>
#include <loom/train/data.hpp>
#include <loom/train/trainer.hpp>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

using namespace loom;

namespace {

//! What `f` throws, or "" when it does not.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::vector<std::int32_t> counting(int n, int from, int mod) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) t[std::size_t(i)] = (from + i * 7) % mod;
  return t;
}

}  // namespace

TEST_CASE("token shards read back as one stream and give the batches one buffer of their tokens gives", "[data]") {
  const test::TempDir dir("shards");
  const auto a = counting(1000, 0, 50000), b = counting(777, 3, 50000), c = counting(500, 70000, 100000);
  data::write_shard(dir / "train_000000.bin", a);
  data::write_shard(dir / "train_000001.bin", b);
  data::write_shard(dir / "train_000002.bin", c);  // tokens above 65535: version 2
  const auto paths = data::expand_glob(dir / "train_*.bin");
  REQUIRE(paths.size() == 3);
  CHECK(paths[0].ends_with("train_000000.bin"));
  CHECK(data::Shard(paths[0]).version() == 1);
  CHECK(data::Shard(paths[2]).version() == 2);
  std::vector<std::int32_t> all(a);
  all.insert(all.end(), b.begin(), b.end());
  all.insert(all.end(), c.begin(), c.end());
  for (auto order : {train::BatchOrder::sequential, train::BatchOrder::shuffle}) {
    const data::TokenShards shards(paths, 8, 16, order, 11);
    const train::Batches batches(all, 8, 16, order, 11);
    REQUIRE(shards.tokens() == std::int64_t(all.size()));
    for (std::int64_t i = 0; i < shards.tokens(); i += 97) CHECK(shards.token(i) == all[std::size_t(i)]);
    for (int step : {0, 1, 5, 40}) {
      std::vector<std::int32_t> in1(3 * 16), tg1(in1.size()), in2(in1.size()), tg2(in1.size());
      shards.fill(step, 2, 3, in1.data(), tg1.data());
      batches.fill(step, 2, 3, in2.data(), tg2.data());
      CHECK(in1 == in2);
      CHECK(tg1 == tg2);
    }
  }
}

TEST_CASE("a broken shard is refused with its name and what is wrong", "[data]") {
  const test::TempDir dir("bad-shards");
  data::write_shard(dir / "good.bin", counting(100, 0, 300));
  {  // truncated: the header counts 100 tokens, the file holds 60
    std::ifstream in(dir / "good.bin", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(dir / "short.bin", std::ios::binary).write(bytes.data(), 1024 + 120);
    bytes[0] = 'x';
    std::ofstream(dir / "magic.bin", std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
    bytes = std::string(bytes.size(), '\0');
    const std::int32_t h[2] = {data::shard_magic, 7};
    std::memcpy(bytes.data(), h, sizeof h);
    std::ofstream(dir / "version.bin", std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
    std::ofstream(dir / "tiny.bin", std::ios::binary).write(bytes.data(), 10);
  }
  CHECK_THAT(error_of([&] { data::Shard(dir / "short.bin"); }),
             Catch::Contains("short.bin' has 1144 bytes but its header counts 100 tokens") &&
                 Catch::Contains("truncated"));
  CHECK_THAT(error_of([&] { data::Shard(dir / "magic.bin"); }),
             Catch::Contains("magic.bin' starts with") && Catch::Contains("not the magic 20240520"));
  CHECK_THAT(error_of([&] { data::Shard(dir / "version.bin"); }), Catch::Contains("version.bin' has version 7"));
  CHECK_THAT(error_of([&] { data::Shard(dir / "tiny.bin"); }),
             Catch::Contains("tiny.bin' holds 10 bytes, less than its 1024-byte header"));
  CHECK_THAT(error_of([&] { data::Shard(dir / "missing.bin"); }),
             Catch::Contains("cannot open the token shard '" + dir / "missing.bin"));
  CHECK_THAT(error_of([&] { data::expand_glob(dir / "val_*.bin"); }),
             Catch::Contains("the data pattern '" + dir / "val_*.bin" + "' names no file"));
  // A token at or above the model's vocabulary, named with its shard and position.
  const data::TokenShards shards({dir / "good.bin"}, 2, 8, train::BatchOrder::sequential, 0, 200);
  std::vector<std::int32_t> in(16), tg(16);
  CHECK_THAT(error_of([&] {
               for (int s = 0; s < 20; ++s) shards.fill(s, 0, 2, in.data(), tg.data());
             }),
             Catch::Contains("good.bin' holds token 2") && Catch::Contains("at or above the model's vocabulary of 200"));
}

TEST_CASE("learning-rate schedules take the values worked out by hand", "[data][schedule]") {
  using optim::LrShape;
  optim::LrSchedule s{LrShape::cosine, 1e-3, 1e-4, 10, 110};
  s.check();
  CHECK(s(0) == Approx(1e-4).epsilon(1e-12));  // warm-up: (s + 1) / 10 of the peak
  CHECK(s(4) == Approx(5e-4).epsilon(1e-12));
  CHECK(s(9) == Approx(1e-3).epsilon(1e-12));
  CHECK(s(10) == Approx(1e-3).epsilon(1e-12));     // p = 0
  CHECK(s(35) == Approx(8.6819805e-4).epsilon(1e-7));  // p = 1/4: 1e-4 + 9e-4 (1 + cos(pi/4)) / 2
  CHECK(s(60) == Approx(5.5e-4).epsilon(1e-12));   // p = 1/2
  CHECK(s(110) == Approx(1e-4).epsilon(1e-12));
  CHECK(s(500) == Approx(1e-4).epsilon(1e-12));
  s.shape = LrShape::linear;
  CHECK(s(60) == Approx(5.5e-4).epsilon(1e-12));
  CHECK(s(85) == Approx(3.25e-4).epsilon(1e-12));  // p = 3/4
  s.shape = LrShape::wsd;                          // the last 20% of the 100 decay steps fall
  CHECK(s(50) == Approx(1e-3).epsilon(1e-12));
  CHECK(s(90) == Approx(1e-3).epsilon(1e-12));
  CHECK(s(100) == Approx(5.5e-4).epsilon(1e-12));
  CHECK(s(110) == Approx(1e-4).epsilon(1e-12));
  s.shape = LrShape::constant;
  CHECK(s(1000) == Approx(1e-3).epsilon(1e-12));
  CHECK(optim::lr_shape_named("wsd") == LrShape::wsd);
  CHECK(!optim::lr_shape_named("step"));
  optim::LrSchedule bad{LrShape::cosine, 1e-3, 0, 10, 10};
  CHECK_THAT(error_of([&] { bad.check(); }),
             Catch::Contains("a cosine schedule decays until step 10, which must come after the 10 warm-up steps"));
  bad = {LrShape::linear, 1e-3, 2e-3, 0, 10};
  CHECK_THAT(error_of([&] { bad.check(); }), Catch::Contains("minimum learning rate must be in [0, lr = 0.001]"));
}

namespace {

constexpr models::GptShape small{4, 4, 2, 16, 61, 16};

//! Trains 3 steps of `small` on layout Cfg, from Batches, and evaluates validation batches 0 and 1 of `val` after
//! step 1 (or not); returns the three training losses and, when evaluated, the two validation losses.
template <class Cfg>
std::vector<double> run(const train::DataSource& train_data, const train::DataSource& val, bool validate) {
  using Model = models::Gpt<small, double, models::ModelLayout<Cfg>>;
  using Opt = optim::AdamW<double>;
  std::vector<double> out;
  run_local<Cfg>([&](auto& ctx) {
    typename train::Trainer<Cfg, Model, Opt>::Options o;
    o.seed = 4, o.step.batch = 8, o.step.seq = 8, o.step.micro_batches = 2;
    o.step.schedule = optim::LrSchedule{optim::LrShape::cosine, 1e-2, 1e-3, 1, 3};
    train::Trainer<Cfg, Model, Opt> trainer(ctx, train_data, o,
                                            [](const auto& specs, std::int64_t n) { return Opt(specs, n); });
    std::vector<double> mine;
    for (int s = 0; s < 3; ++s) {
      mine.push_back(trainer.step(s).loss);
      if (s == 1 && validate)
        for (int b = 0; b < 2; ++b) mine.push_back(trainer.evaluate(val, b));
    }
    if (ctx.rank() == 0) out = mine;
  });
  return out;
}

}  // namespace

TEST_CASE("validation loss is the same on every layout and leaves the model as it was", "[data][validation]") {
  const test::TempDir dir("val");
  data::write_shard(dir / "val_000000.bin", counting(600, 1, small.vocab));
  const data::TokenShards val(data::expand_glob(dir / "val_*.bin"), 8, 8);
  const train::Batches train_data(counting(3000, 2, small.vocab), 8, 8, train::BatchOrder::shuffle, 3);
  const auto one = run<Parallel<>>(train_data, val, true);
  const auto plain = run<Parallel<>>(train_data, val, false);
  const auto spread = run<Parallel<TP<2>, PP<2>, DP<2>>>(train_data, val, true);
  // Without a pipeline validation runs the forwards alone; ZeRO-3 gathers each unit for them, and releases what
  // KeepGathered would have kept for a backward.
  const auto sharded = run<Parallel<DP<4, ZeRO<3>, KeepGathered>>>(train_data, val, true);
  // With a pipeline, the forwards alone through it, on every placement of the chunks.
  const std::vector<std::vector<double>> pipelined{run<Parallel<PP<2, Interleaved<2>>, DP<2>>>(train_data, val, true),
                                                   run<Parallel<PP<2, ZeroBubbleV>>>(train_data, val, true),
                                                   run<Parallel<PP<4>>>(train_data, val, true),
                                                   run<Parallel<PP<2>, DP<2, ZeRO<3>, KeepGathered>>>(train_data, val, true)};
  REQUIRE(one.size() == 5);
  REQUIRE(spread.size() == 5);
  REQUIRE(sharded.size() == 5);
  // The training losses: step 2's follows the evaluation as it follows no evaluation.
  CHECK(one[0] == plain[0]);
  CHECK(one[1] == plain[1]);
  CHECK(one[4] == plain[2]);
  CHECK(one[2] != one[3]);  // two batches, two losses
  for (std::size_t i = 0; i < one.size(); ++i) {
    CHECK(spread[i] == Approx(one[i]).epsilon(1e-9));
    CHECK(sharded[i] == Approx(one[i]).epsilon(1e-9));
    for (const auto& p : pipelined) {
      REQUIRE(p.size() == 5);
      CHECK(p[i] == Approx(one[i]).epsilon(1e-9));
    }
  }
}

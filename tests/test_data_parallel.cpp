// Data parallelism: DP in {1, 2, 4, 8} x micro-batches in {1, 4} trains the same model as one rank with the same
// global batch (losses and every parameter, in double, dropout included); buckets partition the gradients; a rank
// that fails stops the others; a non-finite gradient skips the step on every rank alike.
#include "catch.hpp"

#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data_parallel.hpp>

#include <cmath>
#include <mutex>

using namespace loom;

namespace {

constexpr models::GptShape shape{2, 4, 2, 16, 37, 8};
using Model = models::Gpt<shape, double>;
constexpr int steps = 5, batch = 32, seq = 8;

models::GptOptions options() {
  models::GptOptions o;
  o.dropout = 0.1f;
  return o;
}

train::Batches data() {
  std::vector<std::int32_t> tok(3000);
  for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<std::int32_t>((i * i + 3 * i) % shape.vocab);
  return train::Batches(tok, batch, seq, train::BatchOrder::shuffle, 11);
}

struct Run {
  std::vector<double> losses;
  std::vector<double> params;
};

//! One rank, the whole batch, written directly against the model: the reference.
Run single_rank() {
  Model m(3, options());
  optim::AdamW<double> opt(m.specs(), shape.params(), {0.9, 0.999, 1e-8, 0.1});
  const auto d = data();
  std::vector<std::int32_t> in(batch * seq), tg(in.size());
  Run r;
  for (int s = 0; s < steps; ++s) {
    d.fill(s, 0, batch, in.data(), tg.data());
    m.zero_grad();
    r.losses.push_back(m.forward(in.data(), tg.data(), batch, seq, static_cast<std::uint64_t>(s), 0));
    m.backward();
    optim::clip_grad_norm(m.grads(), 1.0);
    opt.step(m.params(), m.grads(), 1e-2);
  }
  r.params.assign(m.params().data(), m.params().data() + m.params().numel());
  return r;
}

template <int N>
std::vector<Run> data_parallel(int micro_batches, std::size_t bucket_bytes, bool overlap) {
  std::vector<Run> runs(N);
  const auto d = data();
  run_local<Parallel<DP<N>>>([&](auto& ctx) {
    Model m(3, options());
    optim::AdamW<double> opt(m.specs(), shape.params(), {0.9, 0.999, 1e-8, 0.1});
    train::StepConfig cfg;
    cfg.batch = batch, cfg.seq = seq, cfg.micro_batches = micro_batches, cfg.lr = 1e-2, cfg.grad_clip = 1.0;
    cfg.bucket_bytes = bucket_bytes, cfg.overlap = overlap;
    auto& dp = ctx.template comm<Axis::dp>();
    train::DataParallelTrainer trainer(m, opt, dp, d, cfg);
    Run& r = runs[ctx.rank()];
    for (int s = 0; s < steps; ++s) {
      const auto res = trainer.step(s);
      if (res.skipped) throw Error("a step was skipped");
      r.losses.push_back(res.loss);
    }
    r.params.assign(m.params().data(), m.params().data() + m.params().numel());
  });
  return runs;
}

void check_same(const Run& ref, const std::vector<Run>& runs) {
  for (std::size_t r = 0; r < runs.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(runs[r].losses.size() == ref.losses.size());
    for (std::size_t s = 0; s < ref.losses.size(); ++s)
      CHECK(std::abs(runs[r].losses[s] - ref.losses[s]) <= 1e-9 * std::abs(ref.losses[s]));
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < ref.params.size(); ++i) {
      worst = std::max(worst, std::abs(runs[r].params[i] - ref.params[i]));
      scale = std::max(scale, std::abs(ref.params[i]));
    }
    INFO("largest parameter difference " << worst << " of " << scale);
    CHECK(worst <= 1e-9 * scale);
    // Every rank holds the same parameters, bit for bit.
    CHECK(runs[r].params == runs[0].params);
  }
}

}  // namespace

TEST_CASE("buckets partition the gradients in reverse parameter order", "[ddp]") {
  const auto specs = Model::param_specs();
  for (std::size_t bytes : {std::size_t{1}, std::size_t{4096}, std::size_t{25} << 20}) {
    const auto b = train::make_buckets(specs, sizeof(double), bytes);
    REQUIRE(!b.empty());
    CHECK(b.front().last == specs.size());
    CHECK(b.back().first == 0);
    CHECK(b.back().lo == 0);
    CHECK(b.front().hi == shape.params());
    for (std::size_t i = 0; i + 1 < b.size(); ++i) {
      CHECK(b[i].first == b[i + 1].last);
      CHECK(b[i].lo == b[i + 1].hi);
      CHECK(static_cast<std::size_t>(b[i].hi - b[i].lo) * sizeof(double) >= bytes);
    }
    if (bytes == 1) CHECK(b.size() == specs.size());
    if (bytes == (std::size_t{25} << 20)) CHECK(b.size() == 1);
  }
}

TEST_CASE("data parallel training equals the single-rank run", "[ddp]") {
  static const Run ref = single_rank();
  const int m = GENERATE(1, 4);
  INFO("micro-batches " << m);
  SECTION("DP 1") { check_same(ref, data_parallel<1>(m, 2048, true)); }
  SECTION("DP 2") { check_same(ref, data_parallel<2>(m, 2048, true)); }
  SECTION("DP 4") { check_same(ref, data_parallel<4>(m, 2048, true)); }
  SECTION("DP 8") { check_same(ref, data_parallel<8>(m, 2048, true)); }
  SECTION("DP 4, one bucket") { check_same(ref, data_parallel<4>(m, std::size_t{25} << 20, true)); }
  SECTION("DP 4, no overlap") { check_same(ref, data_parallel<4>(m, 2048, false)); }
}

TEST_CASE("a rank whose data ends early stops every rank with its message", "[ddp][failure]") {
  const auto d = data();
  std::string msg;
  try {
    run_local<Parallel<DP<4>>>([&](auto& ctx) {
      Model m(3);
      optim::AdamW<double> opt(m.specs(), shape.params());
      train::StepConfig cfg;
      cfg.batch = batch, cfg.seq = seq;
      train::DataParallelTrainer trainer(m, opt, ctx.template comm<Axis::dp>(), d, cfg);
      for (int s = 0; s < 4; ++s) {
        if (ctx.rank() == 2 && s == 2) throw Error("loom: rank 2's data ended at step 2");
        trainer.step(s);
      }
    });
  } catch (const std::exception& e) {
    msg = e.what();
  }
  CHECK(msg == "loom: rank 2's data ended at step 2");
}

TEST_CASE("a non-finite gradient on one rank skips the step on every rank", "[ddp]") {
  const auto d = data();
  std::vector<int> skipped(4, 0);
  std::vector<double> changed(4, 0);
  run_local<Parallel<DP<4>>>([&](auto& ctx) {
    Model m(3);
    optim::AdamW<double> opt(m.specs(), shape.params());
    train::StepConfig cfg;
    cfg.batch = batch, cfg.seq = seq;
    train::DataParallelTrainer trainer(m, opt, ctx.template comm<Axis::dp>(), d, cfg);
    if (ctx.rank() == 1) m.params().data()[m.specs()[2].offset] = std::nan("");  // h.0.ln_1.weight[0]
    const auto before = m.params().clone();
    const auto r = trainer.step(0);
    skipped[ctx.rank()] = r.skipped;
    // Every other parameter is untouched: no update happened.
    for (std::int64_t i = m.specs()[3].offset; i < m.params().numel(); ++i)
      changed[ctx.rank()] = std::max(changed[ctx.rank()], std::abs(m.params().data()[i] - before.data()[i]));
  });
  CHECK(skipped == std::vector<int>{1, 1, 1, 1});
  CHECK(changed == std::vector<double>{0, 0, 0, 0});
}

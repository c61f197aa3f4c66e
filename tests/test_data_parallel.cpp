// Data parallelism: DP in {1, 2, 4, 8} x micro-batches in {1, 4} trains the same model as one rank with the same
// global batch (losses and every parameter, in double, dropout included); buckets partition the gradients; a rank
// that fails stops the others; a non-finite gradient skips the step on every rank alike.
#include "catch.hpp"

#include <loom/comm/local.hpp>
#include <loom/core/trace.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data_parallel.hpp>

#include "data_parallel_cases.hpp"
#include "temp_dir.hpp"

#include <cmath>
#include <fstream>
#include <mutex>
#include <numeric>
#include <array>
#include <algorithm>

using namespace loom;

namespace {

using namespace loom::test;

template <int N, class... Opts>
std::vector<Run> data_parallel(int micro_batches, std::size_t bucket_bytes, bool overlap) {
  std::vector<Run> runs(N);
  run_local<Parallel<DP<N, Opts...>>>([&](auto& ctx) {
    runs[ctx.rank()] = data_parallel_rank(ctx, micro_batches, bucket_bytes, overlap);
  });
  return runs;
}

//! DP's options as one type, for TEMPLATE_TEST_CASE.
template <class... O>
struct DpOptions {};
template <int N, class... O>
std::vector<Run> data_parallel(DpOptions<O...>, int micro_batches, std::size_t bucket_bytes, bool overlap) {
  return data_parallel<N, O...>(micro_batches, bucket_bytes, overlap);
}

void check_same(const Run& ref, const std::vector<Run>& runs) {
  for (std::size_t r = 0; r < runs.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(runs[r].losses.size() == ref.losses.size());
    const auto [loss, params] = difference(ref, runs[r]);
    INFO("loss difference " << loss << ", parameter difference " << params);
    CHECK(loss <= 1e-9);
    CHECK(params <= 1e-9);
    const double state = state_difference(ref, runs[r]);
    INFO("optimizer state difference " << state);
    CHECK(state <= 1e-9);
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

TEMPLATE_TEST_CASE("ZeRO-1, 2 and 3 training equal the single-rank run, optimizer state included", "[ddp][zero]",
                   DpOptions<ZeRO<1>>, DpOptions<ZeRO<2>>, DpOptions<ZeRO<3>>, (DpOptions<ZeRO<3>, KeepGathered>)) {
  static const Run ref = single_rank();
  const int m = GENERATE(1, 4);
  INFO("micro-batches " << m);
  using Z = TestType;
  SECTION("DP 1") { check_same(ref, data_parallel<1>(Z{}, m, 2048, true)); }
  SECTION("DP 2") { check_same(ref, data_parallel<2>(Z{}, m, 2048, true)); }
  SECTION("DP 4") { check_same(ref, data_parallel<4>(Z{}, m, 2048, true)); }
  SECTION("DP 8") { check_same(ref, data_parallel<8>(Z{}, m, 2048, true)); }
  SECTION("DP 8, one bucket") { check_same(ref, data_parallel<8>(Z{}, m, std::size_t{25} << 20, true)); }
  SECTION("DP 4, buckets of one parameter, no overlap") { check_same(ref, data_parallel<4>(Z{}, m, 1, false)); }
}

TEMPLATE_TEST_CASE("hybrid sharding (ZeRO over groups, replicated across them) equals the single-rank run",
                   "[ddp][zero][hsdp]", ZeRO<1>, ZeRO<2>, ZeRO<3>) {
  static const Run ref = single_rank();
  const int m = GENERATE(1, 4);
  INFO("micro-batches " << m);
  using Z = TestType;
  SECTION("DP 4 as 2 x 2") { check_same(ref, data_parallel<4, Z, HybridShard<2>>(m, 2048, true)); }
  SECTION("DP 8 as 2 x 4") { check_same(ref, data_parallel<8, Z, HybridShard<4>>(m, 2048, true)); }
  SECTION("DP 8 as 4 x 2, no overlap") { check_same(ref, data_parallel<8, Z, HybridShard<2>>(m, 2048, false)); }
}

TEST_CASE("hybrid sharding sends ZeRO-3's volume within a group and one shard's average across groups",
          "[ddp][zero][hsdp]") {
  // DP 4 as 2 groups of 2: within its group a rank all-gathers every unit twice and reduce-scatters it once (3 chunks
  // of ceil(L/2), each sent once) and sums the squared norm; across groups it averages its shard, Psi_r elements
  // (2 Psi_r (m-1)/m over m = 2 replicas).
  using Cfg = Parallel<DP<4, ZeRO<3>, HybridShard<2>>>;
  const auto d = data();
  const auto units = train::unit_buckets_of(Model(3));
  std::vector<comm::Traffic> within(4), across(4);
  run_local<Cfg>([&](auto& ctx) {
    train::Trainer<Cfg, Model, AdamW> trainer(ctx, d, trainer_options(), adamw);
    const int r = ctx.rank();
    auto& group = ctx.get(comm::GroupInfo{"shard", {r / 2 * 2, r / 2 * 2 + 1}});
    auto& replicas = ctx.get(comm::GroupInfo{"replicas", {r % 2, r % 2 + 2}});
    trainer.step(0);
    group.reset_traffic(), replicas.reset_traffic();
    trainer.step(1);
    within[std::size_t(r)] = group.traffic(), across[std::size_t(r)] = replicas.traffic();
  });
  double group_elements = 1;  // the squared norm
  for (const auto& b : units) group_elements += 3.0 * static_cast<double>((b.hi - b.lo + 1) / 2);
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(within[std::size_t(r)].count(comm::Collective::all_gather) == 2 * static_cast<std::int64_t>(units.size()));
    CHECK(within[std::size_t(r)].elements == group_elements);
    CHECK(across[std::size_t(r)].count(comm::Collective::all_reduce) == 1);
    CHECK(across[std::size_t(r)].elements == static_cast<double>(shard_elements(units, 2, r % 2)));
  }
}

TEST_CASE("ZeRO-1 shards the optimizer state: each rank holds its chunk of every bucket", "[ddp][zero]") {
  // Buckets of 2048 bytes hold 256 doubles or more; every one is split into N chunks, the last one short.
  const auto specs = Model::param_specs();
  const auto buckets = train::make_buckets(specs, sizeof(double), 2048);
  for (int n : {1, 2, 3, 4, 8}) {
    INFO("N = " << n);
    std::vector<int> owners(static_cast<std::size_t>(shape.params()), 0);
    std::int64_t total = 0;
    for (int r = 0; r < n; ++r) {
      const train::ShardPlan plan(buckets, specs, n, r);
      REQUIRE(plan.pieces.size() == buckets.size());
      std::int64_t held = 0, updated = 0;
      for (const auto& p : plan.pieces) {
        CHECK(p.chunk == (p.hi - p.lo + n - 1) / n);
        for (std::int64_t i = p.own_lo; i < p.own_hi; ++i) ++owners[static_cast<std::size_t>(i)];
        held += p.own();
      }
      for (const auto& s : plan.slices) updated += s.n;
      CHECK(held == plan.numel);
      CHECK(updated == plan.numel);  // the optimizer updates every element of the shard once
      total += plan.numel;
    }
    CHECK(total == shape.params());
    CHECK(std::all_of(owners.begin(), owners.end(), [](int k) { return k == 1; }));  // each element has one owner
  }
}

TEST_CASE("ZeRO-1 optimizer state is an N-th of plain data parallelism's", "[ddp][zero]") {
  const auto d = data();
  std::vector<std::int64_t> state(4, 0);
  run_local<Parallel<DP<4, ZeRO<1>>>>([&](auto& ctx) {
    train::Trainer<Parallel<DP<4, ZeRO<1>>>, Model, AdamW> trainer(ctx, d, trainer_options(), adamw);
    for (const auto& [name, t] : trainer.optimizers().front().state()) state[ctx.rank()] += t.numel();
  });
  // Two moments per element, each element held by one rank, and no rank more than its chunk (ceil(L / 4)) of each
  // bucket of L elements: an N-th of the state, up to the rounding of each bucket.
  std::int64_t most = 0;
  for (const auto& b : train::make_buckets(Model::param_specs(), sizeof(double), std::size_t{25} << 20))
    most += 2 * ((b.hi - b.lo + 3) / 4);
  CHECK(std::accumulate(state.begin(), state.end(), std::int64_t{0}) == 2 * shape.params());
  for (auto s : state) CHECK(s <= most);
  CHECK(most < 2 * shape.params() / 4 + 2 * 4);
}

TEST_CASE("ZeRO-1 and ZeRO-2 send what plain data parallelism sends, counted by the communicator", "[ddp][zero]") {
  // Per step, on the data-parallel communicator: plain DP all-reduces every bucket (2L(n-1)/n elements of a bucket
  // of L) and the loss; ZeRO-1 reduce-scatters and all-gathers every bucket in n chunks of ceil(L / n) (2 chunk
  // (n-1): as much, plus the padding of the buckets n does not divide) and all-reduces the loss and the shard's
  // squared norm. (Whether the step is finite on every rank is all-reduced over the world: the same ranks here,
  // but another communicator.)
  const auto d = data();
  const auto buckets = train::make_buckets(Model::param_specs(), sizeof(double), 2048);
  const auto nb = static_cast<std::int64_t>(buckets.size());
  auto traffic = [&]<class Cfg>(Cfg) {
    std::vector<comm::Traffic> t(Cfg::world_size);
    run_local<Cfg>([&](auto& ctx) {
      auto o = trainer_options();
      o.step.bucket_bytes = 2048;
      train::Trainer<Cfg, Model, AdamW> trainer(ctx, d, o, adamw);
      trainer.step(0);
      auto& dp = ctx.template comm<Axis::dp>();
      dp.reset_traffic();
      trainer.step(1);
      t[ctx.rank()] = dp.traffic();
    });
    return t;
  };
  constexpr int n = 4;
  double plain = 2.0 * (n - 1) / n, zero = 2 * 2.0 * (n - 1) / n, padding = 0;
  for (const auto& b : buckets) {
    const std::int64_t len = b.hi - b.lo, chunk = (len + n - 1) / n;
    plain += 2.0 * static_cast<double>(len) * (n - 1) / n;
    zero += 2.0 * static_cast<double>(chunk) * (n - 1);
    padding += 2.0 * static_cast<double>(chunk * n - len) * (n - 1) / n;
  }
  CHECK(zero == plain + padding + 2.0 * (n - 1) / n);  // the formulas agree: the same volume, plus the padding
  for (const auto& t : traffic(Parallel<DP<n>>{})) {
    CHECK(t.count(comm::Collective::all_reduce) == nb + 1);
    CHECK(t.count(comm::Collective::reduce_scatter) == 0);
    CHECK(t.elements == plain);
  }
  for (const auto& t : traffic(Parallel<DP<n, ZeRO<1>>>{})) {
    CHECK(t.count(comm::Collective::all_reduce) == 2);
    CHECK(t.count(comm::Collective::reduce_scatter) == nb);
    CHECK(t.count(comm::Collective::all_gather) == nb);
    CHECK(t.elements == zero);
  }
  for (const auto& t : traffic(Parallel<DP<n, ZeRO<2>>>{})) {  // the same collectives; only what is kept differs
    CHECK(t.count(comm::Collective::all_reduce) == 2);
    CHECK(t.count(comm::Collective::reduce_scatter) == nb);
    CHECK(t.count(comm::Collective::all_gather) == nb);
    CHECK(t.elements == zero);
  }
  // ZeRO-3 works in the model's units (the embedding, each block, the final norm): each unit is all-gathered before
  // its forward and again before its backward, and reduce-scattered once: 3 Psi (n-1)/n, plus the padding. With
  // KeepGathered the gather before backward is not needed: 2 Psi (n-1)/n.
  const auto units = train::unit_buckets_of(Model(3));
  const auto nu = static_cast<std::int64_t>(units.size());
  REQUIRE(nu == shape.layers + 2);
  double zero3 = 2 * 2.0 * (n - 1) / n, keep = zero3, exact = zero3;
  for (const auto& b : units) {
    const std::int64_t len = b.hi - b.lo, chunk = (len + n - 1) / n;
    zero3 += 3.0 * static_cast<double>(chunk) * (n - 1);
    keep += 2.0 * static_cast<double>(chunk) * (n - 1);
    exact += 3.0 * static_cast<double>(len) * (n - 1) / n;
  }
  CHECK(zero3 >= exact);
  CHECK(zero3 - exact < 3.0 * nu * (n - 1));  // the padding: less than one element per rank and unit
  for (const auto& t : traffic(Parallel<DP<n, ZeRO<3>>>{})) {
    CHECK(t.count(comm::Collective::all_reduce) == 2);
    CHECK(t.count(comm::Collective::reduce_scatter) == nu);
    CHECK(t.count(comm::Collective::all_gather) == 2 * nu);
    CHECK(t.elements == zero3);
  }
  for (const auto& t : traffic(Parallel<DP<n, ZeRO<3>, KeepGathered>>{})) {
    CHECK(t.count(comm::Collective::reduce_scatter) == nu);
    CHECK(t.count(comm::Collective::all_gather) == nu);
    CHECK(t.elements == keep);
  }
}

TEST_CASE("ZeRO-3 gathers the next unit while the current one computes, as the trace shows", "[ddp][zero]") {
  // On each rank some all-gather of parameters runs (on the communicator's worker) while a forward or backward
  // unit computes; each unit is gathered twice a step (before its forward, before its backward).
  // A model wide enough that a block computes for much longer than its gather takes to start.
  using Wide = models::Gpt<models::GptShape{2, 4, 4, 256, 64, 32}, double>;
  std::vector<std::int32_t> tok(2000);
  for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<std::int32_t>((i * 7) % 64);
  const train::Batches d(tok, 8, 32, train::BatchOrder::shuffle, 11);
  auto o = trainer_options();
  o.step.batch = 8, o.step.seq = 32;
  trace::clear();
  trace::start();
  run_local<Parallel<DP<2, ZeRO<3>>>>([&](auto& ctx) {
    train::Trainer<Parallel<DP<2, ZeRO<3>>>, Wide, AdamW> trainer(ctx, d, o, adamw);
    trainer.step(0);
  });
  trace::stop();
  const auto spans = trace::spans();
  trace::clear();
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    int gathers = 0, overlapping = 0;
    for (const auto& g : spans) {
      if (g.rank != r || g.name != "all_gather") continue;
      ++gathers;
      for (const auto& c : spans)
        if (c.rank == r && (c.name == "forward" || c.name == "backward") && c.begin_us < g.end_us &&
            g.begin_us < c.end_us) {
          ++overlapping;
          break;
        }
    }
    CHECK(gathers == 2 * (shape.layers + 2));
    CHECK(overlapping >= 1);
  }
}

namespace {

//! Bytes each rank of layout Cfg holds after a step, by use: parameters, gradients, optimizer state; and the peaks
//! of communication buffers and of everything.
template <class Cfg>
std::vector<std::array<std::size_t, 5>> held_by_use(std::size_t bucket_bytes = std::size_t{25} << 20) {
  const auto d = data();
  std::vector<std::array<std::size_t, 5>> held(Cfg::world_size);
  run_local<Cfg>([&](auto& ctx) {
    auto o = trainer_options();
    o.step.bucket_bytes = bucket_bytes;
    train::Trainer<Cfg, Model, AdamW> trainer(ctx, d, o, adamw);
    trainer.step(0);
    const auto& m = rank_memory();
    held[ctx.rank()] = {m.in_use(MemoryUse::parameters), m.in_use(MemoryUse::gradients),
                        m.in_use(MemoryUse::optimizer_state), m.peak(MemoryUse::communication), m.peak()};
  });
  return held;
}

template <int N>
void check_memory_formula() {
  // f64, AdamW: parameters 8 Psi, gradients 8 Psi; optimizer state 16 Psi (plain), 16 Psi_r (ZeRO-1); ZeRO-2:
  // gradients 8 Psi_r; ZeRO-3: parameters 8 Psi_r as well, between steps.
  INFO("N = " << N);
  const std::size_t psi = static_cast<std::size_t>(shape.params());
  const auto buckets = train::make_buckets(Model::param_specs(), sizeof(double), 2048);
  const auto plain = held_by_use<Parallel<DP<N>>>(2048), zero = held_by_use<Parallel<DP<N, ZeRO<1>>>>(2048);
  const auto zero2 = held_by_use<Parallel<DP<N, ZeRO<2>>>>(2048);
  const auto zero3 = held_by_use<Parallel<DP<N, ZeRO<3>>>>(2048);
  const auto units = train::unit_buckets_of(Model(3));
  for (int r = 0; r < N; ++r) {
    INFO("rank " << r);
    CHECK(plain[r][0] == 8 * psi);
    CHECK(plain[r][1] == 8 * psi);
    CHECK(plain[r][2] == 16 * psi);
    CHECK(plain[r][3] == 0);
    CHECK(zero[r][0] == 8 * psi);
    CHECK(zero[r][1] == 8 * psi);
    CHECK(zero[r][2] == 16 * static_cast<std::size_t>(shard_elements(buckets, N, r)));
    CHECK((zero[r][3] > 0) == (N > 1));  // the reduce-scatter's shard, during the reduction (none for one rank)
    // ZeRO-2: the gradients of its shard alone (8 Psi_r) once a step is done; one rank keeps them all.
    CHECK(zero2[r][0] == 8 * psi);
    CHECK(zero2[r][1] == 8 * static_cast<std::size_t>(shard_elements(buckets, N, r)));
    CHECK(zero2[r][2] == zero[r][2]);
    CHECK(zero2[r][4] <= zero[r][4]);  // the peak: no more than ZeRO-1's
    // ZeRO-3: its shard of the parameters, gradients and optimizer state (sharded by units, not buckets).
    const auto own = static_cast<std::size_t>(shard_elements(units, N, r));
    CHECK(zero3[r][0] == 8 * own);
    CHECK(zero3[r][1] == 8 * own);
    CHECK(zero3[r][2] == 16 * own);
    if (N > 1) CHECK(zero3[r][4] < zero2[r][4]);
  }
}

}  // namespace

TEST_CASE("per-rank memory by use is the formula: plain data parallelism, ZeRO-1, 2 and 3", "[ddp][zero][memory]") {
  check_memory_formula<1>();
  check_memory_formula<2>();
  check_memory_formula<4>();
  check_memory_formula<8>();
}

TEST_CASE("a memory cap refuses plain data parallelism, naming the rank, the use and the bytes, and ZeRO-1 trains",
          "[ddp][zero][memory]") {
  // A cap above the peak of every rank under ZeRO-1 over 8 ranks and below plain data parallelism's: the replicated
  // optimizer state does not fit, its shards do.
  const auto plain = held_by_use<Parallel<DP<8>>>(), zero = held_by_use<Parallel<DP<8, ZeRO<1>>>>();
  std::size_t zero_peak = 0, plain_peak = plain[0][4];
  for (const auto& h : zero) zero_peak = std::max(zero_peak, h[4]);
  for (const auto& h : plain) plain_peak = std::min(plain_peak, h[4]);
  REQUIRE(zero_peak < plain_peak);
  const std::size_t cap = zero_peak + (plain_peak - zero_peak) / 4;
  set_memory_cap(cap);
  std::string msg;
  try {
    held_by_use<Parallel<DP<8>>>();
  } catch (const std::exception& e) {
    msg = e.what();
  }
  // Which allocation crosses the cap depends on the order they come in (here: an activation of the first forward).
  CHECK_THAT(msg, Catch::Matchers::Matches("loom: rank [0-9] failed: loom: rank [0-9] cannot allocate [0-9]+ bytes of "
                                           "(activations|optimizer state|gradients|parameters): it would hold [0-9]+ "
                                           "bytes, over its cap of [0-9]+ \\(LOOM_MAX_BYTES\\); it holds .*"));
  CHECK_THAT(msg, Catch::Matchers::Contains("over its cap of " + std::to_string(cap) + " (LOOM_MAX_BYTES)"));
  std::vector<std::array<std::size_t, 5>> trained;
  CHECK_NOTHROW(trained = held_by_use<Parallel<DP<8, ZeRO<1>>>>());
  set_memory_cap(0);
  CHECK(trained.size() == 8);
}

namespace {

using Bf16Model = models::Gpt<shape, bf16>;
using Bf16AdamW = optim::AdamW<bf16>;

//! Bytes each rank of layout Cfg holds after a step of the bf16 model with fp32 master weights, by use: parameters,
//! gradients, master weights, optimizer state.
template <class Cfg>
std::vector<std::array<std::size_t, 4>> bf16_held(std::size_t bucket_bytes = 2048) {
  const auto d = data();
  std::vector<std::array<std::size_t, 4>> held(Cfg::world_size);
  run_local<Cfg>([&](auto& ctx) {
    auto o = trainer_options();
    o.step.bucket_bytes = bucket_bytes;
    using M = models::Gpt<shape, bf16, models::ModelLayout<Cfg>>;
    train::Trainer<Cfg, M, Bf16AdamW> trainer(ctx, d, o, [](const auto& specs, std::int64_t n) {
      return Bf16AdamW(specs, n);
    });
    trainer.step(0);
    const auto& m = rank_memory();
    held[ctx.rank()] = {m.in_use(MemoryUse::parameters), m.in_use(MemoryUse::gradients),
                        m.in_use(MemoryUse::master_weights), m.in_use(MemoryUse::optimizer_state)};
  });
  return held;
}

template <int N>
void check_bf16_formula() {
  // bf16 parameters and gradients (2 bytes), fp32 master weights (4) and AdamW moments (2 x 4): plain data
  // parallelism 2Psi + 2Psi + 4Psi + 8Psi; ZeRO-1 2Psi + 2Psi + 12Psi_r; ZeRO-2 2Psi + 2Psi_r + 12Psi_r; ZeRO-3
  // 2Psi_r + 2Psi_r + 12Psi_r.
  INFO("N = " << N);
  const std::size_t psi = static_cast<std::size_t>(shape.params());
  const auto buckets = train::make_buckets(Bf16Model::param_specs(), sizeof(bf16), 2048);
  const auto units = train::unit_buckets_of(Bf16Model(3));
  const auto plain = bf16_held<Parallel<DP<N>>>(), z1 = bf16_held<Parallel<DP<N, ZeRO<1>>>>();
  const auto z2 = bf16_held<Parallel<DP<N, ZeRO<2>>>>(), z3 = bf16_held<Parallel<DP<N, ZeRO<3>>>>();
  for (int r = 0; r < N; ++r) {
    INFO("rank " << r);
    const auto own = static_cast<std::size_t>(shard_elements(buckets, N, r));
    const auto own3 = static_cast<std::size_t>(shard_elements(units, N, r));
    CHECK(plain[r] == std::array<std::size_t, 4>{2 * psi, 2 * psi, 4 * psi, 8 * psi});
    CHECK(z1[r] == std::array<std::size_t, 4>{2 * psi, 2 * psi, 4 * own, 8 * own});
    CHECK(z2[r] == std::array<std::size_t, 4>{2 * psi, 2 * own, 4 * own, 8 * own});
    CHECK(z3[r] == std::array<std::size_t, 4>{2 * own3, 2 * own3, 4 * own3, 8 * own3});
  }
}

}  // namespace

TEST_CASE("bf16 with fp32 master weights: per-rank memory is ZeRO's formula, 2Psi + 2Psi + 12Psi/N for stage 1",
          "[ddp][zero][memory][bf16]") {
  check_bf16_formula<1>();
  check_bf16_formula<2>();
  check_bf16_formula<4>();
  check_bf16_formula<8>();
  // With tensor parallelism Psi is the rank's part.
  using TpZero = Parallel<TP<2>, DP<2, ZeRO<1>>>;
  const auto held = bf16_held<TpZero>();
  using TpModel = models::Gpt<shape, bf16, models::ModelLayout<TpZero>>;
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    const auto specs = TpModel::param_specs(TpZero::coords(r).tp);
    const auto psi = static_cast<std::size_t>(specs.back().offset + numel_of(specs.back().shape));
    const auto own = static_cast<std::size_t>(
        shard_elements(train::make_buckets(specs, sizeof(bf16), 2048), 2, TpZero::coords(r).dp));
    CHECK(held[r] == std::array<std::size_t, 4>{2 * psi, 2 * psi, 4 * own, 8 * own});
  }
}

TEST_CASE("bf16 with fp32 master weights: updates below bf16's precision accumulate", "[ddp][zero][bf16]") {
  // lr 1e-5 moves a weight of about 0.02 by about 1e-5 a step, well under half its bf16 spacing (about 6e-5 to
  // 1.2e-4): rounded each step, the parameters would never move. The master weights keep the sum.
  const auto d = data();
  auto o = trainer_options();
  o.step.lr = 1e-5;
  o.step.grad_clip = 0;
  std::size_t moved = 0, rounded = 0, total = 0;
  std::string name;
  run_local<Parallel<DP<2, ZeRO<1>>>>([&](auto& ctx) {
    train::Trainer<Parallel<DP<2, ZeRO<1>>>, Bf16Model, Bf16AdamW> trainer(
        ctx, d, o, [](const auto& specs, std::int64_t n) { return Bf16AdamW(specs, n, {0.9, 0.999, 1e-8, 0.0}); });
    const auto before = trainer.params_of_part(0);
    for (int s = 0; s < 40; ++s) trainer.step(s);
    const auto after = trainer.params_of_part(0);
    const auto state = trainer.optimizers().front().state();
    const auto master = trainer.state_of_part(0, state.back().second.data());
    if (ctx.rank() != 0) return;
    name = state.back().first;
    total = after.size();
    for (std::size_t i = 0; i < after.size(); ++i) {
      moved += after[i] != before[i];
      rounded += after[i] == static_cast<bf16>(master[i]);
    }
  });
  CHECK(name == "adamw.master");
  CHECK(moved > total / 4);  // most of the weights have moved
  CHECK(rounded == total);   // and each is its master weight rounded
}

TEST_CASE("bf16 gradients are averaged in fp32, or in bf16 with ReduceIn<bf16>: the bytes sent", "[ddp][zero][bf16]") {
  // DP 4, one step: the gradient collectives carry fp32 (4 bytes an element), the parameters' all-gathers bf16 (2);
  // the loss and the squared norm are doubles (the finite flag, an int, goes over the world's communicator).
  constexpr int n = 4;
  const auto d = data();
  auto bytes = [&]<class Cfg>(Cfg) {
    std::vector<comm::Traffic> t(n);
    run_local<Cfg>([&](auto& ctx) {
      train::Trainer<Cfg, Bf16Model, Bf16AdamW> trainer(ctx, d, trainer_options(), [](const auto& s, std::int64_t k) {
        return Bf16AdamW(s, k);
      });
      auto& dp = ctx.template comm<Axis::dp>();
      dp.reset_traffic();
      trainer.step(0);
      t[ctx.rank()] = dp.traffic();
    });
    return t;
  };
  const double scalar = 2.0 * (n - 1) / n;
  const auto buckets = train::make_buckets(Bf16Model::param_specs(), sizeof(bf16), std::size_t{25} << 20);
  double plain = scalar * 8, zero = scalar * (8 + 8);
  for (const auto& b : buckets) {
    const double len = static_cast<double>(b.hi - b.lo), chunk = std::ceil(len / n);
    plain += 4 * 2 * len * (n - 1) / n;
    zero += 4 * chunk * (n - 1) + 2 * chunk * (n - 1);
  }
  for (const auto& t : bytes(Parallel<DP<n>>{})) CHECK(t.bytes == Approx(plain).epsilon(1e-12));
  for (const auto& t : bytes(Parallel<DP<n, ZeRO<1>>>{})) CHECK(t.bytes == Approx(zero).epsilon(1e-12));
  // ReduceIn<bf16>: the gradients' collectives in bf16, half the bytes.
  double plain_bf16 = scalar * 8, zero_bf16 = scalar * (8 + 8);
  for (const auto& b : buckets) {
    const double len = static_cast<double>(b.hi - b.lo), chunk = std::ceil(len / n);
    plain_bf16 += 2 * 2 * len * (n - 1) / n;
    zero_bf16 += 2 * chunk * (n - 1) + 2 * chunk * (n - 1);
  }
  for (const auto& t : bytes(Parallel<DP<n, ReduceIn<bf16>>>{}))
    CHECK(t.bytes == Approx(plain_bf16).epsilon(1e-12));
  for (const auto& t : bytes(Parallel<DP<n, ZeRO<1>, ReduceIn<bf16>>>{}))
    CHECK(t.bytes == Approx(zero_bf16).epsilon(1e-12));
  double zero3_bf16 = scalar * (8 + 8);  // every unit gathered twice and reduce-scattered once, all in bf16
  for (const auto& u : train::unit_buckets_of(Bf16Model(3)))
    zero3_bf16 += 3 * 2 * std::ceil(static_cast<double>(u.hi - u.lo) / n) * (n - 1);
  for (const auto& t : bytes(Parallel<DP<n, ZeRO<3>, ReduceIn<bf16>>>{}))
    CHECK(t.bytes == Approx(zero3_bf16).epsilon(1e-12));
}

TEST_CASE("bf16 gradients averaged in bf16 (ReduceIn<bf16>) train close to the fp32 average", "[ddp][zero][bf16]") {
  // The same 5 steps averaged in fp32 and in bf16: the losses agree to bf16's precision, not exactly (the bf16 sums
  // round), on every ZeRO stage.
  const auto d = data();
  auto losses = [&]<class Cfg>(Cfg) {
    std::vector<double> l;
    run_local<Cfg>([&](auto& ctx) {
      train::Trainer<Cfg, Bf16Model, Bf16AdamW> trainer(ctx, d, trainer_options(), [](const auto& s, std::int64_t k) {
        return Bf16AdamW(s, k);
      });
      for (int s = 0; s < 5; ++s) {
        const double x = trainer.step(s).loss;
        if (ctx.rank() == 0) l.push_back(x);
      }
    });
    return l;
  };
  const auto wide = losses(Parallel<DP<4, ZeRO<1>>>{});
  for (const auto& narrow : {losses(Parallel<DP<4, ReduceIn<bf16>>>{}),
                             losses(Parallel<DP<4, ZeRO<1>, ReduceIn<bf16>>>{}),
                             losses(Parallel<DP<4, ZeRO<3>, ReduceIn<bf16>>>{})}) {
    REQUIRE(narrow.size() == wide.size());
    for (std::size_t i = 0; i < wide.size(); ++i) CHECK(std::abs(narrow[i] - wide[i]) < 0.05);
  }
}

TEST_CASE("under a cap that only sharded parameters fit, ZeRO-3 trains on 8 ranks and ZeRO-1 and plain DP refuse",
          "[ddp][zero][memory]") {
  const auto plain = held_by_use<Parallel<DP<8>>>(), zero1 = held_by_use<Parallel<DP<8, ZeRO<1>>>>();
  const auto zero3 = held_by_use<Parallel<DP<8, ZeRO<3>>>>();
  auto peak = [](const auto& held) {
    std::size_t p = 0;
    for (const auto& h : held) p = std::max(p, h[4]);
    return p;
  };
  auto least = [](const auto& held) {
    std::size_t p = held[0][4];
    for (const auto& h : held) p = std::min(p, h[4]);
    return p;
  };
  INFO("peaks: plain " << peak(plain) << ", ZeRO-1 " << peak(zero1) << ", ZeRO-3 " << peak(zero3));
  REQUIRE(peak(zero3) < least(zero1));
  REQUIRE(least(zero1) < least(plain));
  const std::size_t cap = peak(zero3) + (least(zero1) - peak(zero3)) / 4;
  set_memory_cap(cap);
  auto refused = [](auto run) {
    try {
      run();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string by_plain = refused([] { held_by_use<Parallel<DP<8>>>(); });
  const std::string by_zero1 = refused([] { held_by_use<Parallel<DP<8, ZeRO<1>>>>(); });
  std::vector<std::array<std::size_t, 5>> trained;
  const std::string by_zero3 = refused([&] { trained = held_by_use<Parallel<DP<8, ZeRO<3>>>>(); });
  // A cap below what even one unit needs: ZeRO-3 refuses too, naming what it could not hold.
  set_memory_cap(peak(zero3) / 4);
  const std::string too_small = refused([] { held_by_use<Parallel<DP<8, ZeRO<3>>>>(); });
  set_memory_cap(0);
  const auto message = Catch::Matchers::Matches("loom: rank [0-9] failed: loom: rank [0-9] cannot allocate [0-9]+ "
                                                "bytes of [a-z ]+: it would hold [0-9]+ bytes, over its cap of "
                                                "[0-9]+ \\(LOOM_MAX_BYTES\\); it holds .*");
  CHECK_THAT(by_plain, message);
  CHECK_THAT(by_zero1, message);
  CHECK_THAT(by_zero1, Catch::Matchers::Contains("over its cap of " + std::to_string(cap)));
  CHECK(by_zero3.empty());
  CHECK(trained.size() == 8);
  CHECK_THAT(too_small, message);
}

TEST_CASE("a rank whose data file is too short stops every rank with the message naming it", "[ddp][failure]") {
  // Every rank reads its own data file; rank 2's holds 5 bytes, too few for one sequence of seq = 8 tokens. Its
  // Batches refuses them while the others go on into their first step, whose collectives rank 2 never joins.
  test::TempDir dir;
  const std::string good = dir / "good.bin", short_file = dir / "short.bin";
  {
    std::vector<char> bytes(1000);
    for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i % shape.vocab);
    std::ofstream(good, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    std::ofstream(short_file, std::ios::binary) << "short";
  }
  std::vector<int> stopped(4, 0), stepped(4, 0);
  std::string msg;
  try {
    run_local<Parallel<DP<4>>>([&](auto& ctx) {
      const std::string file = ctx.rank() == 2 ? short_file : good;
      const train::Batches d(train::read_bytes(file), batch, seq, train::BatchOrder::shuffle, 11, file);
      train::Trainer<Parallel<DP<4>>, Model, AdamW> trainer(ctx, d, trainer_options(), adamw);
      try {
        trainer.step(0);
        stepped[ctx.rank()] = 1;
      } catch (const AbortedError&) {
        stopped[ctx.rank()] = 1;
        throw;
      }
    });
  } catch (const std::exception& e) {
    msg = e.what();
  }
  // run_local may say which rank failed before the rank's own message.
  CHECK_THAT(msg, Catch::Matchers::EndsWith("loom: the data file '" + short_file +
                                            "' holds 5 tokens, too few for one sequence of 8 tokens and its targets "
                                            "(10 needed)"));
  CHECK(stopped == std::vector<int>{1, 1, 0, 1});
  CHECK(stepped == std::vector<int>{0, 0, 0, 0});
}

TEST_CASE("a non-finite gradient on one rank skips the step on every rank", "[ddp]") {
  const auto d = data();
  std::vector<int> skipped(4, 0);
  std::vector<double> changed(4, 0);
  run_local<Parallel<DP<4>>>([&](auto& ctx) {
    train::Trainer<Parallel<DP<4>>, Model, AdamW> trainer(ctx, d, trainer_options(), adamw);
    auto& m = trainer.model();
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

TEST_CASE("ZeRO-2 holds its shard of the gradients between steps, and never more than ZeRO-1", "[ddp][zero][memory]") {
  // With buckets of 2048 bytes, a bucket is taken back when backward reaches it (with one micro-batch; with 4, when
  // the first backward starts) and released once reduce-scattered: after a step a rank holds its shard's gradients,
  // and its peak is at most ZeRO-1's, which holds every gradient throughout. (How much lower depends on how soon
  // each reduce-scatter completes while backward goes on: bench/zero measures it.)
  auto run = [&]<class Cfg>(Cfg, int micro_batches) {
    std::vector<std::array<std::size_t, 2>> out(Cfg::world_size);
    const auto d = data();
    run_local<Cfg>([&](auto& ctx) {
      auto o = trainer_options();
      o.step.bucket_bytes = 2048, o.step.micro_batches = micro_batches;
      train::Trainer<Cfg, Model, AdamW> trainer(ctx, d, o, adamw);
      for (int s = 0; s < 3; ++s) trainer.step(s);
      out[ctx.rank()] = {rank_memory().peak(), rank_memory().in_use(MemoryUse::gradients)};
    });
    return out;
  };
  const auto buckets = train::make_buckets(Model::param_specs(), sizeof(double), 2048);
  const auto z1 = run(Parallel<DP<4, ZeRO<1>>>{}, 1), z2 = run(Parallel<DP<4, ZeRO<2>>>{}, 1);
  const auto z2_four = run(Parallel<DP<4, ZeRO<2>>>{}, 4);
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r << ": peaks " << z1[r][0] << " (ZeRO-1), " << z2[r][0] << " (ZeRO-2)");
    const std::size_t shard = 8 * static_cast<std::size_t>(shard_elements(buckets, 4, r));
    CHECK(z1[r][1] == 8 * static_cast<std::size_t>(shape.params()));
    CHECK(z2[r][1] == shard);
    CHECK(z2_four[r][1] == shard);
    CHECK(z2[r][0] <= z1[r][0]);
  }
}

// The Local backend: every collective on every group of several layouts against a serial reference, each
// all_reduce algorithm at awkward sizes, asynchronous collectives. Failures: test_comm_local_failures.cpp.
#include "catch.hpp"
#include "comm_cases.hpp"

#include <loom/comm/any.hpp>
#include <loom/comm/local.hpp>

#include <bit>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

using namespace loom;
using comm::Algorithm;
using comm::Reduce;

namespace {

comm::LocalOptions quick(int timeout_ms = 2000, Algorithm a = Algorithm::automatic) {
  comm::LocalOptions o;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  o.algorithm = a;
  return o;
}

//! A communicator of one rank that keeps the stream each operation it is handed was ordered on.
class Recorder : public comm::Frontend<Recorder> {
 public:
  int rank() const { return 0; }
  int size() const { return 1; }
  const comm::GroupInfo& group() const { return info_; }
  comm::Handle start(comm::Op&& op, bool) {
    seen.push_back(op.stream);
    return comm::Handle::ready();
  }
  std::vector<std::optional<void*>> seen;

 private:
  comm::GroupInfo info_{"rec", {0}};
};

}  // namespace

TEST_CASE("on_stream orders what a communicator issues, nests, passes through AnyComm, and needs CUDA support",
          "[comm][local]") {
  int a = 0, b = 0;  // two addresses that stand for streams
  void* const sa = &a;
  void* const sb = &b;
  Recorder rec;
  std::vector<float> v(3, 1.0f);
  rec.all_reduce(v);
  {
    const auto on = rec.on_stream(sa);
    rec.all_reduce(v);
    {
      const auto legacy = rec.on_stream(nullptr);  // the legacy default stream: a stream, not the host
      rec.barrier();
    }
    rec.all_gather(std::span<const float>(v.data(), 3), v);
    CHECK(rec.stream_order() == std::optional<void*>(sa));
  }
  rec.broadcast(v, 0);
  CHECK(!rec.stream_order());
  {
    comm::AnyComm any(rec);
    const auto inner = rec.on_stream(sa);
    const auto outer = any.on_stream(sb);
    any.all_reduce(v);  // the wrapper's order travels with the operation; the wrapped one's does not replace it
  }
  const std::vector<std::optional<void*>> want{std::nullopt, sa, nullptr, sa, std::nullopt, sb};
  REQUIRE(rec.seen.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("operation " << i);
    CHECK(rec.seen[i] == want[i]);
  }

  // Local without CUDA support for its communicators cannot wait for a stream: every rank is told.
  std::string msg;
  try {
    run_local<Parallel<DP<2>>>(
        [&](auto& ctx) {
          const auto on = ctx.world().on_stream(sa);
          ctx.world().all_reduce(std::span<float>(v.data(), 1));
        },
        quick());
  } catch (const std::exception& e) {
    msg = e.what();
  }
  INFO(msg);
  CHECK(msg.find("all_reduce is ordered on a CUDA stream, but this program has no CUDA support for its "
                 "communicators") != std::string::npos);
}

TEMPLATE_TEST_CASE("every collective on every group matches the serial reference", "[comm][local]",
                   (Parallel<TP<2>, PP<2>, DP<2>>), (Parallel<TP<2>, CP<2>, DP<2>>), (Parallel<DP<4>>),
                   (Parallel<TP<3>>), (Parallel<TP<2>, DP<3>>), (Parallel<>)) {
  REQUIRE_NOTHROW(run_local<TestType>([](auto& ctx) { test::all_groups(ctx); }, quick(20000)));
}

TEMPLATE_TEST_CASE("all_reduce algorithms agree on every group size", "[comm][local]", (Parallel<DP<1>>),
                   (Parallel<DP<2>>), (Parallel<DP<3>>), (Parallel<DP<5>>), (Parallel<DP<6>>), (Parallel<DP<7>>),
                   (Parallel<DP<8>>)) {
  for (Algorithm a : {Algorithm::ring, Algorithm::halving_doubling, Algorithm::direct}) {
    INFO("algorithm " << name_of(a));
    REQUIRE_NOTHROW(run_local<TestType>(
        [](auto& ctx) {
          auto& c = ctx.world();
          for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{9}, std::size_t{100003}}) {
            for (Reduce op : test::all_reductions) {
              test::all_reduce_cases<float>(c, op, n);
              test::all_reduce_cases<std::int64_t>(c, op, n);
              test::all_reduce_cases<bf16>(c, op, n);
            }
          }
        },
        quick(20000, a)));
  }
}

TEST_CASE("asynchronous collectives on two groups overlap and complete in order", "[comm][local]") {
  using C = Parallel<TP<2>, DP<2>>;
  REQUIRE_NOTHROW(run_local<C>([](auto& ctx) {
    auto& tp = ctx.template comm<Axis::tp>();
    auto& dp = ctx.template comm<Axis::dp>();
    std::vector<double> a(1000, ctx.rank()), b(1000, 1.0), c(5, 2.0);
    auto h1 = tp.all_reduce_async(a);
    auto h2 = dp.all_reduce_async(b);
    auto h3 = tp.all_reduce_async(c, Reduce::prod);
    tp.barrier();  // blocking after queued async ones keeps the order
    h1.wait();
    h2.wait();
    h3.wait();
    const double want = ctx.template coord<Axis::dp>() == 0 ? 0 + 1 : 2 + 3;
    test::expect(a[999] == want, "tp all_reduce got ", a[999], " want ", want);
    test::expect(b[0] == 2.0, "dp all_reduce got ", b[0]);
    test::expect(c[4] == 4.0, "tp prod got ", c[4]);
  }));
}

TEST_CASE("comm<axes...>() hands out one communicator per group, the same one every call", "[comm][local]") {
  using C = Parallel<TP<2>, PP<2>, DP<2>>;
  std::vector<int> ok(C::world_size, 0);
  REQUIRE_NOTHROW(run_local<C>([&](auto& ctx) {
    auto& tp = ctx.template comm<Axis::tp>();
    auto& dp = ctx.template comm<Axis::dp>();
    auto& tp_dp = ctx.template comm<Axis::tp, Axis::dp>();
    const auto want = C::group<Axis::tp, Axis::dp>(ctx.rank());
    ok[ctx.rank()] = &tp == &ctx.template comm<Axis::tp>() && &dp == &ctx.template comm<Axis::dp>() &&
                     &tp_dp == &ctx.template comm<Axis::tp, Axis::dp>() && &tp != &dp && &tp != &tp_dp &&
                     tp.size() == 2 && dp.size() == 2 && tp_dp.size() == 4 &&
                     tp_dp.group().ranks == std::vector<int>(want.begin(), want.end()) &&
                     &ctx.get(tp.group()) == &tp;
  }, quick()));
  CHECK(ok == std::vector<int>(C::world_size, 1));
}

static_assert(comm::Communicator<comm::LocalComm>);

// The host reductions hold bf16 and fp16 as bits (they need not parse Eigen); their conversions must be the
// element types' own, bit for bit, or a reduction would round differently from the same arithmetic done in bf16.
TEST_CASE("the host reductions convert bf16 and fp16 exactly as the types do") {
  using comm::detail::Bf16Format;
  using comm::detail::Fp16Format;
  int wrong = 0;
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {  // every 16-bit pattern decodes to the same float
    const auto bits = static_cast<std::uint16_t>(h);
    const float b = static_cast<float>(Eigen::numext::bit_cast<bf16>(bits));
    const float f = static_cast<float>(Eigen::numext::bit_cast<fp16>(bits));
    if (!std::isnan(b) && std::bit_cast<std::uint32_t>(b) != std::bit_cast<std::uint32_t>(Bf16Format::decode(bits)))
      ++wrong;
    if (!std::isnan(f) && std::bit_cast<std::uint32_t>(f) != std::bit_cast<std::uint32_t>(Fp16Format::decode(bits)))
      ++wrong;
    if (std::isnan(b) != std::isnan(Bf16Format::decode(bits)) || std::isnan(f) != std::isnan(Fp16Format::decode(bits)))
      ++wrong;
  }
  CHECK(wrong == 0);
  // Every float whose low 12 bits are 0, 0x7ff, 0x800 (a tie for fp16), 0x801 or 0xfff (and ties for bf16
  // among them): both signs, every exponent, subnormals, the overflow edges, infinities; rounding to nearest even.
  for (std::uint32_t hi = 0; hi < 0x100000u; ++hi)
    for (std::uint32_t lo : {0x000u, 0x7ffu, 0x800u, 0x801u, 0xfffu}) {
      const std::uint32_t u = (hi << 12) | lo;
      const float x = std::bit_cast<float>(u);
      if (std::isnan(x)) continue;
      if (Eigen::numext::bit_cast<std::uint16_t>(bf16(x)) != Bf16Format::encode(x)) ++wrong;
      if (Eigen::numext::bit_cast<std::uint16_t>(fp16(x)) != Fp16Format::encode(x)) ++wrong;
    }
  CHECK(wrong == 0);
  CHECK(std::isnan(Bf16Format::decode(Bf16Format::encode(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isnan(Fp16Format::decode(Fp16Format::encode(std::numeric_limits<float>::quiet_NaN()))));
}

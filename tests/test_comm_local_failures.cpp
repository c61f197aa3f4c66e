// The Local backend when ranks fail: a rank that throws, one that never arrives, calls that disagree, sizes
// checked where they are given, a receive nobody sends; what every rank is told and what run_local reports. Small
// enough to build with AddressSanitizer in every CI run (scripts/sanitize --quick).
#include "catch.hpp"

#include <loom/comm/local.hpp>
#include <loom/core/half.hpp>
#include <loom/config.hpp>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

using namespace loom;
using comm::Reduce;

namespace {

comm::LocalOptions quick(int timeout_ms = 2000) {
  comm::LocalOptions o;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  return o;
}

template <class Fn>
std::string failure_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no failure";
}

}  // namespace

TEST_CASE("a rank that throws stops the others promptly with its message", "[comm][local][failure]") {
  using C = Parallel<DP<4>>;
  const auto t0 = std::chrono::steady_clock::now();
  const auto msg = failure_of([] {
    run_local<C>(
        [](auto& ctx) {
          std::vector<float> v(10, 1.0f);
          ctx.world().all_reduce(v);
          if (ctx.rank() == 2) throw std::runtime_error("rank two gives up");
          ctx.world().all_reduce(v);
        },
        quick(30000));
  });
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  CHECK(msg == "loom: rank 2 failed: rank two gives up");
  CHECK(elapsed < std::chrono::seconds(5));  // far below the 30 s timeout: the others were told, not timed out
}

TEST_CASE("the failure names its rank, keeps what it threw and what every rank saw", "[comm][local][failure]") {
  using C = Parallel<DP<4>>;
  try {
    run_local<C>(
        [](auto& ctx) {
          std::vector<float> v(10, 1.0f);
          if (ctx.rank() == 2) throw std::invalid_argument("rank two gives up");
          ctx.world().all_reduce(v);
        },
        quick(30000));
    FAIL("run_local returned");
  } catch (const RankFailure& f) {
    CHECK(f.rank == 2);
    CHECK(std::string(f.what()) == "loom: rank 2 failed: rank two gives up");
    REQUIRE(f.messages.size() == 4);
    CHECK(f.messages[2] == "rank two gives up");
    for (int r : {0, 1, 3}) {
      INFO(f.messages[r]);
      CHECK(f.messages[r] == "loom: all_reduce #1 on group world{0,1,2,3} (this is global rank " + std::to_string(r) +
                                 ", group rank " + std::to_string(r) + ") was abandoned because rank 2 failed: rank "
                                 "two gives up");
    }
    CHECK_THROWS_AS(std::rethrow_exception(f.cause), std::invalid_argument);
  }
}

TEST_CASE("the others see which rank failed", "[comm][local][failure]") {
  using C = Parallel<DP<3>>;
  std::vector<std::string> seen(3);
  const auto msg = failure_of([&] {
    run_local<C>(
        [&](auto& ctx) {
          try {
            if (ctx.rank() == 1) throw std::runtime_error("bad batch");
            std::vector<int> v(3, 1);
            ctx.world().all_reduce(v);
          } catch (const std::exception& e) {
            seen[ctx.rank()] = e.what();
            throw;
          }
        },
        quick(30000));
  });
  CHECK(msg == "loom: rank 1 failed: bad batch");
  for (int r : {0, 2}) {
    INFO(seen[r]);
    CHECK(seen[r].find("all_reduce #1 on group world{0,1,2}") != std::string::npos);
    CHECK(seen[r].find("abandoned because rank 1 failed: bad batch") != std::string::npos);
  }
}

TEST_CASE("a rank that never enters a collective makes the others time out naming it", "[comm][local][failure]") {
  using C = Parallel<TP<2>, DP<2>>;
  const auto t0 = std::chrono::steady_clock::now();
  const auto msg = failure_of([] {
    run_local<C>(
        [](auto& ctx) {
          auto& dp = ctx.template comm<Axis::dp>();
          std::vector<double> v(4, 1.0);
          dp.all_reduce(v);
          dp.all_reduce(v);
          if (ctx.rank() == 3) return;  // skips the third
          dp.all_reduce(v);
        },
        quick(1500));
  });
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  INFO(msg);
  CHECK(msg.find("loom: all_reduce #3 on group dp{1,3}") != std::string::npos);
  CHECK(msg.find("timed out after 1500 ms") != std::string::npos);
  CHECK(msg.find("global rank 3 (group rank 1, at #2)") != std::string::npos);
  CHECK(elapsed < std::chrono::seconds(6));
}

TEST_CASE("ranks that call different collectives, counts or dtypes are told so", "[comm][local][failure]") {
  using C = Parallel<DP<2>>;
  SECTION("different collectives") {
    const auto msg = failure_of([] {
      run_local<C>([](auto& ctx) {
        std::vector<float> v(4, 1.0f), w(8);
        if (ctx.rank() == 0) ctx.world().all_reduce(v);
        else ctx.world().all_gather(v, w);
      }, quick());
    });
    CHECK(msg == "loom: rank 0 failed: loom: ranks of group world{0,1} disagree at collective #1: global rank 0 "
                 "called all_reduce(count=4, f32, sum) but global rank 1 called all_gather(count=4, f32)");
  }
  SECTION("different counts") {
    const auto msg = failure_of([] {
      run_local<C>([](auto& ctx) {
        std::vector<double> v(ctx.rank() == 0 ? 4 : 5, 1.0);
        ctx.world().all_reduce(v, Reduce::max);
      }, quick());
    });
    CHECK(msg.find("global rank 0 called all_reduce(count=4, f64, max) but global rank 1 called "
                   "all_reduce(count=5, f64, max)") != std::string::npos);
  }
  SECTION("different dtypes and reductions") {
    const auto msg = failure_of([] {
      run_local<C>([](auto& ctx) {
        if (ctx.rank() == 0) {
          std::vector<bf16> v(4);
          ctx.world().all_reduce(v);
        } else {
          std::vector<fp16> v(4);
          ctx.world().all_reduce(v, Reduce::min);
        }
      }, quick());
    });
    CHECK(msg.find("all_reduce(count=4, bf16, sum) but global rank 1 called all_reduce(count=4, f16, min)") !=
          std::string::npos);
  }
  SECTION("different roots") {
    const auto msg = failure_of([] {
      run_local<C>([](auto& ctx) {
        std::vector<int> v(4);
        ctx.world().broadcast(v, ctx.rank());
      }, quick());
    });
    CHECK(msg.find("broadcast(count=4, i32, root=0) but global rank 1 called broadcast(count=4, i32, root=1)") !=
          std::string::npos);
  }
  SECTION("a message of the wrong size") {
    const auto msg = failure_of([] {
      run_local<C>([](auto& ctx) {
        std::vector<float> v(ctx.rank() == 0 ? 3 : 4);
        if (ctx.rank() == 0) ctx.world().send(v, 1);
        else ctx.world().recv(v, 0);
      }, quick());
    });
    CHECK(msg.find("global rank 0 sent 3 f32 elements but global rank 1 expected 4 f32") != std::string::npos);
  }
  SECTION("all_to_all_v counts that do not pair up") {
    const auto msg = failure_of([] {
      run_local<C>([](auto& ctx) {
        std::vector<float> s(4), r(4);
        std::vector<std::size_t> sc{1, 1}, sd{0, 1}, rc{1, ctx.rank() == 0 ? 2u : 1u}, rd{0, 1};
        ctx.world().all_to_all_v(s, sc, sd, r, rc, rd);
      }, quick());
    });
    CHECK(msg.find("group rank 1 sends 1 elements to group rank 0, which expects 2") != std::string::npos);
  }
}

TEST_CASE("sizes are checked where they are given", "[comm][local]") {
  using C = Parallel<DP<2>>;
  // Both ranks fail on their own at once: the lowest-numbered is reported, whichever thread got there first.
  for (int i = 0; i < 50; ++i) {
    const auto msg = failure_of([] {
      run_local<C>([](auto& ctx) {
        std::vector<float> s(5), r(2);
        ctx.world().reduce_scatter(s, r);
      }, quick());
    });
    REQUIRE(msg == "loom: rank 0 failed: loom: reduce_scatter: send has 5 elements but must hold size()*recv.size() "
                   "= 2*2 (group world{0,1}, rank 0)");
  }
}

TEST_CASE("a point-to-point receive that nobody sends times out naming the sender", "[comm][local][failure]") {
  using C = Parallel<PP<2>>;
  const auto msg = failure_of([] {
    run_local<C>([](auto& ctx) {
      std::vector<float> v(3);
      if (ctx.rank() == 1) ctx.template comm<Axis::pp>().recv(v, 0);
    }, quick(500));
  });
  CHECK(msg.find("loom: recv #1 between global ranks 1 and 0 on group pp{0,1} timed out after 500 ms: global rank "
                 "0 has posted 0 sends to this rank") != std::string::npos);
}

// The executor runs a table as the table says: with F, B and W costed by sleeping, every schedule's measured step
// and bubble are within 10% of what simulate() computes for the table; the executor holds no more activations
// than the verified peak; a table for another pipeline is refused.
#include "catch.hpp"

#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/pipeline/costed_model.hpp>
#include <loom/pipeline/executor.hpp>

#include <string>

using namespace loom;
using namespace loom::pipeline;

namespace {

template <int P>
void check(Schedule s, int m, int v, Costs c) {
  const auto table = make_schedule_checked(s, P, m, v);
  const auto sim = simulate(table, c);
  const auto check = verify(table, c);
  REQUIRE(sim.completed);
  const double unit = 0.02;
  auto fits = [&](const MeasuredStep& g) {
    return std::abs(g.makespan - sim.makespan) <= 0.1 * sim.makespan &&
           std::abs(g.bubble - sim.bubble) <= 0.1 * std::max(sim.bubble, 0.1);
  };
  MeasuredStep got = time_schedule<P>(table, unit, c);
  for (int retry = 0; retry < 4 && !fits(got); ++retry)
    got = time_schedule<P>(table, unit, c);  // a loaded machine oversleeps; a fair run shows the schedule
  INFO(describe_schedule(s) << " p=" << P << " m=" << m << " v=" << v << ": measured step " << got.makespan
                            << " units, bubble " << got.bubble << "; table " << sim.makespan << ", " << sim.bubble);
  CHECK(std::abs(got.makespan - sim.makespan) <= 0.1 * sim.makespan);
  CHECK(std::abs(got.bubble - sim.bubble) <= 0.1 * std::max(sim.bubble, 0.1));
  for (int st = 0; st < P; ++st) CHECK(got.peak[st] <= check.peak_held[st]);
}

}  // namespace

TEST_CASE("the executor's measured step and bubble are the table's", "[pipeline]") {
  const Costs equal{1, 1, 1}, uneven{1, 2, 1};
  check<4>(Schedule::gpipe, 8, 1, equal);
  check<4>(Schedule::one_f_one_b, 8, 1, equal);
  check<4>(Schedule::interleaved, 8, 2, equal);
  check<4>(Schedule::zero_bubble_h1, 8, 1, equal);
  check<4>(Schedule::zero_bubble_v, 8, 1, equal);
  check<2>(Schedule::one_f_one_b, 4, 1, uneven);
  check<2>(Schedule::zero_bubble_v, 6, 1, uneven);
}

TEST_CASE("a table for another pipeline or schedule is refused", "[pipeline]") {
  std::vector<std::string> msg(2);
  run_local<Parallel<PP<2>>>([&](auto& ctx) {
    CostedModel part(0, 0, 0, ctx.rank() == 1);
    auto& pp = ctx.template comm<Axis::pp>();
    Executor<CostedModel, std::remove_reference_t<decltype(pp)>> exec({&part}, pp, Schedule::one_f_one_b);
    try {
      exec.run(make_schedule_checked(Schedule::one_f_one_b, 4, 4), [](int) {
        return CostedModel::MicroBatch{nullptr, nullptr, 1, 1};
      });
    } catch (const Error& e) {
      msg[ctx.rank()] = e.what();
    }
  });
  for (const auto& m : msg) CHECK(m.find("a table for 4 stages on a pipeline of 2") != std::string::npos);
}

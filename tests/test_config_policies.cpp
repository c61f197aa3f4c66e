// Tests of the axis policies, their options and the queries and names of Parallel<...>.
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include <loom/config.hpp>

#include "catch.hpp"

namespace {

using loom::Axis;
using loom::CP;
using loom::CpAlgorithm;
using loom::DP;
using loom::EP;
using loom::PP;
using loom::Schedule;
using loom::TP;

// ---- policies are trivial types carrying their configuration -------------------------------------------------------
static_assert(TP<4, loom::SequenceParallel>::size == 4);
static_assert(TP<4>::axis == Axis::tp);
static_assert(CP<2>::axis == Axis::cp);
static_assert(DP<8>::axis == Axis::dp);
static_assert(PP<3>::axis == Axis::pp);
static_assert(EP<2>::axis == Axis::ep);
static_assert(std::is_same_v<TP<4, loom::SequenceParallel>::options, loom::Options<loom::SequenceParallel>>);
static_assert(std::is_same_v<PP<4, loom::GPipe, loom::Interleaved<2>>::options,
                             loom::Options<loom::GPipe, loom::Interleaved<2>>>);
static_assert(std::is_same_v<EP<4>::options, loom::Options<>>);
static_assert(std::is_empty_v<TP<4>> && std::is_trivial_v<DP<2, loom::ZeRO<1>>>);

static_assert(loom::AxisPolicy<TP<2>> && loom::AxisPolicy<EP<2>> && loom::AxisPolicy<const PP<2, loom::GPipe>>);
static_assert(!loom::AxisPolicy<int> && !loom::AxisPolicy<loom::ZeRO<1>> && !loom::AxisPolicy<loom::Parallel<>>);
static_assert(loom::Option<loom::ZeRO<2>> && loom::Option<loom::SequenceParallel> && loom::Option<loom::Ulysses>);
static_assert(loom::Option<loom::ZeroBubbleH1> && loom::Option<loom::Interleaved<3>>);
static_assert(!loom::Option<int> && !loom::Option<TP<2>>);
static_assert(loom::ZeRO<3>::stage == 3 && loom::ZeRO<3>::owner == Axis::dp);
static_assert(loom::Interleaved<5>::virtual_stages == 5 && loom::Interleaved<5>::owner == Axis::pp);
static_assert(loom::ZeroBubbleV::schedule == Schedule::zero_bubble_v && loom::GPipe::owner == Axis::pp);
static_assert(loom::Ulysses::algorithm == CpAlgorithm::ulysses && loom::Ring::owner == Axis::cp);
static_assert(loom::ParallelLayout<loom::Parallel<TP<2>>> && !loom::ParallelLayout<TP<2>>);

// ---- option queries: defaults -------------------------------------------------------------------------------------
using Plain = loom::Parallel<TP<2>, CP<2>, DP<2>, PP<2>>;
static_assert(Plain::zero_stage == 0);
static_assert(!Plain::sequence_parallel);
static_assert(Plain::virtual_stages == 1);
static_assert(Plain::schedule == Schedule::one_f_one_b);
static_assert(Plain::cp_algorithm == CpAlgorithm::ring);
static_assert(loom::Parallel<>::zero_stage == 0 && loom::Parallel<>::schedule == Schedule::one_f_one_b);

// ---- option queries: each option read back ---------------------------------------------------------------------
static_assert(loom::Parallel<DP<8, loom::ZeRO<1>>>::zero_stage == 1);
static_assert(loom::Parallel<DP<8, loom::ZeRO<3>>, TP<2>>::zero_stage == 3);
static_assert(loom::Parallel<DP<8, loom::ZeRO<0>>>::zero_stage == 0);
static_assert(loom::Parallel<TP<4, loom::SequenceParallel>>::sequence_parallel);
static_assert(loom::Parallel<PP<4, loom::Interleaved<2>>>::virtual_stages == 2);
static_assert(loom::Parallel<PP<4, loom::Interleaved<2>>>::schedule == Schedule::interleaved);
static_assert(loom::Parallel<PP<4, loom::Interleaved<1>>>::schedule == Schedule::one_f_one_b);
static_assert(loom::Parallel<PP<4, loom::Interleaved<2>, loom::OneFOneB>>::schedule == Schedule::interleaved);
static_assert(loom::Parallel<PP<4, loom::Interleaved<1>, loom::OneFOneB>>::schedule == Schedule::one_f_one_b);
static_assert(loom::Parallel<PP<4, loom::ZeroBubbleV, loom::Interleaved<2>>>::schedule == Schedule::zero_bubble_v);
static_assert(loom::Parallel<PP<4, loom::ZeroBubbleV, loom::Interleaved<2>>>::virtual_stages == 2);
static_assert(loom::Parallel<PP<4, loom::GPipe>>::schedule == Schedule::gpipe);
static_assert(loom::Parallel<PP<4, loom::ZeroBubbleH1>>::schedule == Schedule::zero_bubble_h1);
static_assert(loom::Parallel<CP<2, loom::Ulysses>>::cp_algorithm == CpAlgorithm::ulysses);
static_assert(loom::Parallel<CP<2, loom::Ring>>::cp_algorithm == CpAlgorithm::ring);

// Every option at once, axes and options in an unusual order.
using Everything = loom::Parallel<EP<2>, DP<2, loom::ZeRO<2>>, PP<2, loom::OneFOneB, loom::Interleaved<3>>,
                                  CP<2, loom::Ulysses>, TP<2, loom::SequenceParallel>>;
static_assert(Everything::world_size == 16);
static_assert(Everything::zero_stage == 2);
static_assert(Everything::sequence_parallel);
static_assert(Everything::virtual_stages == 3);
static_assert(Everything::schedule == Schedule::interleaved);
static_assert(Everything::cp_algorithm == CpAlgorithm::ulysses);
static_assert(Everything::size<Axis::edp> == 2);

// ---- the policy of each axis ----------------------------------------------------------------------------------------
static_assert(std::is_same_v<Everything::policy<Axis::dp>, DP<2, loom::ZeRO<2>>>);
static_assert(std::is_same_v<Everything::policy<Axis::ep>, EP<2>>);
static_assert(std::is_same_v<loom::Parallel<>::policy<Axis::tp>, TP<1>>);
static_assert(std::is_same_v<loom::Parallel<DP<4>>::policy<Axis::pp>, PP<1>>);
static_assert(std::is_same_v<loom::Parallel<DP<4>>::policy<Axis::ep>, EP<1>>);

// ---- names --------------------------------------------------------------------------------------------------------
static_assert(loom::Parallel<TP<2>, PP<4>, DP<2>>::name() == "tp2.pp4.dp2");
static_assert(loom::Parallel<DP<2>, PP<4>, TP<2>>::name() == "dp2.pp4.tp2");
static_assert(loom::Parallel<DP<8, loom::ZeRO<1>>>::name() == "dp8.zero1");
static_assert(loom::Parallel<TP<4, loom::SequenceParallel>>::name() == "tp4.sp");
static_assert(loom::Parallel<PP<4, loom::Interleaved<2>>>::name() == "pp4.v2");
static_assert(loom::Parallel<CP<2, loom::Ulysses>>::name() == "cp2.ulysses");
static_assert(loom::Parallel<PP<4, loom::GPipe>>::name() == "pp4.gpipe");
static_assert(loom::Parallel<PP<12, loom::OneFOneB>>::name() == "pp12.1f1b");
static_assert(loom::Parallel<PP<2, loom::ZeroBubbleV, loom::Interleaved<2>>>::name() == "pp2.zb-v.v2");
static_assert(loom::Parallel<TP<1>, DP<1024>>::name() == "tp1.dp1024");
static_assert(loom::Parallel<>::name() == "single");
static_assert(Everything::name() == "ep2.dp2.zero2.pp2.1f1b.v3.cp2.ulysses.tp2.sp");

// ---- describe_* -----------------------------------------------------------------------------------------------------
static_assert(loom::describe_axis(Axis::edp) == "edp");
static_assert(loom::describe_schedule(Schedule::zero_bubble_h1) == "zb-h1");
static_assert(loom::describe_cp_algorithm(CpAlgorithm::ulysses) == "ulysses");

TEST_CASE("axes, schedules and CP algorithms have their short names at run time", "[config][names]") {
  const Axis axes[] = {Axis::tp, Axis::cp, Axis::dp, Axis::pp, Axis::ep, Axis::edp};
  const char* names[] = {"tp", "cp", "dp", "pp", "ep", "edp"};
  for (int i = 0; i < 6; ++i) CHECK(std::string(loom::describe_axis(axes[i])) == names[i]);

  const Schedule schedules[] = {Schedule::gpipe, Schedule::one_f_one_b, Schedule::interleaved,
                                Schedule::zero_bubble_h1, Schedule::zero_bubble_v};
  const char* flags[] = {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"};
  for (int i = 0; i < 5; ++i) CHECK(std::string(loom::describe_schedule(schedules[i])) == flags[i]);

  CHECK(std::string(loom::describe_cp_algorithm(CpAlgorithm::ring)) == "ring");
  CHECK(std::string(loom::describe_cp_algorithm(CpAlgorithm::ulysses)) == "ulysses");
}

TEST_CASE("a layout's name is usable at run time", "[config][names]") {
  using C = loom::Parallel<TP<4, loom::SequenceParallel>, DP<8, loom::ZeRO<1>>>;
  const std::string name(C::name());
  CHECK(name == "tp4.sp.dp8.zero1");
  // The view's characters end in a '\0' right after the name, with none before it: usable as a C string.
  CHECK(std::strlen(C::name().data()) == 16);
  CHECK(C::name().data()[C::name().size()] == '\0');
}

}  // namespace

// Tests of the mesh of Parallel<...>: sizes, coordinates, groups and expert groups. Compile-time facts are
// static_asserts; the properties every layout must have are checked at run time over a list of layouts.
#include <algorithm>
#include <array>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <loom/config.hpp>

#include "catch.hpp"

namespace {

using loom::Axis;
using loom::Coords;
using loom::CP;
using loom::DP;
using loom::EP;
using loom::PP;
using loom::TP;

// ---- Megatron-Core's documented example: 16 GPUs, TP=2, PP=4, hence DP=2 ---------------------------------------
using Megatron = loom::Parallel<TP<2>, PP<4>, DP<2>>;

static_assert(Megatron::world_size == 16);
static_assert(Megatron::size<Axis::tp> == 2);
static_assert(Megatron::size<Axis::cp> == 1);
static_assert(Megatron::size<Axis::dp> == 2);
static_assert(Megatron::size<Axis::pp> == 4);
static_assert(Megatron::size<Axis::ep> == 1);
static_assert(Megatron::size<Axis::edp> == 2);
static_assert(Megatron::coord<Axis::pp>(5) == 1);
static_assert(Megatron::coord<Axis::tp>(5) == 1);
static_assert(Megatron::coord<Axis::dp>(5) == 0);
static_assert(Megatron::coord<Axis::dp>(7) == 1);
static_assert(Megatron::coord<Axis::pp>(15) == 3);
static_assert(Megatron::coords(5) == Coords{1, 0, 0, 1});
static_assert(Megatron::coords(14) == Coords{0, 0, 1, 3});
static_assert(Megatron::rank_of(Coords{1, 0, 1, 3}) == 15);
static_assert(Megatron::rank_of(Coords{.tp = 0, .cp = 0, .dp = 1, .pp = 2}) == 10);

constexpr std::array<int, 2> megatron_dp5 = Megatron::group<Axis::dp>(5);
static_assert(megatron_dp5 == std::array<int, 2>{5, 7});
static_assert(Megatron::group<Axis::tp>(5) == std::array<int, 2>{4, 5});
static_assert(Megatron::group<Axis::pp>(5) == std::array<int, 4>{1, 5, 9, 13});
static_assert(Megatron::group<Axis::tp, Axis::pp>(5) == std::array<int, 8>{0, 1, 4, 5, 8, 9, 12, 13});
static_assert(Megatron::group<Axis::pp, Axis::tp>(5) == Megatron::group<Axis::tp, Axis::pp>(5));
static_assert(Megatron::group<Axis::dp, Axis::cp>(5) == std::array<int, 2>{5, 7});
static_assert(Megatron::group<Axis::tp, Axis::dp>(9) == std::array<int, 4>{8, 9, 10, 11});
static_assert(Megatron::group<>(9) == std::array<int, 1>{9});
static_assert(Megatron::group_size<Axis::tp, Axis::pp> == 8);
static_assert(Megatron::group_count<Axis::tp, Axis::pp> == 2);
static_assert(Megatron::group_index<Axis::dp>(5) == 3);
static_assert(Megatron::group_rank<Axis::dp>(5) == 0);
static_assert(Megatron::group_rank<Axis::dp>(7) == 1);
static_assert(Megatron::group_index<Axis::pp>(13) == 1);
static_assert(Megatron::group_rank<Axis::pp>(13) == 3);
static_assert(Megatron::group_index<Axis::tp>(5) == 2);
static_assert(Megatron::group_index<Axis::tp, Axis::pp>(6) == 1);

static_assert(Megatron::groups<Axis::dp>() == std::array<std::array<int, 2>, 8>{{{0, 2},
                                                                                  {1, 3},
                                                                                  {4, 6},
                                                                                  {5, 7},
                                                                                  {8, 10},
                                                                                  {9, 11},
                                                                                  {12, 14},
                                                                                  {13, 15}}});
static_assert(Megatron::groups<Axis::tp>() == std::array<std::array<int, 2>, 8>{{{0, 1},
                                                                                  {2, 3},
                                                                                  {4, 5},
                                                                                  {6, 7},
                                                                                  {8, 9},
                                                                                  {10, 11},
                                                                                  {12, 13},
                                                                                  {14, 15}}});
static_assert(Megatron::groups<Axis::pp>() ==
              std::array<std::array<int, 4>, 4>{{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}});

// The order in which axes are given changes the name only, never the mesh.
using MegatronReordered = loom::Parallel<DP<2>, PP<4>, TP<2>>;
static_assert(MegatronReordered::groups<Axis::dp>() == Megatron::groups<Axis::dp>());
static_assert(MegatronReordered::groups<Axis::pp>() == Megatron::groups<Axis::pp>());
static_assert(MegatronReordered::coords(11) == Megatron::coords(11));

// ---- context parallelism sits between tp and dp --------------------------------------------------------------------
using Tp4Cp2Dp2 = loom::Parallel<TP<4>, CP<2>, DP<2>>;
static_assert(Tp4Cp2Dp2::world_size == 16);
static_assert(Tp4Cp2Dp2::coords(13) == Coords{1, 1, 1, 0});
static_assert(Tp4Cp2Dp2::group<Axis::tp>(13) == std::array<int, 4>{12, 13, 14, 15});
static_assert(Tp4Cp2Dp2::group<Axis::cp>(13) == std::array<int, 2>{9, 13});
static_assert(Tp4Cp2Dp2::group<Axis::dp>(13) == std::array<int, 2>{5, 13});
static_assert(Tp4Cp2Dp2::group<Axis::dp, Axis::cp>(13) == std::array<int, 4>{1, 5, 9, 13});
static_assert(Tp4Cp2Dp2::group_index<Axis::dp, Axis::cp>(13) == 1);
static_assert(Tp4Cp2Dp2::group_rank<Axis::dp, Axis::cp>(13) == 3);
static_assert(Tp4Cp2Dp2::size<Axis::edp> == 4);

// ---- expert parallelism: j = cp + CP*dp, ep = j % EP, edp = j / EP --------------------------------------------------
using Tp2Cp2Dp2Ep4 = loom::Parallel<TP<2>, CP<2>, DP<2>, EP<4>>;
static_assert(Tp2Cp2Dp2Ep4::world_size == 8);
static_assert(Tp2Cp2Dp2Ep4::size<Axis::ep> == 4);
static_assert(Tp2Cp2Dp2Ep4::size<Axis::edp> == 1);
static_assert(Tp2Cp2Dp2Ep4::coord<Axis::ep>(3) == 1);
static_assert(Tp2Cp2Dp2Ep4::coord<Axis::ep>(5) == 2);
static_assert(Tp2Cp2Dp2Ep4::coord<Axis::edp>(7) == 0);
static_assert(Tp2Cp2Dp2Ep4::group<Axis::ep>(3) == std::array<int, 4>{1, 3, 5, 7});
static_assert(Tp2Cp2Dp2Ep4::group<Axis::edp>(3) == std::array<int, 1>{3});

using Tp2Dp4Ep2 = loom::Parallel<TP<2>, DP<4>, EP<2>>;
static_assert(Tp2Dp4Ep2::size<Axis::edp> == 2);
static_assert(Tp2Dp4Ep2::coord<Axis::ep>(3) == 1);
static_assert(Tp2Dp4Ep2::coord<Axis::edp>(3) == 0);
static_assert(Tp2Dp4Ep2::coord<Axis::edp>(5) == 1);
static_assert(Tp2Dp4Ep2::group<Axis::ep>(3) == std::array<int, 2>{1, 3});
static_assert(Tp2Dp4Ep2::group<Axis::edp>(3) == std::array<int, 2>{3, 7});
static_assert(Tp2Dp4Ep2::group<Axis::tp, Axis::ep>(3) == std::array<int, 4>{0, 1, 2, 3});
static_assert(Tp2Dp4Ep2::group<Axis::ep, Axis::edp>(3) == Tp2Dp4Ep2::group<Axis::dp>(3));
static_assert(Tp2Dp4Ep2::groups<Axis::ep>() ==
              std::array<std::array<int, 2>, 4>{{{0, 2}, {1, 3}, {4, 6}, {5, 7}}});
static_assert(Tp2Dp4Ep2::groups<Axis::edp>() ==
              std::array<std::array<int, 2>, 4>{{{0, 4}, {1, 5}, {2, 6}, {3, 7}}});
static_assert(Tp2Dp4Ep2::group_index<Axis::edp>(6) == 2);
static_assert(Tp2Dp4Ep2::group_rank<Axis::edp>(6) == 1);

using Dp4Cp2Ep4 = loom::Parallel<DP<4>, CP<2>, EP<4>>;
static_assert(Dp4Cp2Ep4::group<Axis::ep>(5) == std::array<int, 4>{4, 5, 6, 7});
static_assert(Dp4Cp2Ep4::group<Axis::edp>(5) == std::array<int, 2>{1, 5});
static_assert(Dp4Cp2Ep4::group<Axis::ep, Axis::edp>(5) == Dp4Cp2Ep4::group<Axis::dp, Axis::cp>(5));

// ---- degenerate and uneven layouts ------------------------------------------------------------------------------
using Single = loom::Parallel<>;
static_assert(Single::world_size == 1);
static_assert(Single::size<Axis::edp> == 1);
static_assert(Single::coords(0) == Coords{});
static_assert(Single::group<Axis::dp>(0) == std::array<int, 1>{0});
static_assert(Single::groups<Axis::tp, Axis::pp>().size() == 1);

using Dp8 = loom::Parallel<DP<8, loom::ZeRO<1>>>;
static_assert(Dp8::world_size == 8);
static_assert(Dp8::group<Axis::dp>(3) == std::array<int, 8>{0, 1, 2, 3, 4, 5, 6, 7});
static_assert(Dp8::group<Axis::tp>(3) == std::array<int, 1>{3});
static_assert(Dp8::group_index<Axis::tp>(3) == 3);

using Tp3Dp5 = loom::Parallel<TP<3>, DP<5>>;
static_assert(Tp3Dp5::world_size == 15);
static_assert(Tp3Dp5::coords(14) == Coords{2, 0, 4, 0});
static_assert(Tp3Dp5::group<Axis::dp>(7) == std::array<int, 5>{1, 4, 7, 10, 13});
static_assert(Tp3Dp5::group_index<Axis::dp>(7) == 1);
static_assert(Tp3Dp5::group_rank<Axis::dp>(7) == 2);

using Uneven = loom::Parallel<PP<2>, EP<3>, DP<3>, CP<2>, TP<3>>;
static_assert(Uneven::world_size == 36);
static_assert(Uneven::size<Axis::edp> == 2);
static_assert(Uneven::rank_of(Coords{2, 1, 2, 1}) == 2 + 3 * (1 + 2 * (2 + 3 * 1)));

// ---- run-time properties over a list of layouts -------------------------------------------------------------------

// The test's own decomposition of a rank, written from the formula rather than from the library.
struct Ref {
  int tp, cp, dp, pp, ep, edp;
};

template <class C>
Ref reference_coords(int rank) {
  const int t = C::template size<Axis::tp>, c = C::template size<Axis::cp>, d = C::template size<Axis::dp>;
  Ref r{};
  r.tp = rank % t;
  r.cp = rank / t % c;
  r.dp = rank / (t * c) % d;
  r.pp = rank / (t * c * d);
  const int j = r.cp + c * r.dp;
  r.ep = j % C::template size<Axis::ep>;
  r.edp = j / C::template size<Axis::ep>;
  return r;
}

int ref_coord(const Ref& r, Axis a) {
  switch (a) {
    case Axis::tp: return r.tp;
    case Axis::cp: return r.cp;
    case Axis::dp: return r.dp;
    case Axis::pp: return r.pp;
    case Axis::ep: return r.ep;
    case Axis::edp: return r.edp;
  }
  return -1;
}

// The group over As of rank, found by brute force: every rank that agrees with it on the other axes of its mesh.
template <class C, Axis... As>
std::vector<int> brute_force_group(int rank) {
  constexpr bool expert = ((As == Axis::ep || As == Axis::edp) || ...);
  const std::vector<Axis> mesh = expert ? std::vector<Axis>{Axis::tp, Axis::ep, Axis::edp, Axis::pp}
                                        : std::vector<Axis>{Axis::tp, Axis::cp, Axis::dp, Axis::pp};
  const std::vector<Axis> listed{As...};
  const Ref me = reference_coords<C>(rank);
  std::vector<int> out;
  for (int other = 0; other < C::world_size; ++other) {
    const Ref them = reference_coords<C>(other);
    bool same = true;
    for (Axis a : mesh) {
      if (std::find(listed.begin(), listed.end(), a) == listed.end() && ref_coord(me, a) != ref_coord(them, a)) {
        same = false;
      }
    }
    if (same) out.push_back(other);
  }
  return out;
}

template <class C, Axis... As>
void check_groups() {
  constexpr int size = C::template group_size<As...>;
  constexpr int count = C::template group_count<As...>;
  REQUIRE(size * count == C::world_size);
  REQUIRE(size == (1 * ... * C::template size<As>));

  // Every group<As...>(rank) is exactly the brute-force group, in ascending order, and contains rank.
  for (int r = 0; r < C::world_size; ++r) {
    const auto g = C::template group<As...>(r);
    const std::vector<int> got(g.begin(), g.end());
    CHECK(got == brute_force_group<C, As...>(r));
    const int pos = C::template group_rank<As...>(r);
    REQUIRE(pos >= 0);
    REQUIRE(pos < size);
    CHECK(g[pos] == r);
  }

  // groups() partitions the ranks into groups of equal size, indexed by group_index, ordered by first rank.
  const auto all = C::template groups<As...>();
  REQUIRE(static_cast<int>(all.size()) == count);
  std::vector<int> seen(C::world_size, 0);
  for (int gi = 0; gi < count; ++gi) {
    REQUIRE(static_cast<int>(all[gi].size()) == size);
    if (gi > 0) CHECK(all[gi - 1][0] < all[gi][0]);
    for (int i = 0; i < size; ++i) {
      const int m = all[gi][i];
      REQUIRE(m >= 0);
      REQUIRE(m < C::world_size);
      ++seen[m];
      CHECK(C::template group_index<As...>(m) == gi);
      CHECK(C::template group_rank<As...>(m) == i);
    }
  }
  CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
}

using Tp2Cp2Dp2Ep2 = loom::Parallel<TP<2>, CP<2>, DP<2>, EP<2>>;

// ---- Layouts by name: LayoutOf<"..."> parses Parallel<...>::name()'s spelling (or train_gpt's, with commas) --------
static_assert(std::is_same_v<loom::LayoutOf<"single">, loom::Parallel<>>);
static_assert(std::is_same_v<loom::LayoutOf<"tp2.sp.pp2.zb-v.dp2.zero1">,
                             loom::Parallel<TP<2, loom::SequenceParallel>, PP<2, loom::ZeroBubbleV>,
                                            DP<2, loom::ZeRO<1>>>>);
static_assert(std::is_same_v<loom::LayoutOf<"dp4,zero3,shard2">, loom::Parallel<DP<4, loom::ZeRO<3>,
                                                                                 loom::HybridShard<2>>>>);
static_assert(std::is_same_v<loom::LayoutOf<"pp4.v2.dp2">, loom::Parallel<PP<4, loom::Interleaved<2>>, DP<2>>>);
static_assert(std::is_same_v<loom::LayoutOf<"cp4.ulysses">, loom::Parallel<CP<4, loom::Ulysses>>>);
// Defaults add nothing (size 1, zero0, ring, 1f1b); the axes come out in the order tp, cp, pp, dp, ep.
static_assert(std::is_same_v<loom::LayoutOf<"tp1.cp2.ring.pp2.1f1b.dp1.zero0">, loom::Parallel<CP<2>, PP<2>>>);
static_assert(loom::LayoutOf<"ep2.dp4.zero1">::name() == "dp4.zero1.ep2");
static_assert(loom::LayoutOf<"cp2,ulysses,tp2,sp">::name() == "tp2.sp.cp2.ulysses");
// Any size: a cluster's layout.
static_assert(loom::LayoutOf<"tp8.pp16.dp64.zero1">::world_size == 8192);
static_assert(loom::LayoutOf<"tp8.cp4.pp8.dp32.ep8">::size<Axis::edp> == 16);
// The name of a layout whose axes are in that order gives the layout back.
using NamedBack = loom::Parallel<TP<4, loom::SequenceParallel>, CP<2>, PP<2, loom::GPipe>, DP<2, loom::ZeRO<2>>, EP<2>>;
static_assert(std::is_same_v<loom::LayoutOf<loom::name_of_layout<NamedBack>>, NamedBack>);
static_assert(std::is_same_v<loom::LayoutOf<loom::name_of_layout<Megatron>>, Megatron>);

TEMPLATE_TEST_CASE("rank and coordinates are a bijection", "[config][mesh]", Megatron, MegatronReordered, Tp4Cp2Dp2,
                   Tp2Cp2Dp2Ep4, Tp2Cp2Dp2Ep2, Tp2Dp4Ep2, Dp4Cp2Ep4, Dp8, Single, Tp3Dp5, Uneven) {
  using C = TestType;
  const int t = C::template size<Axis::tp>, c = C::template size<Axis::cp>, d = C::template size<Axis::dp>,
            p = C::template size<Axis::pp>;
  REQUIRE(C::world_size == t * c * d * p);
  REQUIRE(C::template size<Axis::ep> * C::template size<Axis::edp> == c * d);

  std::vector<int> hits(C::world_size, 0);
  for (int pi = 0; pi < p; ++pi)
    for (int di = 0; di < d; ++di)
      for (int ci = 0; ci < c; ++ci)
        for (int ti = 0; ti < t; ++ti) {
          const Coords at{ti, ci, di, pi};
          const int r = C::rank_of(at);
          REQUIRE(r >= 0);
          REQUIRE(r < C::world_size);
          ++hits[r];
          CHECK(C::coords(r) == at);
        }
  CHECK(std::all_of(hits.begin(), hits.end(), [](int n) { return n == 1; }));

  for (int r = 0; r < C::world_size; ++r) {
    const Ref ref = reference_coords<C>(r);
    CHECK(C::coords(r) == Coords{ref.tp, ref.cp, ref.dp, ref.pp});
    CHECK(C::rank_of(C::coords(r)) == r);
    CHECK(C::template coord<Axis::tp>(r) == ref.tp);
    CHECK(C::template coord<Axis::cp>(r) == ref.cp);
    CHECK(C::template coord<Axis::dp>(r) == ref.dp);
    CHECK(C::template coord<Axis::pp>(r) == ref.pp);
    CHECK(C::template coord<Axis::ep>(r) == ref.ep);
    CHECK(C::template coord<Axis::edp>(r) == ref.edp);
  }
}

TEMPLATE_TEST_CASE("every kind of group partitions the world", "[config][mesh]", Megatron, MegatronReordered,
                   Tp4Cp2Dp2, Tp2Cp2Dp2Ep4, Tp2Cp2Dp2Ep2, Tp2Dp4Ep2, Dp4Cp2Ep4, Dp8, Single, Tp3Dp5, Uneven) {
  using C = TestType;
  SECTION("one axis") {
    check_groups<C, Axis::tp>();
    check_groups<C, Axis::cp>();
    check_groups<C, Axis::dp>();
    check_groups<C, Axis::pp>();
    check_groups<C, Axis::ep>();
    check_groups<C, Axis::edp>();
  }
  SECTION("several axes") {
    check_groups<C, Axis::tp, Axis::pp>();
    check_groups<C, Axis::dp, Axis::cp>();
    check_groups<C, Axis::pp, Axis::dp>();
    check_groups<C, Axis::tp, Axis::cp, Axis::dp>();
    check_groups<C, Axis::ep, Axis::edp>();
    check_groups<C, Axis::tp, Axis::ep>();
    check_groups<C, Axis::edp, Axis::pp>();
    check_groups<C, Axis::tp, Axis::cp, Axis::dp, Axis::pp>();
    check_groups<C>();
  }
}

TEMPLATE_TEST_CASE("ep x edp spans exactly the dp x cp group", "[config][mesh][expert]", Megatron, Tp4Cp2Dp2,
                   Tp2Cp2Dp2Ep4, Tp2Cp2Dp2Ep2, Tp2Dp4Ep2, Dp4Cp2Ep4, Dp8, Uneven) {
  using C = TestType;
  for (int r = 0; r < C::world_size; ++r) {
    const auto dense = C::template group<Axis::dp, Axis::cp>(r);
    std::set<int> spanned;
    for (int m : C::template group<Axis::ep>(r)) {
      for (int n : C::template group<Axis::edp>(m)) spanned.insert(n);
    }
    CHECK(spanned == std::set<int>(dense.begin(), dense.end()));
    const auto both = C::template group<Axis::ep, Axis::edp>(r);
    CHECK(std::vector<int>(both.begin(), both.end()) == std::vector<int>(dense.begin(), dense.end()));
    // An ep group keeps tp and pp; its ranks are EP consecutive values of j = cp + CP*dp.
    for (int m : C::template group<Axis::ep>(r)) {
      CHECK(C::template coord<Axis::tp>(m) == C::template coord<Axis::tp>(r));
      CHECK(C::template coord<Axis::pp>(m) == C::template coord<Axis::pp>(r));
      CHECK(C::template coord<Axis::edp>(m) == C::template coord<Axis::edp>(r));
    }
  }
}

TEST_CASE("a rank or coordinate outside the mesh throws", "[config][mesh]") {
  CHECK_THROWS_AS(Megatron::coords(16), std::out_of_range);
  CHECK_THROWS_AS(Megatron::coords(-1), std::out_of_range);
  CHECK_THROWS_AS(Megatron::coord<Axis::ep>(16), std::out_of_range);
  CHECK_THROWS_AS(Megatron::group<Axis::dp>(99), std::out_of_range);
  CHECK_THROWS_AS(Megatron::group_index<Axis::dp>(16), std::out_of_range);
  CHECK_THROWS_AS(Megatron::rank_of(Coords{2, 0, 0, 0}), std::out_of_range);
  CHECK_THROWS_AS(Megatron::rank_of(Coords{0, 1, 0, 0}), std::out_of_range);
  CHECK_THROWS_AS(Megatron::rank_of(Coords{0, 0, 0, 4}), std::out_of_range);
  std::string message;
  try {
    (void)Megatron::coords(16);
  } catch (const std::out_of_range& e) {
    message = e.what();
  }
  CHECK(message == "loom: rank 16 is outside 0..15");
  CHECK_NOTHROW(Megatron::coords(15));
}

}  // namespace

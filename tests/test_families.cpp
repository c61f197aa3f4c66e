// The Llama and Mixtral families on every axis: 5 AdamW steps in double with dropout, through the testing kit
// (<loom/testing/equivalence.hpp>), on tensor parallelism with and without sequence parallelism, pipelines under
// 1F1B and ZB-V, ZeRO-1 and ZeRO-3, context parallelism by ring and Ulysses, expert parallelism (Mixtral) and
// TP·PP·DP, each against the single-rank run: losses, parameters and AdamW's moments within 1e-9.
#include "catch.hpp"

#include <loom/models/gpt.hpp>
#include <loom/testing/equivalence.hpp>

#include <tuple>

using namespace loom;

namespace {

// Llama 3's parts at test size: grouped-query attention (4 heads over 2), RoPE with Llama 3's scaling (wavelengths
// past 8 positions stretched 4 times, between 2 and 8 interpolated), SwiGLU of width 24, no biases, untied output.
constexpr models::GptShape llama = models::llama3_spec({4, 4, 2, 16, 37, 8, 24}, 10000, {4, 1, 4, 8});
// Mixtral's: Llama's block with 4 SwiGLU experts of width 12 in every block, top-2 renormalised.
constexpr models::GptShape mixtral = models::mixtral_spec({4, 4, 2, 16, 37, 8, 0, 0, 2, 1, 12}, 4, 2, 10000);

using Llama = models::Gpt<llama, double>;
using Mixtral = models::Gpt<mixtral, double>;

const testing::Training<models::GptOptions>& training() {
  static const testing::Training<models::GptOptions> t = [] {
    std::vector<std::int32_t> tok(2000);
    for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<std::int32_t>((i * i + 5 * i + 2) % 37);
    testing::Training<models::GptOptions> t{train::Batches(tok, 24, 8, train::BatchOrder::shuffle, 9), 24, 8, 5};
    t.model.dropout = 0.1f;
    t.model.moe.capacity_factor = 1.25, t.model.moe.aux_loss_coeff = 0.01;
    return t;
  }();
  return t;
}

//! Layout Cfg against the single-rank run of Model, with 4 micro-batches on a pipeline of at most 2 data-parallel
//! ranks and 2 elsewhere (the 24 sequences split over both).
template <class Model, class Cfg>
void check() {
  static const testing::Run one = testing::single_rank<Model>(training());
  testing::Training<models::GptOptions> t = training();
  t.micro_batches = Cfg::template size<Axis::pp> > 1 && Cfg::template size<Axis::dp> <= 2 ? 4 : 2;
  const auto c = testing::compare<Model>(one, testing::on_layout<Cfg, Model>(t), std::string(Cfg::name()));
  INFO(c.describe());
  CHECK(c.ok);
}

using Layouts = std::tuple<Parallel<TP<2>>, Parallel<TP<2, SequenceParallel>>, Parallel<PP<2>>,
                           Parallel<PP<2, ZeroBubbleV>>, Parallel<DP<2, ZeRO<1>>>, Parallel<DP<2, ZeRO<3>>>,
                           Parallel<CP<2>>, Parallel<CP<2, Ulysses>>, Parallel<TP<2>, PP<2>, DP<2>>>;
using ExpertLayouts = std::tuple<Parallel<DP<2>, EP<2>>, Parallel<DP<4>, EP<4>>, Parallel<TP<2>, DP<2>, EP<2>>>;

}  // namespace

TEMPLATE_LIST_TEST_CASE("Llama trains the single-rank model on every axis", "[families][llama]", Layouts) {
  check<Llama, TestType>();
}

TEMPLATE_LIST_TEST_CASE("Mixtral trains the single-rank model on every axis", "[families][mixtral]", Layouts) {
  check<Mixtral, TestType>();
}

TEMPLATE_LIST_TEST_CASE("Mixtral's experts split over expert-parallel ranks", "[families][mixtral][ep]",
                        ExpertLayouts) {
  check<Mixtral, TestType>();
}

TEST_CASE("the kit without Catch2's lists: check_layouts reports each layout", "[families][kit]") {
  const auto all = testing::check_layouts<Llama, std::tuple<Parallel<DP<2>>, Parallel<TP<2>, DP<2>>>>(training());
  REQUIRE(all.size() == 2);
  CHECK(all[0].layout == "dp2");
  for (const auto& c : all) {
    INFO(c.describe());
    CHECK(c.ok);
    CHECK(c.params <= 1e-9);
  }
  // A run that is not the model's is reported as such: one parameter moved.
  testing::Run one = testing::single_rank<Llama>(training()), moved = one;
  moved.params[5] += 1e-3;
  const auto bad = testing::compare<Llama>(one, moved, "moved");
  CHECK_FALSE(bad.ok);
  CHECK(bad.describe().find("NOT the single-rank model") != std::string::npos);
}

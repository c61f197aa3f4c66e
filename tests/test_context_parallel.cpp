// Context parallelism in the model and the trainer: CP 2, 4 and 8 with ring attention and with Ulysses, alone and
// with tensor (and sequence), data (and ZeRO 1, 2, 3) and pipeline parallelism, with grouped- and multi-query
// attention and every recompute mode, train the single-rank model (5 AdamW steps in double, dropout included:
// losses, every parameter and the optimizer state within 1e-9); a sequence that does not cut into 2·CP chunks is
// refused with its numbers; the attention's traffic per layer is the count ANCHORS.md gives; and a block keeps the
// activations of Korthikanti et al.'s count, less what the table in docs/context-parallel.md names.
#include "catch.hpp"

#include <loom/models/gpt.hpp>
#include <loom/comm/local.hpp>

#include "equivalence_checks.hpp"

#include <memory>
#include <string>
#include <tuple>

using namespace loom;
using namespace loom::test::pp;

namespace {

constexpr models::GptShape mha{2, 8, 8, 32, 37, 16};
constexpr models::GptShape gqa{2, 8, 2, 32, 37, 16};
constexpr models::GptShape mqa{2, 8, 1, 32, 37, 16};
constexpr int batch = 8, seq = 16;  // 16 tokens: 2·CP chunks for every CP up to 8

Setup cp_setup(models::Recompute recompute = models::Recompute::none) {
  std::vector<std::int32_t> tok(3000);
  for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<std::int32_t>((i * i + 3 * i + 1) % mha.vocab);
  models::GptOptions o;
  o.dropout = 0.1f;
  o.recompute = recompute;
  return {train::Batches(tok, batch, seq, train::BatchOrder::shuffle, 4), batch, seq, o};
}

template <models::GptShape S>
const Run& reference() {
  static const Run r = [] {
    const auto su = cp_setup();
    return test::single_rank<S>(su.data, su.options, steps, batch, seq);
  }();
  return r;
}

//! Layout Cfg with m micro-batches against the single-rank run.
template <class Cfg, models::GptShape S = mha>
void check(int micro_batches = 1, models::Recompute recompute = models::Recompute::none) {
  INFO("layout " << Cfg::name() << ", heads " << S.heads << "/" << S.kv_heads << ", m = " << micro_batches
                 << ", recompute " << models::describe_recompute(recompute));
  std::vector<Run> runs(Cfg::world_size);
  const Setup su = cp_setup(recompute);
  run_local<Cfg>([&](auto& ctx) { runs[ctx.rank()] = pipeline_rank<Cfg, S>(ctx, micro_batches, {}, su); });
  check_equivalent(reference<S>(), runs);
}

}  // namespace

TEST_CASE("CP 2, 4 and 8 with ring attention and with Ulysses train the single-rank model", "[cp]") {
  check<Parallel<CP<2>>>();
  check<Parallel<CP<4, Ring>>>();
  check<Parallel<CP<8, Ring>>>();
  check<Parallel<CP<2, Ulysses>>>();
  check<Parallel<CP<4, Ulysses>>>();
  check<Parallel<CP<8, Ulysses>>>();
}

TEST_CASE("grouped- and multi-query attention under context parallelism", "[cp]") {
  check<Parallel<CP<4>>, gqa>();
  check<Parallel<CP<2, Ulysses>>, gqa>();  // two kv heads over two ranks
  check<Parallel<CP<4>>, mqa>();           // one kv head travels the ring
}

TEST_CASE("context parallelism combines with tensor, sequence, data and pipeline parallelism", "[cp]") {
  check<Parallel<TP<2>, CP<2>>>();
  check<Parallel<TP<2, SequenceParallel>, CP<2>>>();
  check<Parallel<TP<2, SequenceParallel>, CP<2, Ulysses>>>();
  check<Parallel<TP<2>, CP<2>>, gqa>();  // one kv head per tensor-parallel rank, on the ring
  check<Parallel<CP<2>, DP<2>>>(2);
  check<Parallel<CP<2, Ulysses>, DP<2, ZeRO<1>>>>();
  check<Parallel<CP<2>, DP<2, ZeRO<2>>>>();
  check<Parallel<CP<2>, DP<2, ZeRO<3>>>>(2);
  check<Parallel<CP<2>, PP<2>>>(2);
  check<Parallel<TP<2>, CP<2>, PP<2, OneFOneB>>>(4);
}

TEST_CASE("recompute none, selective and full give the same model under context parallelism", "[cp][recompute]") {
  check<Parallel<CP<2>>>(1, models::Recompute::selective);
  check<Parallel<CP<2>>>(1, models::Recompute::full);
  check<Parallel<CP<2, Ulysses>>>(1, models::Recompute::selective);
  check<Parallel<TP<2, SequenceParallel>, CP<2>>>(1, models::Recompute::full);
  check<Parallel<CP<2>, PP<2, ZeroBubbleH1>>>(2, models::Recompute::selective);  // the split backward
  check<Parallel<CP<2>, PP<2, ZeroBubbleH1>>>(2, models::Recompute::full);  // W recomputes the block again
}

TEST_CASE("a sequence that does not cut into 2·CP chunks is refused with its numbers", "[cp]") {
  using Cfg = Parallel<CP<4>>;
  std::vector<std::string> errors(4);
  run_local<Cfg>([&](auto& ctx) {
    models::Gpt<mha, double, models::ModelLayout<Cfg>> m(3, ctx.template comm<Axis::tp>(),
                                                         ctx.template comm<Axis::cp>(), models::GptPart{});
    std::vector<std::int32_t> ids(12, 1);
    try {
      m.forward(ids.data(), ids.data(), 1, 12);
    } catch (const Error& e) {
      errors[std::size_t(ctx.rank())] = e.what();
    }
  });
  for (const auto& e : errors)
    CHECK(e == "loom: context parallelism over 4 ranks cuts each sequence into 2 x 4 = 8 chunks, but the sequence "
               "of 12 tokens is not a multiple of 8");
}

namespace {

//! One forward and backward of the model on CP<n, A> ranks: the traffic of the cp communicator in each.
template <class Cfg, models::GptShape S>
std::vector<std::array<comm::Traffic, 2>> traffic(int B, models::Recompute recompute = models::Recompute::none) {
  std::vector<std::array<comm::Traffic, 2>> t(Cfg::world_size);
  run_local<Cfg>([&](auto& ctx) {
    models::GptOptions o;
    o.recompute = recompute;
    models::Gpt<S, double, models::ModelLayout<Cfg>> m(3, ctx.template comm<Axis::tp>(),
                                                       ctx.template comm<Axis::cp>(), models::GptPart{}, o);
    std::vector<std::int32_t> ids(std::size_t(B) * S.max_seq);
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>(i % S.vocab);
    m.forward(ids.data(), ids.data(), B, S.max_seq);
    t[std::size_t(ctx.rank())][0] = m.cp()->traffic();
    m.cp()->reset_traffic();
    m.backward();
    t[std::size_t(ctx.rank())][1] = m.cp()->traffic();
  });
  return t;
}

}  // namespace

TEST_CASE("the attention's traffic per layer is ANCHORS.md's count", "[cp]") {
  constexpr int B = 2, L = gqa.layers, D = gqa.d_model / gqa.heads;
  SECTION("ring: CP - 1 key/value rotations forward; as many and CP of their gradient backward") {
    constexpr int n = 4, c = gqa.max_seq / (2 * n);
    const double block = 4.0 * B * c * gqa.kv_heads * D;  // both chunks' keys and values: only the kv heads travel
    for (const auto& [fw, bw] : traffic<Parallel<CP<n>>, gqa>(B)) {
      CHECK(fw.count(comm::Collective::send_recv) == L * (n - 1));
      CHECK(fw.elements == L * block * (n - 1));
      CHECK(bw.elements == L * (block * (n - 1) + block * n));
    }
    // Selective recompute runs the forward rotations again in backward.
    for (const auto& [fw, bw] : traffic<Parallel<CP<n>>, gqa>(B, models::Recompute::selective)) {
      CHECK(fw.elements == L * block * (n - 1));
      CHECK(bw.elements == L * (2 * block * (n - 1) + block * n));
    }
  }
  SECTION("Ulysses: all-to-alls of q, k, v, out and the log-sum-exp; 4·N·h/P with Hkv = Hq") {
    constexpr int n = 2;
    const double rows = 1.0 * B * mha.max_seq / n * (n - 1) / n, h = mha.d_model;
    for (const auto& [fw, bw] : traffic<Parallel<CP<n, Ulysses>>, mha>(B)) {
      CHECK(fw.count(comm::Collective::all_to_all) == 5 * L);
      CHECK(fw.elements == L * (4 * rows * h + rows * mha.heads));  // q, k, v, out: 4·N·h/P·(P-1)/P, and the lse
      CHECK(bw.count(comm::Collective::all_to_all) == 9 * L);
    }
  }
}

namespace {

//! Bytes one more block adds to what a model keeps for B sequences of T tokens on layout Cfg: the activation bytes
//! of a 3-block model less a 2-block one's (everything but the blocks is the same in both), on rank 0.
template <class Cfg>
double bytes_per_block(int B, int T, models::Recompute recompute) {
  constexpr models::GptShape two = mha, three{3, mha.heads, mha.kv_heads, mha.d_model, mha.vocab, mha.max_seq};
  double held[2] = {0, 0};
  run_local<Cfg>([&](auto& ctx) {
    models::GptOptions o;
    o.recompute = recompute;
    auto once = [&]<models::GptShape S>() {
      using M = models::Gpt<S, double, models::ModelLayout<Cfg>>;
      std::unique_ptr<M> m;
      if constexpr (Cfg::template size<Axis::cp> > 1)
        m = std::make_unique<M>(3, ctx.template comm<Axis::tp>(), ctx.template comm<Axis::cp>(), models::GptPart{},
                                o);
      else
        m = std::make_unique<M>(3, ctx.template comm<Axis::tp>(), o);
      std::vector<std::int32_t> ids(std::size_t(B) * T, 1);
      m->forward(ids.data(), ids.data(), B, T);
      return double(m->activation_bytes());
    };
    const double a = once.template operator()<two>(), b = once.template operator()<three>();
    if (ctx.rank() == 0) held[0] = a, held[1] = b;
  });
  return held[1] - held[0];
}

}  // namespace

TEST_CASE("a block keeps Korthikanti et al.'s activations, less the dropout masks, per rank", "[cp][recompute]") {
  // Per block, in elements of N tokens of width h = d_model on a rank: Korthikanti et al.'s sbh(34 + 5as/h) bytes
  // at 2 bytes an element is 17 N h + the attention scores; loom regenerates the two dropout masks (1 N h) from their
  // keys and never stores the scores (the tiled kernel keeps a log-sum-exp per head and token), and keeps the layer
  // norms' mean and rstd (4 N) and the log-sum-exp (a N): 16 N h + (4 + a) N. Selective recompute drops the core's
  // output and log-sum-exp (N h + a N); full recompute keeps the block's input alone (N h). Tensor parallelism over t
  // splits q, k, v, the core and the MLP (sbh(10 + 24/t) bytes: (4 + 12/t) N h); context parallelism over c gives a
  // rank N / c of the tokens.
  constexpr int B = 2, T = 16;
  constexpr double h = mha.d_model, a = mha.heads, e = sizeof(double);
  using models::Recompute;
  auto none = [&](double N, double t) { return e * (N * h * (4 + 12 / t) + N * (4 + a / t)); };
  auto selective = [&](double N, double t) { return none(N, t) - e * (N * h / t + N * a / t); };
  for (auto [cfg, N, t] : {std::tuple{0, B * T, 1}, std::tuple{1, B * T, 2}, std::tuple{2, B * T / 2, 1},
                           std::tuple{3, B * T / 4, 1}}) {
    INFO("layout " << cfg << ": " << N << " tokens per rank, tp " << t);
    auto per_block = [&](Recompute r) {
      switch (cfg) {
        case 0: return bytes_per_block<Parallel<>>(B, T, r);
        case 1: return bytes_per_block<Parallel<TP<2>>>(B, T, r);
        case 2: return bytes_per_block<Parallel<CP<2>>>(B, T, r);
        default: return bytes_per_block<Parallel<CP<4, Ulysses>>>(B, T, r);
      }
    };
    CHECK(per_block(Recompute::none) == none(N, t));
    CHECK(per_block(Recompute::selective) == selective(N, t));
    CHECK(per_block(Recompute::full) == e * N * h);
  }
}

// The single-rank GPT: its gradient against finite differences in double, recompute and micro-batching that change
// nothing, the split of backward into input and weight parts, checkpoints in the Hugging Face layout, and training
// that lowers the loss.
#include "catch.hpp"
#include "gpt_batch.hpp"
#include "temp_dir.hpp"

#include <loom/models/gpt/checkpoint.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>

using namespace loom;
using models::Gpt;
using models::GptOptions;
using models::GptShape;
using models::Recompute;

namespace {

constexpr GptShape gqa{2, 4, 2, 16, 13, 8};  // 4 query heads over 2 key/value heads, head_dim 4
constexpr GptShape mha{1, 2, 2, 8, 11, 6};
constexpr GptShape mha2{2, 2, 2, 8, 11, 6};  // mha with two layers

using test::Batch;
using test::batch;

//! The largest element difference relative to the largest element of a.
double max_rel_diff(const Tensor<double>& a, const Tensor<double>& b) {
  double m = 0, scale = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    m = std::max(m, std::abs(a.data()[i] - b.data()[i]));
    scale = std::max(scale, std::abs(a.data()[i]));
  }
  return m / scale;
}

}  // namespace

TEMPLATE_TEST_CASE_SIG("the gradient of the loss matches central finite differences", "[gpt]",
                       ((GptShape S), S), (gqa), (mha)) {
  GptOptions o;
  o.dropout = GENERATE(0.0f, 0.2f);
  Gpt<S, double> m(42, o);
  const int B = 2, T = S.max_seq - 1;
  const auto b = batch(B, T, S.vocab);
  m.zero_grad();
  m.forward(b.ids.data(), b.targets.data(), B, T, 3);
  m.backward();
  const Tensor<double> g = m.grads().clone();
  // Probe elements of every parameter: first, last and one in the middle. GPT-2 has 4 + 12 L tensors (wte, wpe,
  // ln_f's two; per block ln_1, c_attn, attn.c_proj, ln_2, c_fc and mlp.c_proj, each a weight and a bias), holding
  // the shape's parameter count.
  std::set<std::string> probed;
  std::int64_t elements = 0;
  for (const auto& s : m.specs()) {
    const auto n = numel_of(s.shape);
    probed.insert(s.name);
    elements += n;
    for (std::int64_t i : {std::int64_t{0}, n / 2, n - 1}) {
      double& w = m.params().data()[s.offset + i];
      const double keep = w, h = 1e-5;
      w = keep + h;
      const double up = m.forward(b.ids.data(), b.targets.data(), B, T, 3);
      w = keep - h;
      const double down = m.forward(b.ids.data(), b.targets.data(), B, T, 3);
      w = keep;
      const double numeric = (up - down) / (2 * h), analytic = g.data()[s.offset + i];
      INFO(s.name << "[" << i << "] numeric " << numeric << " analytic " << analytic);
      CHECK(std::abs(numeric - analytic) <= 1e-8 + 1e-6 * std::abs(analytic));
    }
  }
  CHECK(probed.size() == static_cast<std::size_t>(4 + 12 * S.layers));
  CHECK(elements == S.params());
}

TEST_CASE("recompute, micro-batching and the split backward change nothing", "[gpt]") {
  const int B = 4, T = 7;
  const auto b = batch(B, T, gqa.vocab, 1);
  GptOptions plain, recompute, selective;
  plain.dropout = recompute.dropout = selective.dropout = 0.1f;
  recompute.recompute = Recompute::full;
  selective.recompute = Recompute::selective;
  Gpt<gqa, double> a(7, plain), r(7, recompute), sel(7, selective), mb(7, plain);
  a.zero_grad(), r.zero_grad(), sel.zero_grad(), mb.zero_grad();
  const double la = a.forward(b.ids.data(), b.targets.data(), B, T, 5);
  a.backward();
  const double lr = r.forward(b.ids.data(), b.targets.data(), B, T, 5);
  r.backward();
  const double ls = sel.forward(b.ids.data(), b.targets.data(), B, T, 5);
  sel.backward();
  CHECK(la == lr);
  CHECK(la == ls);
  CHECK(max_rel_diff(a.grads(), r.grads()) == 0.0);
  CHECK(max_rel_diff(a.grads(), sel.grads()) == 0.0);
  // Each keeps less: selective drops the attention core's result, full all but each block's input.
  CHECK(sel.activation_bytes() < a.activation_bytes());
  CHECK(r.activation_bytes() < sel.activation_bytes());
  // Two micro-batches of two rows: the same loss and gradient, dropout included (keyed by global row).
  double lm = 0;
  for (int k = 0; k < 2; ++k) {
    lm += mb.forward(b.ids.data() + k * 2 * T, b.targets.data() + k * 2 * T, 2, T, 5, k * 2) / 2;
    mb.backward(0.5);
  }
  CHECK(std::abs(lm - la) <= 1e-12 * std::abs(la));
  CHECK(max_rel_diff(a.grads(), mb.grads()) < 1e-13);
}

TEST_CASE("the loss's gradient left in the logits by forward gives backward's gradients", "[gpt]") {
  // 16 rows: the products apply the loss's scale as their alpha; 18: a float would round it, so double scales the
  // gradient first.
  const auto shape = GENERATE(std::pair{2, 8}, std::pair{3, 6});
  const int B = shape.first, T = shape.second;
  CAPTURE(B, T);
  const auto b = batch(B, T, gqa.vocab, 2);
  GptOptions plain, fused;
  fused.loss_gradient_in_forward = true;
  Gpt<gqa, double> a(9, plain), f(9, fused);
  a.zero_grad(), f.zero_grad();
  // Two micro-batches, the second at another scale: the products apply each one's.
  for (const double scale : {1.0, 0.25}) {
    const double la = a.forward(b.ids.data(), b.targets.data(), B, T, 1);
    const double lf = f.forward(b.ids.data(), b.targets.data(), B, T, 1);
    CHECK(lf == la);
    CHECK_NOTHROW(a.logits(0));
    CHECK_THROWS_WITH(f.logits(0), Catch::Contains("logits(0): the loss's forward turned them into its gradient"));
    a.backward(scale);
    f.backward(scale);
  }
  const double d = max_rel_diff(a.grads(), f.grads());
  INFO("largest relative difference " << d);
  CHECK(d < 1e-13);
  CHECK(max_rel_diff(a.grads(), Gpt<gqa, double>(9, plain).grads()) > 0);  // the gradients are not zero
  // A forward that no backward follows (evaluation) leaves the logits as they are.
  const double le = f.forward(0, models::MicroBatch{b.ids.data(), b.targets.data(), B, T, 1, 0, false});
  CHECK(le == a.forward(b.ids.data(), b.targets.data(), B, T, 1));
  const std::size_t n = std::size_t(B) * T * gqa.vocab;  // on the host the rows are unpadded
  CHECK(std::equal(f.logits(0), f.logits(0) + n, a.logits(0)));
}

TEST_CASE("a checkpoint round-trips in the Hugging Face GPT-2 layout", "[gpt][checkpoint]") {
  test::TempDir tmp;
  const std::string dir = tmp / "ckpt";
  Gpt<gqa, float> a(1), b(2);
  checkpoint::save_gpt(dir, a);
  CHECK(std::filesystem::exists(dir + "/model.safetensors"));
  CHECK(!std::filesystem::exists(dir + "/model.safetensors.tmp"));
  const auto stored = checkpoint::read_safetensors(dir + "/model.safetensors");
  CHECK(stored.at("h.1.attn.c_attn.weight").shape == std::vector<std::int64_t>{16, (4 + 2 * 2) * 4});
  CHECK(stored.at("h.0.mlp.c_proj.weight").shape == std::vector<std::int64_t>{64, 16});
  CHECK(stored.at("wte.weight").shape == std::vector<std::int64_t>{13, 16});
  std::ifstream cfg(dir + "/config.json");
  const auto c = nlohmann::json::parse(cfg);
  CHECK(c["n_layer"] == 2);
  CHECK(c["n_kv_head"] == 2);
  CHECK(c["model_type"] == "loom");  // GPT2LMHeadModel has no grouped-query attention: loom's own type
  CHECK(c["vocab_size"] == 13);
  checkpoint::load_gpt(dir, b);
  CHECK(std::equal(a.params().data(), a.params().data() + a.params().numel(), b.params().data()));
  // Into another precision.
  Gpt<gqa, double> d(3);
  checkpoint::load_gpt(dir, d);
  CHECK(d.params().data()[17] == static_cast<double>(a.params().data()[17]));
  // Into another shape: an error naming the mismatch (here, a GPT-2 of one layer).
  Gpt<mha, float> other(1);
  CHECK_THROWS_WITH(checkpoint::load_gpt(dir, other),
                    Catch::StartsWith("loom: " + dir + "/config.json has model_type 'loom' but the model is gpt2's"));
  checkpoint::save_gpt(dir, other);
  CHECK_THROWS_WITH(checkpoint::load_gpt(dir, a), Catch::StartsWith("loom: " + dir + "/config.json has model_type "
                                                                    "'gpt2' but the model is loom's"));
  Gpt<mha2, float> deeper(1);
  CHECK_THROWS_WITH(checkpoint::load_gpt(dir, deeper),
                    "loom: " + dir + "/config.json has n_layer = 1 but the model has 2");
}

TEST_CASE("bad input to the model is reported", "[gpt]") {
  Gpt<mha, float> m(1);
  auto b = batch(1, 7, mha.vocab);
  CHECK_THROWS_WITH(m.forward(b.ids.data(), b.targets.data(), 1, 7),
                    "loom: sequence length 7 is outside 1..6 (the model's max_seq)");
  b.ids[2] = 11;
  CHECK_THROWS_WITH(m.forward(b.ids.data(), b.targets.data(), 1, 6),
                    "loom: token 11 at position 2 is outside the vocabulary 0..10");
  CHECK_THROWS_WITH(m.backward(), "loom: backward() before forward()");
  CHECK_THROWS_WITH(m.param("h.9.ln_1.weight"), "loom: the model has no parameter named 'h.9.ln_1.weight'");
  CHECK(m.param("h.0.attn.c_attn.weight").shape() == Shape{8, 24});
}

TEST_CASE("initialisation does not depend on anything but the seed", "[gpt]") {
  Gpt<gqa, double> a(5), b(5), c(6);
  CHECK(std::equal(a.params().data(), a.params().data() + a.params().numel(), b.params().data()));
  CHECK(a.params().data()[100] != c.params().data()[100]);
  CHECK(a.param("h.0.ln_1.weight")(3) == 1.0);
  CHECK(a.param("h.1.mlp.c_fc.bias")(5) == 0.0);
  // std 0.02 for c_attn
  const auto w = a.param("h.0.attn.c_attn.weight");
  double ss = 0;
  for (std::int64_t i = 0; i < w.numel(); ++i) ss += w.data()[i] * w.data()[i];
  CHECK(std::sqrt(ss / w.numel()) == Approx(0.02).epsilon(0.15));
}

TEST_CASE("training lowers the loss on the built-in corpus", "[gpt][train]") {
  constexpr GptShape s{2, 2, 2, 32, 256, 32};
  Gpt<s, float> m(1);
  optim::AdamW<float> opt(m.specs(), s.params(), {0.9, 0.999, 1e-8, 0.0});
  train::Batches data(train::builtin_corpus(1 << 16), 8, 32);
  std::vector<std::int32_t> in(8 * 32), tg(8 * 32);
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    data.fill(step, 0, 8, in.data(), tg.data());
    m.zero_grad();
    last = m.forward(in.data(), tg.data(), 8, 32);
    if (step == 0) first = last;
    m.backward();
    optim::clip_grad_norm(m.grads(), 1.0);
    opt.step(m.params(), m.grads(), 1e-2f);
  }
  INFO("first " << first << " last " << last);
  CHECK(first == Approx(std::log(256.0)).epsilon(0.02));
  CHECK(last < first - 1.5);
}

TEST_CASE("a device's optimizer merges the slices it can update in one launch, and no others", "[gpt][optim]") {
  using loom::optim::Slice;
  // Contiguous in parameters and state and alike in decay: merged. A gap in either, or a change of decay: not.
  const std::vector<Slice> in = {{0, 0, 4, true},   {4, 4, 2, true},    {6, 6, 3, false}, {9, 9, 1, false},
                                 {11, 10, 5, false}, {16, 15, 2, false}, {18, 20, 1, false}};
  const auto out = loom::optim::coalesced(in);
  REQUIRE(out.size() == 4);
  CHECK((out[0].param == 0 && out[0].at == 0 && out[0].n == 6 && out[0].decay));
  CHECK((out[1].param == 6 && out[1].at == 6 && out[1].n == 4 && !out[1].decay));
  CHECK((out[2].param == 11 && out[2].at == 10 && out[2].n == 7 && !out[2].decay));
  CHECK((out[3].param == 18 && out[3].at == 20 && out[3].n == 1));
  // GPT-2's parameters: 148, in 98 runs (an embedding pair, then each block's alternation of matrices and the
  // vectors that take no decay, a block's last bias running into the next block's norm).
  const auto specs = loom::models::gpt_param_specs<float>(loom::models::gpt2, 1, 0, {});
  const auto slices = loom::optim::slices_of(specs);
  CHECK(slices.size() == 148);
  CHECK(loom::optim::coalesced(slices).size() == 98);
}

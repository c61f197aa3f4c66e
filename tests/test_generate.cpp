// Decoding with a key/value cache (models/gpt/generate.hpp): the logits after a prompt and after each further token
// equal the whole model's forward over the text so far (GPT-2, Llama 3 and Mixtral parts, in double), on one rank and
// over tensor-parallel groups of 2 and 4 (with the key/value heads split and replicated); greedy generation picks the
// same tokens on every layout; the choice of a token under temperature, top-k and top-p.
#include "catch.hpp"

#include <loom/comm/local.hpp>
#include <loom/models/gpt.hpp>
#include <loom/models/gpt/generate.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

using namespace loom;

namespace {

constexpr models::GptShape gpt2 = {2, 4, 4, 16, 37, 24};
constexpr models::GptShape llama = models::llama3_spec({2, 4, 2, 16, 37, 24, 24}, 10000, {4, 1, 4, 8});
constexpr models::GptShape mixtral = models::mixtral_spec({2, 4, 2, 16, 37, 24, 0, 0, 2, 1, 12}, 4, 2, 10000);

const std::vector<std::int32_t> prompt = {3, 17, 5, 30, 11};
const std::vector<std::int32_t> further = {8, 36, 0};

models::GptOptions options() {
  models::GptOptions o;
  o.moe.capacity_factor = 0;  // dropless: a full forward routes as the decoder does
  return o;
}

//! The largest difference of a from b relative to b's largest magnitude.
double difference(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double scale = 1e-300, worst = 0;
  for (double v : b) scale = std::max(scale, std::abs(v));
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / scale);
  return worst;
}

//! The decoder's logits after the prompt and after each further token.
template <class Cfg>
std::vector<std::vector<double>> decoded(models::GptDecoder<double, Cfg>& dec) {
  std::vector<std::vector<double>> out;
  auto l = dec.feed(prompt);
  out.emplace_back(l.begin(), l.end());
  for (std::int32_t t : further) {
    l = dec.feed(std::span<const std::int32_t>(&t, 1));
    out.emplace_back(l.begin(), l.end());
  }
  return out;
}

//! The whole model's logits at the last position of every prefix decoded() ends at: one forward over the text.
std::vector<std::vector<double>> full_forward(const models::GptShape& s) {
  models::GptModel<double> m(s, 5, options());
  std::vector<std::int32_t> text = prompt;
  text.insert(text.end(), further.begin(), further.end());
  const std::vector<std::int32_t> targets(text.size(), 0);
  m.forward(text.data(), targets.data(), 1, static_cast<int>(text.size()));
  const std::size_t pitch = static_cast<std::size_t>(m.logits_pitch());
  REQUIRE(pitch == std::size_t(s.vocab));  // the host keeps the logits' rows dense
  std::vector<std::vector<double>> out;
  for (std::size_t t = prompt.size() - 1; t < text.size(); ++t)
    out.emplace_back(m.logits(0) + t * pitch, m.logits(0) + t * pitch + std::size_t(s.vocab));
  return out;
}

template <int t>
void check_tensor_parallel(const models::GptShape& s, const std::vector<std::vector<double>>& one,
                           const std::vector<std::int32_t>& greedy) {
  using Cfg = Parallel<TP<t>>;
  std::vector<std::vector<std::vector<double>>> logits(t);
  std::vector<std::vector<std::int32_t>> tokens(t);
  run_local<Cfg>([&](auto& ctx) {
    models::GptModel<double, Cfg> m(s, 5, ctx.template comm<Axis::tp>(), options());
    models::GptDecoder<double, Cfg> dec(m);
    logits[std::size_t(ctx.rank())] = decoded(dec);
    tokens[std::size_t(ctx.rank())] = dec.generate(prompt, 12, {});
  });
  for (int r = 0; r < t; ++r) {
    INFO("tp" << t << " rank " << r);
    for (std::size_t i = 0; i < one.size(); ++i) CHECK(difference(logits[std::size_t(r)][i], one[i]) < 1e-12);
    CHECK(tokens[std::size_t(r)] == greedy);
  }
}

void check_shape(const models::GptShape& s) {
  const auto want = full_forward(s);
  models::GptModel<double> m(s, 5, options());
  models::GptDecoder<double> dec(m);
  const auto got = decoded(dec);
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("after " << prompt.size() + i << " tokens");
    CHECK(difference(got[i], want[i]) < 1e-12);
  }
  CHECK(dec.length() == int(prompt.size() + further.size()));
  // Greedy: each token the argmax of the logits after the text before it.
  const auto greedy = dec.generate(prompt, 12, {});
  REQUIRE(greedy.size() == 12);
  std::vector<std::int32_t> text = prompt;
  for (std::int32_t g : greedy) {
    models::GptModel<double> again(s, 5, options());
    const std::vector<std::int32_t> targets(text.size(), 0);
    again.forward(text.data(), targets.data(), 1, static_cast<int>(text.size()));
    const double* last = again.logits(0) + (text.size() - 1) * std::size_t(s.vocab);
    CHECK(g == std::max_element(last, last + s.vocab) - last);
    text.push_back(g);
  }
  check_tensor_parallel<2>(s, got, greedy);
  check_tensor_parallel<4>(s, got, greedy);  // 2 key/value heads over 4 ranks: each held by two
}

}  // namespace

TEST_CASE("decoding with a cache equals the whole model's forward: GPT-2's parts", "[generate]") { check_shape(gpt2); }
TEST_CASE("decoding with a cache equals the whole model's forward: Llama 3's parts", "[generate]") {
  check_shape(llama);
}
TEST_CASE("decoding with a cache equals the whole model's forward: Mixtral's parts", "[generate]") {
  check_shape(mixtral);
}

TEST_CASE("the decoder refuses what it cannot do, naming the values", "[generate]") {
  models::GptModel<double> m(gpt2, 5, options());
  models::GptDecoder<double> dec(m, 8);
  CHECK_THROWS_WITH(dec.feed(std::vector<std::int32_t>{1, 37}), Catch::Contains("token 37 at position 1") &&
                                                                      Catch::Contains("outside the vocabulary 0..36"));
  dec.feed(std::vector<std::int32_t>(6, 1));
  CHECK_THROWS_WITH(dec.feed(std::vector<std::int32_t>(3, 1)),
                    Catch::Contains("holds 6 tokens and was given 3 more, past its capacity of 8"));
  CHECK_THROWS_WITH(dec.generate(std::vector<std::int32_t>(5, 1), 5, {}),
                    Catch::Contains("need 9 cached positions, but the decoder holds 8"));
  CHECK_THROWS_WITH(dec.generate({}, 5, {}), Catch::Contains("a prompt of at least one token"));
  CHECK_THROWS_WITH(models::GptDecoder<double>(m, 25), Catch::Contains("capacity of 25 tokens is outside 1..24"));
  // A stop token ends the text after it: the greedy first token stops at once.
  const auto first = dec.generate(prompt, 4, {});
  const std::vector<std::int32_t> stops = {36, first[0]};
  CHECK(dec.generate(prompt, 4, {}, stops) == std::vector<std::int32_t>{first[0]});
}

TEST_CASE("choosing a token: greedy, temperature, top-k, top-p, seeds", "[generate]") {
  const std::vector<double> logits = {std::log(0.2), std::log(0.5), std::log(0.3), std::log(1e-9)};
  CHECK(models::choose_token(logits, {}, 0) == 1);
  const std::vector<double> tie = {1.0, 3.0, 3.0};
  CHECK(models::choose_token(tie, {}, 0) == 1);  // the lowest id among equal maxima
  auto counts = [&](models::Sampling s, int n) {
    std::map<int, int> c;
    for (int i = 0; i < n; ++i) ++c[models::choose_token(logits, s, std::uint64_t(i))];
    return c;
  };
  // Temperature 1: the softmax's frequencies (20000 draws: within 1.5 percentage points).
  auto c = counts({1.0, 0, 1.0, 7}, 20000);
  CHECK(std::abs(c[0] / 20000.0 - 0.2) < 0.015);
  CHECK(std::abs(c[1] / 20000.0 - 0.5) < 0.015);
  CHECK(std::abs(c[2] / 20000.0 - 0.3) < 0.015);
  // top-k 2: tokens 1 and 2 alone, 5 : 3.
  c = counts({1.0, 2, 1.0, 7}, 20000);
  CHECK(c.count(0) == 0);
  CHECK(std::abs(c[1] / 20000.0 - 0.625) < 0.015);
  // top-p 0.6: the fewest whose probabilities reach 0.6 are tokens 1 (0.5) and 2 (0.3).
  c = counts({1.0, 0, 0.6, 7}, 20000);
  CHECK(c.count(0) == 0);
  CHECK(c.count(3) == 0);
  CHECK(std::abs(c[1] / 20000.0 - 0.625) < 0.015);
  // top-p 0.45: token 1 alone (its 0.5 reaches it); a low temperature sharpens toward it.
  CHECK(counts({1.0, 0, 0.45, 7}, 200) == std::map<int, int>{{1, 200}});
  CHECK(counts({0.05, 0, 1.0, 7}, 2000)[1] > 1990);
  // The draws are the seed's: another seed draws otherwise, the same one alike.
  std::vector<int> a, b, again;
  for (int i = 0; i < 64; ++i) {
    a.push_back(models::choose_token(logits, {1.0, 0, 1.0, 7}, std::uint64_t(i)));
    b.push_back(models::choose_token(logits, {1.0, 0, 1.0, 8}, std::uint64_t(i)));
    again.push_back(models::choose_token(logits, {1.0, 0, 1.0, 7}, std::uint64_t(i)));
  }
  CHECK(a == again);
  CHECK(a != b);
  CHECK_THROWS_WITH(models::Sampling({-1.0}).check(), Catch::Contains("temperature must be 0 (greedy) or positive"));
  CHECK_THROWS_WITH(models::Sampling({1.0, -2}).check(), Catch::Contains("top-k must be 0"));
  CHECK_THROWS_WITH(models::Sampling({1.0, 0, 1.5}).check(), Catch::Contains("top-p must be in (0, 1], got 1.5"));
}

// The mixture-of-experts router against examples worked by hand: the top-k choices and their weights (ties to the
// lower expert index), the capacity and which assignments it drops, the load-balancing loss and the z-loss, softmax
// and sigmoid scores; and the gradient of the logits against finite differences.
#include "catch.hpp"

#include <loom/layers/moe_router.hpp>

#include <cmath>
#include <vector>

using namespace loom;
using layers::RouterConfig;
using layers::Routing;

namespace {

//! Logits whose softmax is p (each row sums to 1) shifted by c_t, so that a row's logsumexp is c_t.
std::vector<double> logits_of(const std::vector<std::vector<double>>& p, const std::vector<double>& shift) {
  std::vector<double> x;
  for (std::size_t t = 0; t < p.size(); ++t)
    for (double v : p[t]) x.push_back(std::log(v) + shift[t]);
  return x;
}

// Four tokens over four experts. By hand: token 0 chooses experts 0 and 1 (0.4 and 0.3: weights 4/7, 3/7), token 1
// experts 3 and 2 (4/7, 3/7), token 2 experts 0 and 3 (0.5 and 0.3: 5/8, 3/8), token 3 ties everywhere and takes the
// two lowest, 0 and 1 (1/2 each).
const std::vector<std::vector<double>> four{
    {0.4, 0.3, 0.2, 0.1}, {0.1, 0.2, 0.3, 0.4}, {0.5, 0.1, 0.1, 0.3}, {0.25, 0.25, 0.25, 0.25}};
const std::vector<double> shifts{1, 0, -1, 2};

}  // namespace

TEST_CASE("softmax top-2: choices, weights, ties to the lower index", "[moe]") {
  const auto x = logits_of(four, shifts);
  RouterConfig c;
  c.experts = 4, c.top_k = 2, c.capacity_factor = 0;
  const Routing r = layers::route(x.data(), 4, c);
  CHECK(r.expert == std::vector<int>{0, 1, 3, 2, 0, 3, 0, 1});
  const std::vector<double> w{4.0 / 7, 3.0 / 7, 4.0 / 7, 3.0 / 7, 5.0 / 8, 3.0 / 8, 0.5, 0.5};
  for (std::size_t i = 0; i < w.size(); ++i) CHECK(r.weight[i] == Approx(w[i]).epsilon(1e-12));
  // Dropless: every assignment kept; expert 0 takes three (tokens 0, 2, 3), 1 two, 2 one, 3 two.
  CHECK(r.capacity == -1);
  CHECK(r.load == std::vector<int>{3, 2, 1, 2});
  CHECK(r.dropped() == 0.0);
  CHECK(r.imbalance() == Approx(1.5));  // 3 over the mean of 2
}

TEST_CASE("capacity drops first choices after earlier first choices, then second choices", "[moe]") {
  const auto x = logits_of(four, shifts);
  RouterConfig c;
  c.experts = 4, c.top_k = 2;
  SECTION("factor 0.5: ceil(4 x 2 / 4 x 0.5) = one assignment per expert") {
    c.capacity_factor = 0.5;
    const Routing r = layers::route(x.data(), 4, c);
    CHECK(r.capacity == 1);
    // First choices in token order: 0 -> e0 kept, 1 -> e3 kept, 2 -> e0 dropped, 3 -> e0 dropped; then second
    // choices: 0 -> e1 kept, 1 -> e2 kept, 2 -> e3 dropped (token 1 holds it), 3 -> e1 dropped.
    CHECK(r.kept == std::vector<char>{1, 1, 1, 1, 0, 0, 0, 0});
    CHECK(r.weight[4] == 0.0);
    CHECK(r.weight[0] == Approx(4.0 / 7));  // kept weights are not renormalised
    CHECK(r.load == std::vector<int>{1, 1, 1, 1});
    CHECK(r.dropped() == 0.5);
  }
  SECTION("factor 0.75: ceil(4 x 2 / 4 x 0.75) = 2") {
    c.capacity_factor = 0.75;
    const Routing r = layers::route(x.data(), 4, c);
    CHECK(r.capacity == 2);
    // Expert 0 takes tokens 0 and 2 first; token 3's first choice is dropped, its second (e1) kept.
    CHECK(r.kept == std::vector<char>{1, 1, 1, 1, 1, 1, 0, 1});
    CHECK(r.load == std::vector<int>{2, 2, 1, 2});
    CHECK(r.dropped() == 1.0 / 8);
    CHECK(r.weight[7] == Approx(0.5));
  }
  CHECK(layers::expert_capacity(10, 1, 4, 1.0) == 3);
  CHECK(layers::expert_capacity(8, 1, 4, 2.0) == 4);
  CHECK(layers::expert_capacity(8, 2, 4, 1.25) == 5);
  CHECK(layers::expert_capacity(8, 2, 4, 0.0) == -1);
}

TEST_CASE("the Switch load-balancing loss and the router z-loss", "[moe]") {
  const auto x = logits_of(four, shifts);
  RouterConfig c;
  c.experts = 4, c.top_k = 2, c.capacity_factor = 1.0, c.aux_loss_coeff = 0.01, c.z_loss_coeff = 0.001;
  const Routing r = layers::route(x.data(), 4, c);
  // f = (3, 2, 1, 2) / 8 (before capacity); P = mean probabilities (1.25, 0.85, 0.85, 1.05) / 4;
  // aux = 0.01 * 4 * (3/8 * 0.3125 + 2/8 * 0.2125 + 1/8 * 0.2125 + 2/8 * 0.2625) = 0.04 * 0.2625.
  CHECK(r.chose == std::vector<int>{3, 2, 1, 2});
  CHECK(r.aux_loss == Approx(0.0105).epsilon(1e-12));
  // logsumexp of each row is its shift: z = 0.001 * (1 + 0 + 1 + 4) / 4.
  CHECK(r.z_loss == Approx(0.0015).epsilon(1e-12));
  // Equal logits: every token's single choice is expert 0 (ties to the lower index), f = (1, 0, 0, 0) and P = 1/4
  // each, so aux = coeff * 4 * (1 * 1/4) = coeff; logsumexp = ln 4 on every row.
  const std::vector<double> flat(16, 0.0);
  RouterConfig one = c;
  one.top_k = 1;
  const Routing f = layers::route(flat.data(), 4, one);
  CHECK(f.aux_loss == Approx(0.01).epsilon(1e-12));
  CHECK(f.z_loss == Approx(0.001 * std::log(4.0) * std::log(4.0)).epsilon(1e-12));
}

TEST_CASE("sigmoid routing: top-1 and top-2 weights, ties, and its balance probabilities", "[moe]") {
  // Token 0: sigmoid(0, ln 3, -ln 3) = (1/2, 3/4, 1/4); token 1: (3/4, 3/4, 1/2), a tie between experts 0 and 1.
  const double l3 = std::log(3.0);
  const std::vector<double> x{0, l3, -l3, l3, l3, 0};
  RouterConfig c;
  c.experts = 3, c.top_k = 1, c.sigmoid = true, c.capacity_factor = 0;
  Routing r = layers::route(x.data(), 2, c);
  CHECK(r.expert == std::vector<int>{1, 0});
  CHECK(r.weight == std::vector<double>{1.0, 1.0});
  // The balance loss's probabilities: the scores over their sum, (1/3, 1/2, 1/6) and (3/8, 3/8, 1/4).
  const std::vector<double> p{1.0 / 3, 0.5, 1.0 / 6, 0.375, 0.375, 0.25};
  for (std::size_t i = 0; i < p.size(); ++i) CHECK(r.probability[i] == Approx(p[i]).epsilon(1e-12));
  c.top_k = 2;
  r = layers::route(x.data(), 2, c);
  CHECK(r.expert == std::vector<int>{1, 0, 0, 1});
  // 3/4 and 1/2 over their sum 5/4: 0.6 and 0.4; the tie: 1/2 each.
  const std::vector<double> w{0.6, 0.4, 0.5, 0.5};
  for (std::size_t i = 0; i < w.size(); ++i) CHECK(r.weight[i] == Approx(w[i]).epsilon(1e-12));
}

TEST_CASE("the gradient of the logits against finite differences", "[moe]") {
  const int T = 6, E = 5;
  std::vector<double> x(std::size_t(T) * E), dw(std::size_t(T) * 2);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(1.7 * double(i) + 0.3) * 2;
  for (std::size_t i = 0; i < dw.size(); ++i) dw[i] = std::cos(0.9 * double(i));
  for (bool sigmoid : {false, true}) {
    RouterConfig c;
    c.experts = E, c.top_k = 2, c.sigmoid = sigmoid, c.capacity_factor = 0.75;
    c.aux_loss_coeff = 0.3, c.z_loss_coeff = 0.05;
    // L = Σ dw · weight (kept) + 0.5 (aux + z): the gradient's losses scaled by 0.5.
    auto loss = [&](const std::vector<double>& at) {
      const Routing r = layers::route(at.data(), T, c);
      double l = 0.5 * (r.aux_loss + r.z_loss);
      for (std::size_t i = 0; i < dw.size(); ++i) l += dw[i] * r.weight[i];
      return l;
    };
    const Routing r = layers::route(x.data(), T, c);
    CHECK(r.dropped() > 0);  // capacity ceil(12 / 5 x 0.75) = 2 drops some: their gradient is zero
    std::vector<double> g(x.size());
    layers::route_backward(x.data(), r, c, dw.data(), 0.5, g.data());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double h = 1e-6;
      auto up = x, down = x;
      up[i] += h, down[i] -= h;
      INFO((sigmoid ? "sigmoid" : "softmax") << ", logit " << i);
      CHECK(g[i] == Approx((loss(up) - loss(down)) / (2 * h)).margin(1e-7));
    }
  }
}

// Cross-entropy: the whole-vocabulary forms against a direct log-softmax and finite differences; vocabulary
// slices combined through their partials against one slice; float, bf16 and fp16 against double.
#include "catch.hpp"
#include "test_kernels_cpu_support.hpp"

#include <loom/kernels/ops.hpp>

#include <limits>

using namespace kt;

namespace {

struct CeResult {
  std::vector<double> losses, dlogits;
};

//! One slice: cross_entropy_forward, then ce_backward with dloss.
CeResult ce_full(const std::vector<double>& logits, const std::vector<std::int32_t>& targets,
                 const std::vector<double>& dloss, int R, int V) {
  CeResult res{std::vector<double>(R), std::vector<double>(logits.size())};
  std::vector<double> mx(R), se(R);
  k::cross_entropy_forward(logits.data(), targets.data(), res.losses.data(), mx.data(), se.data(), R, V);
  k::ce_backward(logits.data(), targets.data(), mx.data(), se.data(), dloss.data(), res.dlogits.data(), R, V, 0);
  return res;
}

//! Slices of the given widths, combined as the header describes (the all-reduces done by hand).
CeResult ce_sharded(const std::vector<double>& logits, const std::vector<std::int32_t>& targets,
                    const std::vector<double>& dloss, int R, int V, const std::vector<int>& widths) {
  const std::size_t S = widths.size();
  std::vector<std::vector<double>> slices(S), local_max(S, std::vector<double>(R)), sumexp(S, std::vector<double>(R)),
      target(S, std::vector<double>(R));
  std::vector<int> v0(S);
  for (std::size_t s = 0, start = 0; s < S; start += std::size_t(widths[s]), ++s) {
    v0[s] = int(start);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < widths[s]; ++v) slices[s].push_back(logits[std::size_t(r) * V + start + v]);
    k::ce_partials(slices[s].data(), local_max[s].data(), sumexp[s].data(), R, widths[s]);
    k::ce_target_logit(slices[s].data(), targets.data(), target[s].data(), R, widths[s], v0[s]);
  }
  std::vector<double> gmax(R, -std::numeric_limits<double>::infinity()), gsum(R, 0.0), gtarget(R, 0.0);
  for (std::size_t s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) gmax[r] = std::max(gmax[r], local_max[s][r]);
  for (std::size_t s = 0; s < S; ++s) {
    k::ce_rescale<double>(local_max[s].data(), gmax.data(), sumexp[s].data(), R);
    for (int r = 0; r < R; ++r) {
      gsum[r] += sumexp[s][r];
      gtarget[r] += target[s][r];
    }
  }
  CeResult res{std::vector<double>(R), std::vector<double>(logits.size())};
  k::ce_losses<double>(gmax.data(), gsum.data(), gtarget.data(), res.losses.data(), R);
  for (std::size_t s = 0; s < S; ++s) {
    std::vector<double> d(slices[s].size());
    k::ce_backward(slices[s].data(), targets.data(), gmax.data(), gsum.data(), dloss.data(), d.data(), R, widths[s],
                   v0[s]);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < widths[s]; ++v)
        res.dlogits[std::size_t(r) * V + v0[s] + v] = d[std::size_t(r) * widths[s] + v];
  }
  return res;
}

}  // namespace

TEST_CASE("cross-entropy equals -log softmax and its backward matches finite differences",
          "[kernels][cross_entropy][backward]") {
  const int R = 5, V = 11;
  auto logits = random_vector(R * V, 1, -4, 4);
  for (int v = 0; v < V; ++v) logits[V + v] += 700;  // a row whose naive exp overflows
  const std::vector<std::int32_t> targets = {0, 10, 3, 3, 7};
  const auto dloss = random_vector(R, 2);
  const auto res = ce_full(logits, targets, dloss, R, V);
  for (int r = 0; r < R; ++r) {
    double mx = -1e300, s = 0;
    for (int v = 0; v < V; ++v) mx = std::max(mx, logits[r * V + v]);
    for (int v = 0; v < V; ++v) s += std::exp(logits[r * V + v] - mx);
    REQUIRE(std::abs(res.losses[r] - (std::log(s) + mx - logits[r * V + targets[r]])) < 1e-15 * (1 + std::abs(mx)));
  }
  // Finite differences on the unshifted logits (a shift leaves the gradient alone, but costs digits in the loss).
  auto plain = logits;
  for (int v = 0; v < V; ++v) plain[V + v] -= 700;
  auto loss = [&](const std::vector<double>& l) { return dot(ce_full(l, targets, dloss, R, V).losses, dloss); };
  REQUIRE(rel_err(ce_full(plain, targets, dloss, R, V).dlogits, res.dlogits) < 1e-12);
  REQUIRE(fd_error(loss, plain, res.dlogits) < 1e-8);

  // In place: dlogits over logits.
  std::vector<double> mx(R), se(R), losses(R);
  auto inplace = logits;
  k::cross_entropy_forward(inplace.data(), targets.data(), losses.data(), mx.data(), se.data(), R, V);
  k::ce_backward(inplace.data(), targets.data(), mx.data(), se.data(), dloss.data(), inplace.data(), R, V, 0);
  // Equal up to the last bits: Eigen's vectorised exp and its scalar one (for elements before the destination's
  // alignment, which differs between the two buffers) may round differently.
  REQUIRE(rel_err(inplace, res.dlogits) < 1e-15);
}

TEST_CASE("cross-entropy over vocabulary slices equals one slice", "[kernels][cross_entropy]") {
  const int R = 7, V = 23;
  auto logits = random_vector(R * V, 3, -5, 5);
  logits[2 * V + 20] = 30;  // one row's max in the last slice
  const std::vector<std::int32_t> targets = {0, 7, 8, 15, 22, 16, 5};  // in every slice, on the boundaries
  const auto dloss = random_vector(R, 4);
  const auto full = ce_full(logits, targets, dloss, R, V);
  const auto three = ce_sharded(logits, targets, dloss, R, V, {8, 8, 7});
  REQUIRE(rel_err(three.losses, full.losses) < 1e-12);
  REQUIRE(rel_err(three.dlogits, full.dlogits) < 1e-12);
  const auto with_empty = ce_sharded(logits, targets, dloss, R, V, {5, 0, 17, 1});
  REQUIRE(rel_err(with_empty.losses, full.losses) < 1e-12);
  REQUIRE(rel_err(with_empty.dlogits, full.dlogits) < 1e-12);

  auto loss = [&](const std::vector<double>& l) {
    return dot(ce_sharded(l, targets, dloss, R, V, {8, 8, 7}).losses, dloss);
  };
  REQUIRE(fd_error(loss, logits, three.dlogits) < 1e-8);
}

TEMPLATE_TEST_CASE("cross-entropy in float, bf16 and fp16 against double", "[kernels][cross_entropy][dtype]", float,
                   bf16, fp16) {
  const int R = 8, V = 1000;
  const auto logits = rounded<TestType>(random_vector(R * V, 5, -8, 8));
  std::vector<std::int32_t> targets(R);
  for (int r = 0; r < R; ++r) targets[r] = (r * 337) % V;
  const auto dloss = rounded<TestType>(random_vector(R, 6, 0.5, 1.5));
  const auto ref = ce_full(logits, targets, dloss, R, V);

  const auto lt = convert<TestType>(logits), dt = convert<TestType>(dloss);
  std::vector<TestType> losses(R), dlogits(R * V);
  std::vector<float> mx(R), se(R);
  k::cross_entropy_forward(lt.data(), targets.data(), losses.data(), mx.data(), se.data(), R, V);
  k::ce_backward(lt.data(), targets.data(), mx.data(), se.data(), dt.data(), dlogits.data(), R, V, 0);
  const double tol = std::is_same_v<TestType, float> ? 1e-5 : 2 * unit_roundoff<TestType>();
  REQUIRE(rel_err(losses, ref.losses) < tol);
  REQUIRE(rel_err(dlogits, ref.dlogits) < tol);
}

TEST_CASE("Ops<Host>::ce_loss_grad is forward and backward with a loss gradient of one",
          "[kernels][cross_entropy]") {
  const loom::kernels::Ops<loom::Host> ops;
  const int R = 5, V = 11, ld = 16;
  std::vector<double> rows(std::size_t(R) * ld, 99.0);
  const auto dense = random_vector(R * V, 9, -4, 4);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) rows[std::size_t(r) * ld + v] = dense[std::size_t(r) * V + v];
  const std::vector<std::int32_t> targets = {4, -1, 9, 0, 10};  // row 1 left out of the loss
  std::vector<double> losses(R), mx(R), se(R), tg(R), want_losses(R), want_mx(R), want_se(R), want = rows;
  const std::vector<double> ones(R, 1.0);
  k::ce_partials(rows.data(), want_mx.data(), want_se.data(), R, V, ld);
  k::ce_target_logit(rows.data(), targets.data(), tg.data(), R, V, 0, ld);
  k::ce_losses<double>(want_mx.data(), want_se.data(), tg.data(), want_losses.data(), R);
  k::ce_backward(rows.data(), targets.data(), want_mx.data(), want_se.data(), ones.data(), want.data(), R, V, 0, ld);
  ops.ce_loss_grad(rows.data(), targets.data(), mx.data(), se.data(), losses.data(), R, V, ld);
  // Equal up to the last bits (Eigen's vectorised and scalar exp, split by the arrays' alignment, may round apart).
  REQUIRE(rel_err(losses, want_losses) < 1e-15);
  REQUIRE(mx == want_mx);
  REQUIRE(rel_err(se, want_se) < 1e-15);
  REQUIRE(rel_err(rows, want) < 1e-15);
  REQUIRE(rows[std::size_t(2) * ld + V] == 99.0);  // the gaps stay
  // Each row's gradient sums to zero (softmax minus one hot), and the row left out is the softmax alone.
  for (int r = 0; r < R; ++r) {
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += rows[std::size_t(r) * ld + v];
    CHECK(std::abs(sum - (r == 1 ? 1.0 : 0.0)) < 1e-14);
  }
}

TEST_CASE("cross-entropy on rows a pitch apart equals dense rows and leaves the gaps", "[kernels][cross_entropy]") {
  const int R = 5, V = 11, v0 = 4, ld = 16;
  const auto dense = random_vector(R * V, 7, -4, 4);
  std::vector<double> pitched(std::size_t(R) * ld, 99.0);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) pitched[std::size_t(r) * ld + v] = dense[std::size_t(r) * V + v];
  const std::vector<std::int32_t> targets = {4, 14, 9, 3, 20};  // in the slice [4, 15) and out of it
  const auto dloss = random_vector(R, 8);
  std::vector<double> mx(R), se(R), tg(R), mx_p(R), se_p(R), tg_p(R);
  k::ce_partials(dense.data(), mx.data(), se.data(), R, V);
  k::ce_partials(pitched.data(), mx_p.data(), se_p.data(), R, V, ld);
  k::ce_target_logit(dense.data(), targets.data(), tg.data(), R, V, v0);
  k::ce_target_logit(pitched.data(), targets.data(), tg_p.data(), R, V, v0, ld);
  // Equal up to the last bits (Eigen's vectorised and scalar exp, split by the rows' alignment, may round apart).
  REQUIRE(mx_p == mx);
  REQUIRE(rel_err(se_p, se) < 1e-15);
  REQUIRE(tg_p == tg);
  std::vector<double> d(dense.size());
  k::ce_backward(dense.data(), targets.data(), mx.data(), se.data(), dloss.data(), d.data(), R, V, v0);
  k::ce_backward(pitched.data(), targets.data(), mx.data(), se.data(), dloss.data(), pitched.data(), R, V, v0, ld);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < ld; ++v) {
      const double got = pitched[std::size_t(r) * ld + v];
      if (v < V) REQUIRE(std::abs(got - d[std::size_t(r) * V + v]) <= 1e-15 * std::abs(d[std::size_t(r) * V + v]));
      else REQUIRE(got == 99.0);
    }
}

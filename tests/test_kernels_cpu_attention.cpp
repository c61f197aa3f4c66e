// Attention: the tiled online-softmax forward and the recomputing backward against a materialised-softmax
// reference (T across tile boundaries, multi-head, GQA, MQA, fused qkv strides), against finite differences, and
// float/bf16 against double.
#include "catch.hpp"
#include "test_kernels_cpu_support.hpp"

#include <tuple>

using namespace kt;

namespace {

//! q, k, v (and their gradients) in one buffer or three, with out and dout in a fourth.
struct Layout {
  int B, T, Hq, Hkv, D;
  bool fused;      // q, k, v side by side in rows of (Hq + 2 Hkv) D
  int pad_out = 0;  // extra elements at the end of each out row
  k::AttentionShape shape() const {
    const std::ptrdiff_t row = std::ptrdiff_t(Hq + 2 * Hkv) * D;
    return {B, T, Hq, Hkv, D, fused ? row : Hq * D, fused ? row : Hkv * D, Hq * D + pad_out,
            1 / std::sqrt(double(D))};
  }
  std::size_t q_size() const { return std::size_t(B) * T * (fused ? (Hq + 2 * Hkv) * D : Hq * D); }
  std::size_t kv_size() const { return fused ? 0 : std::size_t(B) * T * Hkv * D; }
  std::size_t out_size() const { return std::size_t(B) * T * (Hq * D + pad_out); }
  std::ptrdiff_t k_offset() const { return fused ? Hq * D : 0; }
  std::ptrdiff_t v_offset() const { return fused ? (Hq + Hkv) * D : 0; }
};

//! The inputs: q (or the fused qkv), k, v; views into them by the layout.
template <class T>
struct Inputs {
  std::vector<T> q, k, v;
  const T* qp() const { return q.data(); }
  const T* kp(const Layout& L) const { return L.fused ? q.data() + L.k_offset() : k.data(); }
  const T* vp(const Layout& L) const { return L.fused ? q.data() + L.v_offset() : v.data(); }
};

Inputs<double> random_inputs(const Layout& L, std::uint64_t seed) {
  return {random_vector(L.q_size(), seed, -2, 2), random_vector(L.kv_size(), seed + 1, -2, 2),
          random_vector(L.kv_size(), seed + 2)};
}

//! The materialised-softmax reference: out and lse, and from dout the gradients dq, dk, dv (same layout as q, k, v).
struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

Reference naive_attention(const Layout& L, const Inputs<double>& in, const std::vector<double>& dout) {
  const auto s = L.shape();
  Reference ref{std::vector<double>(L.out_size(), 0.0), std::vector<double>(std::size_t(L.B) * L.Hq * L.T),
                std::vector<double>(L.q_size(), 0.0), std::vector<double>(L.kv_size(), 0.0),
                std::vector<double>(L.kv_size(), 0.0)};
  double* dkp = L.fused ? ref.dq.data() + L.k_offset() : ref.dk.data();
  double* dvp = L.fused ? ref.dq.data() + L.v_offset() : ref.dv.data();
  const double* q = in.qp();
  const double* k = in.kp(L);
  const double* v = in.vp(L);
  const int D = L.D;
  for (int b = 0; b < L.B; ++b)
    for (int h = 0; h < L.Hq; ++h) {
      const int kh = h / (L.Hq / L.Hkv);
      for (int i = 0; i < L.T; ++i) {
        auto qrow = [&](int t) { return q + (std::ptrdiff_t(b) * L.T + t) * s.ldq + h * D; };
        auto krow = [&](int t) { return k + (std::ptrdiff_t(b) * L.T + t) * s.ldkv + kh * D; };
        auto vrow = [&](int t) { return v + (std::ptrdiff_t(b) * L.T + t) * s.ldkv + kh * D; };
        std::vector<double> p(i + 1);
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          double dotp = 0;
          for (int d = 0; d < D; ++d) dotp += qrow(i)[d] * krow(j)[d];
          p[j] = s.scale * dotp;
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += std::exp(p[j] - mx);
        for (int j = 0; j <= i; ++j) p[j] = std::exp(p[j] - mx) / sum;
        ref.lse[(std::size_t(b) * L.Hq + h) * L.T + i] = mx + std::log(sum);
        const std::ptrdiff_t o = (std::ptrdiff_t(b) * L.T + i) * s.ldo + h * D;
        for (int j = 0; j <= i; ++j)
          for (int d = 0; d < D; ++d) ref.out[o + d] += p[j] * vrow(j)[d];
        // Backward of row i: dp_j = dout . v_j, ds_j = p_j (dp_j - sum_j p_j dp_j).
        std::vector<double> dp(i + 1);
        double pdp = 0;
        for (int j = 0; j <= i; ++j) {
          dp[j] = 0;
          for (int d = 0; d < D; ++d) dp[j] += dout[o + d] * vrow(j)[d];
          pdp += p[j] * dp[j];
        }
        for (int j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - pdp) * s.scale;
          const std::ptrdiff_t kj = (std::ptrdiff_t(b) * L.T + j) * s.ldkv + kh * D;
          for (int d = 0; d < D; ++d) {
            ref.dq[(std::ptrdiff_t(b) * L.T + i) * s.ldq + h * D + d] += ds * krow(j)[d];
            dkp[kj + d] += ds * qrow(i)[d];
            dvp[kj + d] += p[j] * dout[o + d];
          }
        }
      }
    }
  return ref;
}

//! The kernels' out, lse and gradients in T; the gradients share the inputs' layout (one fused buffer or three).
template <class T>
Reference run_kernels(const Layout& L, const Inputs<T>& in, const std::vector<T>& dout, bool backward = true) {
  const auto s = L.shape();
  std::vector<T> out(L.out_size(), T(0.0f)), dq(L.q_size(), T(0.0f)), dk(L.kv_size()), dv(L.kv_size());
  std::vector<k::acc_t<T>> lse(std::size_t(L.B) * L.Hq * L.T);
  k::attention_forward(in.qp(), in.kp(L), in.vp(L), out.data(), lse.data(), s);
  if (backward) {
    T* dkp = L.fused ? dq.data() + L.k_offset() : dk.data();
    T* dvp = L.fused ? dq.data() + L.v_offset() : dv.data();
    k::attention_backward(dout.data(), in.qp(), in.kp(L), in.vp(L), out.data(), lse.data(), dq.data(), dkp, dvp, s);
  }
  return {to_double(out), to_double(lse), to_double(dq), to_double(dk), to_double(dv)};
}

}  // namespace

TEST_CASE("attention equals a materialised softmax across tiles, heads and GQA", "[kernels][attention][backward]") {
  const std::tuple<int, int> heads[] = {{2, 2}, {4, 2}, {4, 1}};
  std::uint64_t seed = 100;
  for (int T : {1, 7, 64, 65, 130})
    for (auto [Hq, Hkv] : heads)
      for (int D : {8, 16}) {
        const Layout L{2, T, Hq, Hkv, D, (T + D) % 3 != 0, T % 2};
        CAPTURE(T, Hq, Hkv, D, L.fused, L.pad_out);
        const auto in = random_inputs(L, seed);
        const auto dout = random_vector(L.out_size(), seed + 3);
        seed += 4;
        const auto ref = naive_attention(L, in, dout);
        const auto got = run_kernels(L, in, dout);
        REQUIRE(rel_err(got.out, ref.out) < 1e-13);
        REQUIRE(rel_err(got.lse, ref.lse) < 1e-13);
        REQUIRE(rel_err(got.dq, ref.dq) < 1e-12);
        REQUIRE(rel_err(got.dk, ref.dk) < 1e-12);
        REQUIRE(rel_err(got.dv, ref.dv) < 1e-12);
      }
}

TEST_CASE("attention backward matches finite differences", "[kernels][attention][backward]") {
  // Small and multi-tile; separate buffers with GQA, fused with MQA. For T = 70 every 7th element is checked.
  const std::tuple<Layout, std::size_t> cases[] = {{{2, 7, 4, 2, 8, false}, 1}, {{1, 70, 2, 1, 8, true}, 7}};
  for (const auto& [L, stride] : cases) {
    CAPTURE(L.T, L.Hq, L.Hkv, L.fused);
    const auto in = random_inputs(L, 7);
    const auto W = random_vector(L.out_size(), 8);  // loss = sum(W * out), so dout = W
    const auto got = run_kernels(L, in, W);
    auto loss = [&, L = L](const Inputs<double>& x) { return dot(run_kernels(L, x, W, false).out, W); };
    REQUIRE(fd_error([&](const auto& q) { return loss({q, in.k, in.v}); }, in.q, got.dq, stride) < 1e-8);
    if (!L.fused) {
      REQUIRE(fd_error([&](const auto& kk) { return loss({in.q, kk, in.v}); }, in.k, got.dk, stride) < 1e-8);
      REQUIRE(fd_error([&](const auto& vv) { return loss({in.q, in.k, vv}); }, in.v, got.dv, stride) < 1e-8);
    }
  }
}

TEMPLATE_TEST_CASE("attention in float and bf16 against double", "[kernels][attention][dtype]", float, bf16) {
  const Layout L{2, 100, 4, 2, 16, true};
  const auto in = random_inputs(L, 9);
  const auto dout = random_vector(L.out_size(), 10);
  const Inputs<double> rin{rounded<TestType>(in.q), {}, {}};
  const auto ref = run_kernels(L, rin, rounded<TestType>(dout));
  const Inputs<TestType> tin{convert<TestType>(in.q), {}, {}};
  const auto got = run_kernels(L, tin, convert<TestType>(dout));
  const double tol = std::is_same_v<TestType, float> ? 1e-5 : 4 * unit_roundoff<TestType>();
  REQUIRE(rel_err(got.out, ref.out) < tol);
  REQUIRE(rel_err(got.lse, ref.lse) < tol);
  REQUIRE(rel_err(got.dq, ref.dq) < tol);  // in bf16, dq also sees the rounded out in D = rowsum(dout * out)
}

TEST_CASE("attention rejects query heads not divisible by kv heads", "[kernels][attention]") {
  std::vector<double> x(3 * 8), out(3 * 8), lse(3);
  const k::AttentionShape s{1, 1, 3, 2, 8, 24, 16, 24, 1.0};
  REQUIRE_THROWS_AS(k::attention_forward(x.data(), x.data(), x.data(), out.data(), lse.data(), s), loom::Error);
}

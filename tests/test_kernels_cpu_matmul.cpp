// matmul: every transpose combination, alpha and beta, batches, against a naive product; a group of products
// (Ops<Host>::matmul_group); the backward formulas built from matmul against finite differences; float, bf16 and
// fp16 against double.
#include "catch.hpp"
#include "test_kernels_cpu_support.hpp"

#include <loom/kernels/ops.hpp>

#include <limits>
#include <tuple>

using namespace kt;

namespace {

// C = alpha op(A) op(B) + beta C in double, element by element.
void naive_matmul(const std::vector<double>& A, const std::vector<double>& B, std::vector<double>& C, int M, int N,
                  int K, bool ta, bool tb, double alpha, double beta, std::size_t a0 = 0, std::size_t b0 = 0,
                  std::size_t c0 = 0) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double s = 0;
      for (int p = 0; p < K; ++p) {
        const double a = ta ? A[a0 + std::size_t(p) * M + i] : A[a0 + std::size_t(i) * K + p];
        const double b = tb ? B[b0 + std::size_t(j) * K + p] : B[b0 + std::size_t(p) * N + j];
        s += a * b;
      }
      double& c = C[c0 + std::size_t(i) * N + j];
      c = alpha * s + (beta == 0 ? 0.0 : beta * c);
    }
}

const std::tuple<bool, bool> transposes[] = {{false, false}, {false, true}, {true, false}, {true, true}};

}  // namespace

TEST_CASE("matmul equals a naive product for every transpose, alpha and beta", "[kernels][matmul]") {
  const std::tuple<int, int, int> shapes[] = {{1, 1, 1}, {5, 7, 3}, {33, 17, 70}, {64, 1, 9}, {2, 40, 1}};
  const std::pair<double, double> scalars[] = {{1, 0}, {0.5, 1}, {2, -0.5}};
  std::uint64_t seed = 1;
  for (auto [ta, tb] : transposes)
    for (auto [M, N, K] : shapes)
      for (auto [alpha, beta] : scalars) {
        CAPTURE(ta, tb, M, N, K, alpha, beta);
        const auto A = random_vector(std::size_t(M) * K, seed++);
        const auto B = random_vector(std::size_t(K) * N, seed++);
        auto C = random_vector(std::size_t(M) * N, seed++);
        auto expected = C;
        naive_matmul(A, B, expected, M, N, K, ta, tb, alpha, beta);
        k::matmul(A.data(), B.data(), C.data(), M, N, K, ta, tb, float(alpha), float(beta));
        REQUIRE(rel_err(C, expected) < 1e-14);
      }
}

TEST_CASE("matmul with beta 0 never reads C, and K = 0 gives beta C", "[kernels][matmul]") {
  const auto A = random_vector(12, 1), B = random_vector(12, 2);
  std::vector<double> C(9, std::numeric_limits<double>::quiet_NaN());
  k::matmul(A.data(), B.data(), C.data(), 3, 3, 4, false, false);
  std::vector<double> expected(9, 0.0);
  naive_matmul(A, B, expected, 3, 3, 4, false, false, 1, 0);
  REQUIRE(rel_err(C, expected) < 1e-15);

  std::vector<float> Cf(6, 2.0f);
  k::matmul<float>(nullptr, nullptr, Cf.data(), 2, 3, 0, false, true, 1.0f, 0.5f);
  REQUIRE(Cf == std::vector<float>(6, 1.0f));
  std::vector<bf16> Cb(6, bf16(std::numeric_limits<float>::quiet_NaN()));
  k::matmul<bf16>(nullptr, nullptr, Cb.data(), 2, 3, 0, true, false);
  for (bf16 c : Cb) REQUIRE(float(c) == 0.0f);
}

TEST_CASE("Ops<Host>::matmul_group: products of sizes of their own in one buffer, empty ones, K = 0, accumulation",
          "[kernels][matmul]") {
  const loom::kernels::Ops<loom::Host> ops;
  // Three experts' products over rows [0, 5), [5, 5) (none) and [5, 12) of one buffer, as a mixture of experts
  // makes them, then a fourth with no inner size, which scales its C by beta.
  const int rows[] = {5, 0, 7}, N = 6, K = 4;
  std::uint64_t seed = 40;
  for (auto [ta, tb] : transposes)
    for (const double beta : {0.0, 0.5}) {
      CAPTURE(ta, tb, beta);
      const auto x = random_vector(12 * K, seed++);       // the rows, each expert's block stored as op(A) needs it
      const auto w = random_vector(3 * K * N, seed++);    // one weight per expert
      auto out = random_vector(12 * N, seed++), scaled = random_vector(8, seed++);
      auto want = out, want_scaled = scaled;
      std::vector<loom::kernels::Product<double>> group;
      int at = 0;
      for (int e = 0; e < 3; ++e) {
        group.push_back({x.data() + std::size_t(at) * K, w.data() + std::size_t(e) * K * N, out.data() + std::size_t(at) * N,
                         rows[e], N, K});
        naive_matmul(x, w, want, rows[e], N, K, ta, tb, 1.5, beta, std::size_t(at) * K, std::size_t(e) * K * N,
                     std::size_t(at) * N);
        at += rows[e];
      }
      group.push_back({nullptr, nullptr, scaled.data(), 2, 4, 0});
      for (auto& v : want_scaled) v *= beta;
      ops.matmul_group(group.data(), group.size(), ta, tb, 1.5f, float(beta));
      REQUIRE(rel_err(out, want) < 1e-14);
      REQUIRE(scaled == want_scaled);
    }
  loom::kernels::Product<double> negative{nullptr, nullptr, nullptr, 2, -1, 3};
  REQUIRE_THROWS_WITH(ops.matmul_group(&negative, 1, false, false),
                      Catch::Contains("matmul_group: product 0 has a negative size (m=2, n=-1, k=3)"));
}

TEST_CASE("Ops<Host>::matmul_bgrad is the product then the bias's column sums, bit for bit", "[kernels][matmul]") {
  const loom::kernels::Ops<loom::Host> ops;
  const int M = 6, N = 5, K = 9;
  for (const bool ta : {false, true}) {
    const auto a = convert<float>(random_vector(M * K, 70)), b = convert<float>(random_vector(K * N, 71));
    auto c = convert<float>(random_vector(M * N, 72)), bias = convert<float>(random_vector(N, 73));
    auto want = c, want_bias = bias;
    k::matmul(a.data(), b.data(), want.data(), M, N, K, ta, false, 0.5f, 1.0f);
    k::bias_backward(b.data(), want_bias.data(), K, N);
    ops.matmul_bgrad(a.data(), b.data(), c.data(), bias.data(), M, N, K, ta, 0.5f, 1.0f);
    REQUIRE(c == want);
    REQUIRE(bias == want_bias);
    REQUIRE(bias != convert<float>(random_vector(N, 73)));
  }
}

TEST_CASE("Ops<Host>::matmul_residual is the product, the bias and then the residual's sum, bit for bit",
          "[kernels][matmul]") {
  const loom::kernels::Ops<loom::Host> ops;
  const int M = 6, N = 5, K = 9;
  for (const bool with_bias : {true, false}) {
    const auto a = convert<float>(random_vector(M * K, 80)), b = convert<float>(random_vector(K * N, 81));
    const auto res = convert<float>(random_vector(M * N, 82)), bias = convert<float>(random_vector(N, 83));
    std::vector<float> want(M * N), c(M * N);
    ops.matmul_bias(a.data(), b.data(), bias.data(), want.data(), M, N, K, false, true);
    if (!with_bias) k::matmul(a.data(), b.data(), want.data(), M, N, K, false, true);
    ops.add(res.data(), want.data(), want.data(), want.size());
    ops.matmul_residual(a.data(), b.data(), with_bias ? bias.data() : nullptr, res.data(), c.data(), M, N, K, false,
                        true);
    REQUIRE(c == want);
    REQUIRE(c != res);
  }
  auto x = convert<float>(random_vector(M * N, 84));
  const float* no_bias = nullptr;
  REQUIRE_THROWS_WITH(ops.matmul_residual(x.data(), x.data(), no_bias, x.data(), x.data(), M, N, N, false, false),
                      Catch::Contains("matmul_residual: the residual must not be the output (M=6, N=5)"));
}

TEST_CASE("batched matmul: per-batch strides and a shared operand", "[kernels][matmul]") {
  const int M = 6, N = 5, K = 7, batch = 3;
  for (auto [ta, tb] : transposes)
    for (bool shared_b : {false, true}) {
      CAPTURE(ta, tb, shared_b);
      const std::ptrdiff_t sa = M * K + 3, sb = shared_b ? 0 : K * N + 1, sc = M * N + 2;
      const auto A = random_vector(std::size_t(sa) * batch, 10);
      const auto B = random_vector(std::size_t(K) * N + std::size_t(sb) * batch, 11);
      auto C = random_vector(std::size_t(sc) * batch, 12);
      auto expected = C;
      for (int i = 0; i < batch; ++i)
        naive_matmul(A, B, expected, M, N, K, ta, tb, 1.5, 0.25, std::size_t(i * sa), std::size_t(i * sb),
                     std::size_t(i * sc));
      k::matmul(A.data(), B.data(), C.data(), M, N, K, ta, tb, 1.5f, 0.25f, batch, sa, sb, sc);
      REQUIRE(rel_err(C, expected) < 1e-14);
    }
}

// C = op(A) op(B), loss = sum(W * C). The gradients a linear layer computes with matmul itself:
// d op(A) = dC op(B)^T and d op(B) = op(A)^T dC, each written in the stored layout of A and B.
TEST_CASE("matmul backward formulas match finite differences", "[kernels][matmul][backward]") {
  const int M = 4, N = 5, K = 3;
  for (auto [ta, tb] : transposes) {
    CAPTURE(ta, tb);
    const auto A = random_vector(M * K, 20), B = random_vector(K * N, 21), W = random_vector(M * N, 22);
    auto forward = [&, ta = ta, tb = tb](const std::vector<double>& a, const std::vector<double>& b) {
      std::vector<double> C(M * N);
      k::matmul(a.data(), b.data(), C.data(), M, N, K, ta, tb);
      return dot(C, W);
    };
    std::vector<double> dA(M * K);
    const auto dB0 = random_vector(K * N, 23);  // weight gradients accumulate onto what is there
    auto dB = dB0;
    if (!ta) k::matmul(W.data(), B.data(), dA.data(), M, K, N, false, !tb);  // dA = dC op(B)^T
    else k::matmul(B.data(), W.data(), dA.data(), K, M, N, tb, true);        // dA = op(B) dC^T
    if (!tb) k::matmul(A.data(), W.data(), dB.data(), K, N, M, !ta, false, 1.0f, 1.0f);  // dB += op(A)^T dC
    else k::matmul(W.data(), A.data(), dB.data(), N, K, M, true, ta, 1.0f, 1.0f);       // dB += dC^T op(A)
    for (int i = 0; i < K * N; ++i) dB[i] -= dB0[i];
    REQUIRE(fd_error([&](const auto& a) { return forward(a, B); }, A, dA) < 1e-9);
    REQUIRE(fd_error([&](const auto& b) { return forward(A, b); }, B, dB) < 1e-9);
  }
}

// Batched with a shared B (attention-style weights): dA per batch by a batched product, dB by one product over the
// batch's stacked rows.
TEST_CASE("batched matmul backward matches finite differences", "[kernels][matmul][backward]") {
  const int M = 3, N = 4, K = 5, batch = 3;
  const auto A = random_vector(batch * M * K, 30), B = random_vector(K * N, 31), W = random_vector(batch * M * N, 32);
  auto forward = [&](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> C(batch * M * N);
    k::matmul(a.data(), b.data(), C.data(), M, N, K, false, false, 1.0f, 0.0f, batch, M * K, 0, M * N);
    return dot(C, W);
  };
  std::vector<double> dA(batch * M * K), dB(K * N, 0.0);
  k::matmul(W.data(), B.data(), dA.data(), M, K, N, false, true, 1.0f, 0.0f, batch, M * N, 0, M * K);
  k::matmul(A.data(), W.data(), dB.data(), K, N, batch * M, true, false, 1.0f, 1.0f);
  REQUIRE(fd_error([&](const auto& a) { return forward(a, B); }, A, dA) < 1e-9);
  REQUIRE(fd_error([&](const auto& b) { return forward(A, b); }, B, dB) < 1e-9);
}

// Sizes that cross the 256-wide blocks of the bf16/fp16 path in M, N and K.
TEMPLATE_TEST_CASE("matmul in float, bf16 and fp16 against double", "[kernels][matmul][dtype]", float, bf16, fp16) {
  const int M = 300, N = 270, K = 520;
  for (auto [ta, tb] : transposes) {
    CAPTURE(ta, tb);
    const auto A = rounded<TestType>(random_vector(std::size_t(M) * K, 40));
    const auto B = rounded<TestType>(random_vector(std::size_t(K) * N, 41));
    const auto C0 = rounded<TestType>(random_vector(std::size_t(M) * N, 42));
    auto expected = C0;
    naive_matmul(A, B, expected, M, N, K, ta, tb, 0.5, 2.0);
    const auto At = convert<TestType>(A), Bt = convert<TestType>(B);
    auto Ct = convert<TestType>(C0);
    k::matmul(At.data(), Bt.data(), Ct.data(), M, N, K, ta, tb, 0.5f, 2.0f);
    // One rounding of the result, float accumulation over K, relative to the result's scale.
    const double tol = std::is_same_v<TestType, float> ? 1e-5 : 2 * unit_roundoff<TestType>();
    REQUIRE(rel_err(Ct, expected) < tol);
  }
}

TEMPLATE_TEST_CASE("matmul_ld: rows further apart than their widths give the dense product and leave the gaps",
                   "[kernels][matmul]", double, bf16) {
  using T = TestType;
  const int M = 9, N = 13, K = 6, gap = 5;
  std::uint64_t seed = 40;
  for (auto [ta, tb] : transposes) {
    CAPTURE(ta, tb);
    const int ra = ta ? K : M, ca = ta ? M : K, rb = tb ? N : K, cb = tb ? K : N;
    const auto A = rounded<T>(random_vector(std::size_t(ra) * ca, seed++));
    const auto B = rounded<T>(random_vector(std::size_t(rb) * cb, seed++));
    const auto C = rounded<T>(random_vector(std::size_t(M) * N, seed++));
    // The dense product, and the same operands spread over rows `gap` elements longer, the gaps holding 7.
    auto spread = [&](const std::vector<double>& x, int rows, int cols) {
      std::vector<T> out(std::size_t(rows) * (cols + gap), T(7.0f));
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) out[std::size_t(r) * (cols + gap) + c] = T(x[std::size_t(r) * cols + c]);
      return out;
    };
    auto want = convert<T>(C);
    const auto a = convert<T>(A), b = convert<T>(B);
    k::matmul(a.data(), b.data(), want.data(), M, N, K, ta, tb, 0.5f, 2.0f);
    const auto sa = spread(A, ra, ca), sb = spread(B, rb, cb);
    auto sc = spread(C, M, N);
    k::matmul_ld(sa.data(), ca + gap, sb.data(), cb + gap, sc.data(), N + gap, M, N, K, ta, tb, 0.5f, 2.0f);
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < N + gap; ++c) {
        const T got = sc[std::size_t(r) * (N + gap) + c];
        REQUIRE(double(got) == (c < N ? double(want[std::size_t(r) * N + c]) : 7.0));
      }
  }
}

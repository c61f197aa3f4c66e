// Element-wise kernels, SwiGLU, layer and RMS norm, rotary positions, embeddings, dropout and the optimizers: backward against finite differences in
// double, float/bf16/fp16 against double, AdamW and SGD against values torch.optim produced.
#include "catch.hpp"
#include "test_kernels_cpu_support.hpp"

#include <alloca.h>

#include <cstring>
#include <limits>
#include <numbers>

using namespace kt;

namespace {

double gelu_ref(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}

}  // namespace

TEST_CASE("bias_add, and bias_backward accumulates the column sums", "[kernels][bias][backward]") {
  const int R = 7, C = 5;
  const auto x = random_vector(R * C, 1), bias = random_vector(C, 2), W = random_vector(R * C, 3);
  std::vector<double> out(R * C);
  k::bias_add(x.data(), bias.data(), out.data(), R, C);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) REQUIRE(out[r * C + c] == x[r * C + c] + bias[c]);
  auto in_place = x;
  k::bias_add(in_place.data(), bias.data(), in_place.data(), R, C);
  REQUIRE(in_place == out);

  auto loss = [&](const std::vector<double>& b) {
    std::vector<double> o(R * C);
    k::bias_add(x.data(), b.data(), o.data(), R, C);
    return dot(o, W);
  };
  const auto db0 = random_vector(C, 4);
  auto db = db0;
  k::bias_backward(W.data(), db.data(), R, C);
  for (int c = 0; c < C; ++c) db[c] -= db0[c];
  REQUIRE(fd_error(loss, bias, db) < 1e-9);
}

TEMPLATE_TEST_CASE("bias, add and accumulate in float, bf16 and fp16", "[kernels][bias][dtype]", float, bf16, fp16) {
  const int R = 40, C = 1100;  // more columns than one conversion chunk
  const auto x = rounded<TestType>(random_vector(R * C, 5)), b = rounded<TestType>(random_vector(C, 6));
  const auto xt = convert<TestType>(x), bt = convert<TestType>(b);
  std::vector<TestType> out(R * C);
  k::bias_add(xt.data(), bt.data(), out.data(), R, C);
  std::vector<double> expected(R * C);
  for (int i = 0; i < R * C; ++i) expected[i] = x[i] + b[i % C];
  REQUIRE(rel_err(out, expected) <= unit_roundoff<TestType>());

  std::vector<TestType> db(C, TestType(1.0f));
  k::bias_backward(xt.data(), db.data(), R, C);
  std::vector<double> db_expected(C, 1.0);
  for (int i = 0; i < R * C; ++i) db_expected[i % C] += x[i];
  REQUIRE(rel_err(db, db_expected) <= 2 * unit_roundoff<TestType>() + R * 0x1p-24);  // R float additions

  std::vector<TestType> sum(R * C);
  k::add(xt.data(), out.data(), sum.data(), R * C);
  auto acc = xt;
  k::accumulate(out.data(), acc.data(), R * C);
  for (int i = 0; i < R * C; ++i) {
    REQUIRE(float(sum[i]) == float(TestType(float(xt[i]) + float(out[i]))));
    REQUIRE(float(acc[i]) == float(sum[i]));
  }
}

TEST_CASE("gelu forward is the tanh form and backward matches finite differences", "[kernels][gelu][backward]") {
  const std::size_t n = 1000;
  const auto x = random_vector(n, 7, -6, 6), W = random_vector(n, 8);
  std::vector<double> out(n);
  k::gelu_forward(x.data(), out.data(), n);
  for (std::size_t i = 0; i < n; ++i) REQUIRE(std::abs(out[i] - gelu_ref(x[i])) < 1e-15 * (1 + std::abs(x[i])));
  std::vector<double> dx(n);
  k::gelu_backward(x.data(), W.data(), dx.data(), n);
  auto loss = [&](const std::vector<double>& xs) {
    std::vector<double> o(n);
    k::gelu_forward(xs.data(), o.data(), n);
    return dot(o, W);
  };
  REQUIRE(fd_error(loss, x, dx) < 1e-9);
}

//! f() run with the stack moved down by 16 * k bytes (the stack's own alignment).
template <class F>
[[gnu::noinline]] auto at_stack_depth(int k, F&& f) {
  volatile char* pad = static_cast<volatile char*>(alloca(16 * static_cast<std::size_t>(k) + 16));
  pad[0] = 0;
  return f();
}

TEMPLATE_TEST_CASE("gelu gives the same bits wherever the stack is", "[kernels][gelu]", float, double) {
  const std::size_t n = 1000;
  const auto x = convert<TestType>(random_vector(n, 11, -6, 6)), g = convert<TestType>(random_vector(n, 12));
  auto run = [&] {
    std::vector<TestType> out(n), dx(n);
    k::gelu_forward(x.data(), out.data(), n);
    k::gelu_backward(x.data(), g.data(), dx.data(), n);
    out.insert(out.end(), dx.begin(), dx.end());
    return out;
  };
  const auto first = at_stack_depth(0, run);
  for (int depth = 1; depth < 8; ++depth) {
    const auto again = at_stack_depth(depth, run);
    INFO("stack moved by " << 16 * depth << " bytes");
    REQUIRE(std::memcmp(again.data(), first.data(), first.size() * sizeof(TestType)) == 0);
  }
}

TEMPLATE_TEST_CASE("gelu in float, bf16 and fp16 against double", "[kernels][gelu][dtype]", float, bf16, fp16) {
  const std::size_t n = 3000;
  const auto x = rounded<TestType>(random_vector(n, 9, -5, 5)), g = rounded<TestType>(random_vector(n, 10));
  const auto xt = convert<TestType>(x), gt = convert<TestType>(g);
  std::vector<double> out(n), dx(n);
  k::gelu_forward(x.data(), out.data(), n);
  k::gelu_backward(x.data(), g.data(), dx.data(), n);
  std::vector<TestType> out_t(n), dx_t(n);
  k::gelu_forward(xt.data(), out_t.data(), n);
  k::gelu_backward(xt.data(), gt.data(), dx_t.data(), n);
  const double tol = std::is_same_v<TestType, float> ? 1e-6 : unit_roundoff<TestType>();
  REQUIRE(rel_err(out_t, out) < tol);
  REQUIRE(rel_err(dx_t, dx) < tol);
}

namespace {

struct LayerNormCase {
  int R = 6, C = 13;
  std::vector<double> x = random_vector(std::size_t(R) * C, 11, -2, 3), w = random_vector(std::size_t(C), 12),
                      b = random_vector(std::size_t(C), 13), W = random_vector(std::size_t(R) * C, 14);
  double loss(const std::vector<double>& xs, const std::vector<double>& ws, const std::vector<double>& bs) const {
    std::vector<double> out(x.size()), mean(R), rstd(R);
    k::layernorm_forward(xs.data(), ws.data(), bs.data(), out.data(), mean.data(), rstd.data(), R, C);
    return dot(out, W);
  }
};

}  // namespace

TEST_CASE("layernorm normalises each row", "[kernels][layernorm]") {
  LayerNormCase c;
  std::vector<double> out(c.x.size()), mean(c.R), rstd(c.R);
  const std::vector<double> ones(c.C, 1.0), zeros(c.C, 0.0);
  k::layernorm_forward(c.x.data(), ones.data(), zeros.data(), out.data(), mean.data(), rstd.data(), c.R, c.C);
  for (int r = 0; r < c.R; ++r) {
    double mu = 0, var = 0;
    for (int i = 0; i < c.C; ++i) mu += c.x[r * c.C + i] / c.C;
    for (int i = 0; i < c.C; ++i) var += (c.x[r * c.C + i] - mu) * (c.x[r * c.C + i] - mu) / c.C;
    REQUIRE(std::abs(mean[r] - mu) < 1e-14);
    REQUIRE(std::abs(rstd[r] - 1 / std::sqrt(var + 1e-5)) < 1e-13);
    double s = 0, s2 = 0;
    for (int i = 0; i < c.C; ++i) {
      s += out[r * c.C + i];
      s2 += out[r * c.C + i] * out[r * c.C + i];
    }
    REQUIRE(std::abs(s) < 1e-13);
    REQUIRE(std::abs(s2 / c.C - var / (var + 1e-5)) < 1e-13);
  }
}

TEST_CASE("layernorm backward matches finite differences", "[kernels][layernorm][backward]") {
  LayerNormCase c;
  std::vector<double> out(c.x.size()), mean(c.R), rstd(c.R), dx(c.x.size());
  k::layernorm_forward(c.x.data(), c.w.data(), c.b.data(), out.data(), mean.data(), rstd.data(), c.R, c.C);
  k::layernorm_backward_input(c.W.data(), c.x.data(), c.w.data(), mean.data(), rstd.data(), dx.data(), c.R, c.C);
  const auto dw0 = random_vector(c.C, 15), db0 = random_vector(c.C, 16);
  auto dw = dw0, db = db0;
  k::layernorm_backward_weight(c.W.data(), c.x.data(), mean.data(), rstd.data(), dw.data(), db.data(), c.R, c.C);
  for (int i = 0; i < c.C; ++i) {
    dw[i] -= dw0[i];
    db[i] -= db0[i];
  }
  REQUIRE(fd_error([&](const auto& x) { return c.loss(x, c.w, c.b); }, c.x, dx) < 1e-8);
  REQUIRE(fd_error([&](const auto& w) { return c.loss(c.x, w, c.b); }, c.w, dw) < 1e-9);
  REQUIRE(fd_error([&](const auto& b) { return c.loss(c.x, c.w, b); }, c.b, db) < 1e-9);
}

TEMPLATE_TEST_CASE("a norm's input gradient with a residual's is the gradient then an accumulate, bit for bit, in "
                   "place or not",
                   "[kernels][layernorm][rmsnorm]", double, float, bf16) {
  using T = TestType;
  using A = loom::acc_t<T>;
  const int R = 5, C = 40;
  const auto x = convert<T>(random_vector(R * C, 60, -2, 3)), w = convert<T>(random_vector(C, 61, 0.5, 1.5));
  const auto b = convert<T>(random_vector(C, 62)), g = convert<T>(random_vector(R * C, 63));
  const auto res = convert<T>(random_vector(R * C, 64, -4, 4));
  std::vector<T> out(R * C);
  std::vector<A> mean(R), rstd(R);
  const auto bits = [](const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
  };
  for (const bool rms : {false, true}) {
    CAPTURE(rms);
    if (rms) k::rmsnorm_forward(x.data(), w.data(), out.data(), rstd.data(), R, C);
    else k::layernorm_forward(x.data(), w.data(), b.data(), out.data(), mean.data(), rstd.data(), R, C);
    const auto backward = [&](T* dx, const T* dres) {
      if (rms) k::rmsnorm_backward_input(g.data(), x.data(), w.data(), rstd.data(), dx, R, C, dres);
      else k::layernorm_backward_input(g.data(), x.data(), w.data(), mean.data(), rstd.data(), dx, R, C, dres);
    };
    std::vector<T> own(R * C), want = res;
    backward(own.data(), nullptr);
    k::accumulate(own.data(), want.data(), want.size());
    REQUIRE_FALSE(bits(want, res));
    std::vector<T> apart(R * C), in_place = res;
    backward(apart.data(), res.data());
    backward(in_place.data(), in_place.data());
    REQUIRE(bits(apart, want));
    REQUIRE(bits(in_place, want));
  }
}

TEMPLATE_TEST_CASE("layernorm in float, bf16 and fp16 against double", "[kernels][layernorm][dtype]", float, bf16,
                   fp16) {
  const int R = 16, C = 768;
  const auto x = rounded<TestType>(random_vector(R * C, 17, -3, 4)), w = rounded<TestType>(random_vector(C, 18));
  const auto b = rounded<TestType>(random_vector(C, 19)), g = rounded<TestType>(random_vector(R * C, 20));
  std::vector<double> out(R * C), mean(R), rstd(R), dx(R * C), dw(C, 0.0), db(C, 0.0);
  k::layernorm_forward(x.data(), w.data(), b.data(), out.data(), mean.data(), rstd.data(), R, C);
  k::layernorm_backward_input(g.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(), R, C);
  k::layernorm_backward_weight(g.data(), x.data(), mean.data(), rstd.data(), dw.data(), db.data(), R, C);

  const auto xt = convert<TestType>(x), wt = convert<TestType>(w), bt = convert<TestType>(b), gt = convert<TestType>(g);
  std::vector<TestType> out_t(R * C), dx_t(R * C), dw_t(C, TestType(0.0f)), db_t(C, TestType(0.0f));
  std::vector<float> mean_t(R), rstd_t(R);
  k::layernorm_forward(xt.data(), wt.data(), bt.data(), out_t.data(), mean_t.data(), rstd_t.data(), R, C);
  k::layernorm_backward_input(gt.data(), xt.data(), wt.data(), mean_t.data(), rstd_t.data(), dx_t.data(), R, C);
  k::layernorm_backward_weight(gt.data(), xt.data(), mean_t.data(), rstd_t.data(), dw_t.data(), db_t.data(), R, C);
  const double tol = std::is_same_v<TestType, float> ? 1e-5 : 2 * unit_roundoff<TestType>();
  REQUIRE(rel_err(out_t, out) < tol);
  REQUIRE(rel_err(dx_t, dx) < tol);
  REQUIRE(rel_err(dw_t, dw) < tol);
  REQUIRE(rel_err(db_t, db) < tol);
  REQUIRE(rel_err(mean_t, mean) < 1e-6);
  REQUIRE(rel_err(rstd_t, rstd) < 1e-6);
}

TEST_CASE("embedding over vocabulary slices, and its scatter-add backward", "[kernels][embedding][backward]") {
  const int V = 10, C = 4, n = 9;
  const std::vector<std::int32_t> ids = {3, 0, 9, 3, 7, 3, 5, 9, 1};  // repeats: the scatter adds
  const auto table = random_vector(V * C, 21), W = random_vector(n * C, 22);
  std::vector<double> full(n * C);
  k::embedding_forward(ids.data(), table.data(), full.data(), n, C, 0, V);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < C; ++c) REQUIRE(full[i * C + c] == table[ids[i] * C + c]);

  // Two slices [0, 6) and [6, 10): each gives its rows and zeros elsewhere; their sum is the full lookup.
  std::vector<double> lo(n * C, -1.0), hi(n * C, -1.0);
  k::embedding_forward(ids.data(), table.data(), lo.data(), n, C, 0, 6);
  k::embedding_forward(ids.data(), table.data() + 6 * C, hi.data(), n, C, 6, 4);
  for (int i = 0; i < n * C; ++i) REQUIRE(lo[i] + hi[i] == full[i]);

  auto loss = [&](const std::vector<double>& t) {
    std::vector<double> o(n * C);
    k::embedding_forward(ids.data(), t.data(), o.data(), n, C, 0, V);
    return dot(o, W);
  };
  const auto d0 = random_vector(V * C, 23);
  auto dtable = d0;
  k::embedding_backward(ids.data(), W.data(), dtable.data(), n, C, 0, V);
  for (int i = 0; i < V * C; ++i) dtable[i] -= d0[i];
  REQUIRE(fd_error(loss, table, dtable) < 1e-9);

  std::vector<double> dlo(6 * C, 0.0), dhi(4 * C, 0.0);
  k::embedding_backward(ids.data(), W.data(), dlo.data(), n, C, 0, 6);
  k::embedding_backward(ids.data(), W.data(), dhi.data(), n, C, 6, 4);
  dlo.insert(dlo.end(), dhi.begin(), dhi.end());
  REQUIRE(rel_err(dlo, dtable) < 1e-15);
}

TEMPLATE_TEST_CASE("embedding in bf16 and fp16", "[kernels][embedding][dtype]", bf16, fp16) {
  const std::vector<std::int32_t> ids = {2, 2, 0};
  const auto table = convert<TestType>(random_vector(3 * 5, 24));
  std::vector<TestType> out(3 * 5), dtable(3 * 5, TestType(0.0f));
  k::embedding_forward(ids.data(), table.data(), out.data(), 3, 5, 0, 3);
  for (int c = 0; c < 5; ++c) REQUIRE(float(out[c]) == float(table[2 * 5 + c]));
  const std::vector<TestType> ones(3 * 5, TestType(0.5f));
  k::embedding_backward(ids.data(), ones.data(), dtable.data(), 3, 5, 0, 3);
  for (int c = 0; c < 5; ++c) {
    REQUIRE(float(dtable[c]) == 0.5f);
    REQUIRE(float(dtable[5 + c]) == 0.0f);
    REQUIRE(float(dtable[10 + c]) == 1.0f);
  }
}

TEST_CASE("positions: add from an offset and accumulate over the batch", "[kernels][embedding][backward]") {
  const int B = 3, T = 4, C = 5, P = 9, t0 = 3;
  const auto wpe = random_vector(P * C, 25), x = random_vector(B * T * C, 26), W = random_vector(B * T * C, 27);
  auto out = x;
  k::add_positions(wpe.data(), out.data(), B, T, C, t0);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c)
        REQUIRE(out[(b * T + t) * C + c] == x[(b * T + t) * C + c] + wpe[(t0 + t) * C + c]);
  auto loss = [&](const std::vector<double>& w) {
    auto o = x;
    k::add_positions(w.data(), o.data(), B, T, C, t0);
    return dot(o, W);
  };
  const auto d0 = random_vector(P * C, 28);
  auto dwpe = d0;
  k::positions_backward(W.data(), dwpe.data(), B, T, C, t0);
  for (int i = 0; i < P * C; ++i) dwpe[i] -= d0[i];
  for (int i = 0; i < t0 * C; ++i) REQUIRE(dwpe[i] == 0.0);  // rows outside the window untouched
  REQUIRE(fd_error(loss, wpe, dwpe) < 1e-9);
}

TEST_CASE("dropout: one mask for forward and backward, keyed by global index", "[kernels][dropout][backward]") {
  const std::size_t n = 100000;
  const float p = 0.3f;
  const std::uint64_t seed = 1234, index0 = 77;
  const auto x = random_vector(n, 29, 0.5, 1.5), W = random_vector(n, 30);  // x != 0, so a zero is a drop
  std::vector<double> out(n), dx(n);
  k::dropout_forward(x.data(), out.data(), n, p, seed, index0);
  k::dropout_backward(W.data(), dx.data(), n, p, seed, index0);
  const double scale = 1.0 / (1.0 - double(p));
  std::size_t kept = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const bool keep = k::dropout_uniform(seed, index0 + i) >= p;
    kept += keep;
    REQUIRE(out[i] == (keep ? x[i] * scale : 0.0));
    REQUIRE(dx[i] == (keep ? W[i] * scale : 0.0));  // the same mask
  }
  REQUIRE(std::abs(double(kept) / n - (1 - p)) < 0.01);

  // A split tensor: each half keyed by its global offset gives the same result.
  std::vector<double> halves(n);
  k::dropout_forward(x.data(), halves.data(), n / 2, p, seed, index0);
  k::dropout_forward(x.data() + n / 2, halves.data() + n / 2, n - n / 2, p, seed, index0 + n / 2);
  REQUIRE(halves == out);

  // Another seed, another mask; p = 0 copies.
  std::vector<double> other(n);
  k::dropout_forward(x.data(), other.data(), n, p, seed + 1, index0);
  REQUIRE(other != out);
  k::dropout_forward(x.data(), other.data(), n, 0.0f, seed, index0);
  REQUIRE(other == x);

  // The uniforms: in [0, 1), on a 2^-24 grid, mean about 1/2.
  double mean = 0;
  for (std::uint64_t i = 0; i < 10000; ++i) {
    const float u = k::dropout_uniform(99, i);
    REQUIRE((u >= 0.0f && u < 1.0f));
    REQUIRE(u * 0x1p24f == std::floor(u * 0x1p24f));
    mean += u / 10000;
  }
  REQUIRE(std::abs(mean - 0.5) < 0.01);

  auto loss = [&](const std::vector<double>& xs) {
    std::vector<double> o(200);
    k::dropout_forward(xs.data(), o.data(), 200, p, seed, index0);
    return dot(o, std::vector<double>(W.begin(), W.begin() + 200));
  };
  REQUIRE(fd_error(loss, std::vector<double>(x.begin(), x.begin() + 200),
                   std::vector<double>(dx.begin(), dx.begin() + 200)) < 1e-9);
}

TEMPLATE_TEST_CASE("dropout in float, bf16 and fp16 keeps the double mask", "[kernels][dropout][dtype]", float, bf16,
                   fp16) {
  const std::size_t n = 2000;
  const auto x = rounded<TestType>(random_vector(n, 31, 0.5, 1.5));
  std::vector<double> out(n);
  k::dropout_forward(x.data(), out.data(), n, 0.5f, 5, 0);
  const auto xt = convert<TestType>(x);
  std::vector<TestType> out_t(n);
  k::dropout_forward(xt.data(), out_t.data(), n, 0.5f, 5, 0);
  for (std::size_t i = 0; i < n; ++i) REQUIRE(double(out_t[i]) == out[i]);  // x / 0.5 is exact
}

// torch.optim.AdamW(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1) and torch.optim.SGD(lr=0.1,
// momentum=0.9, weight_decay=0.05), three steps from p0 with grads g[0..2], printed by torch 1.13 in float64 and
// float32.
namespace {

const std::vector<double> p0 = {0.5, -1.25, 2.0, 0.0, 3.0e-3};
const std::vector<std::vector<double>> grads = {
    {0.1, -0.2, 0.3, -0.4, 1e-6}, {-0.05, 0.4, 0.0, 1.5, 2e-6}, {0.2, 0.2, -0.7, 0.01, -3e-6}};
const std::vector<std::vector<double>> torch_adamw_f64 = {
    {0.4895000009999999, -1.2387500005, 1.9880000003333334, 0.009999999750000004, -0.0069039900990099014},
    {0.48634713093933907, -1.2411722856541039, 1.9793114181075822, 0.004525334806657503, -0.01648825558666504},
    {0.4792796683031988, -1.2451235213470124, 1.981166032579985, 0.00025552466792827, -0.015808845032351634}};
const std::vector<std::vector<double>> torch_adamw_f32 = {
    {0.4895000159740448, -1.2387499809265137, 1.9880000352859497, 0.009999999776482582, -0.006903989240527153},
    {0.48634713888168335, -1.2411723136901855, 1.979311466217041, 0.004525335039943457, -0.016488254070281982},
    {0.47927966713905334, -1.2451235055923462, 1.981166124343872, 0.0002555246464908123, -0.015808843076229095}};
const std::vector<std::vector<double>> torch_sgd_f64 = {
    {0.4875, -1.22375, 1.96, 0.04000000000000001, 0.0029849},
    {0.4788125, -1.23400625, 1.9142, -0.07419999999999999, 0.0029561855},
    {0.44859968749999996, -1.2570668437499999, 1.933409, -0.177609, 0.0029158615225}};
const std::vector<std::vector<double>> torch_sgd_f32 = {
    {0.48750001192092896, -1.2237499952316284, 1.9600000381469727, 0.04000000283122063, 0.002984900027513504},
    {0.4788125157356262, -1.2340062856674194, 1.9142000675201416, -0.07419999688863754, 0.0029561854898929596},
    {0.4485996961593628, -1.2570668458938599, 1.9334090948104858, -0.17760899662971497, 0.002915861550718546}};

template <class T>
std::vector<std::vector<double>> run_adamw() {
  auto p = convert<T>(p0);
  std::vector<loom::acc_t<T>> m(p.size(), 0), v(p.size(), 0);
  std::vector<std::vector<double>> out;
  for (int t = 1; t <= 3; ++t) {
    const auto g = convert<T>(grads[t - 1]);
    k::adamw_step(p.data(), g.data(), m.data(), v.data(), p.size(), 1e-2, 0.9, 0.999, 1e-8, 0.1, t);
    out.push_back(to_double(p));
  }
  return out;
}

//! AdamW on T (bf16, fp16) against the formula with T's roundings, step by step and element by element. T holds
//! the parameters and gradients and the kernel computes in float; the reference takes the kernel's parameters
//! before the step and its gradient (both in T), keeps m and v in double from those gradients, computes the step in
//! double and rounds the result to T. The two differ only in the float arithmetic before that one rounding, which
//! can move the result to a neighbour on T's grid and no further: one ulp, at most 2u|ref| for a normal ref (u =
//! 2^-8 for bf16, 2^-11 for fp16); below T's normal range the grid's step is its smallest subnormal, the absolute
//! floor. Each element is held to its own precision: a parameter near 0 (about 3e-4 on the third step) is checked
//! as tightly as one near 2.
template <class T>
void check_adamw_rounding() {
  const double u = unit_roundoff<T>(), floor = static_cast<double>(std::numeric_limits<T>::denorm_min());
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  auto p = convert<T>(p0);
  std::vector<loom::acc_t<T>> m(p.size(), 0), v(p.size(), 0);
  std::vector<double> md(p.size(), 0.0), vd(p.size(), 0.0);
  for (int t = 1; t <= 3; ++t) {
    const auto g = convert<T>(grads[t - 1]);
    const auto before = to_double(p);
    k::adamw_step(p.data(), g.data(), m.data(), v.data(), p.size(), lr, b1, b2, eps, wd, t);
    for (std::size_t i = 0; i < p.size(); ++i) {
      const double gi = static_cast<double>(g[i]);
      md[i] = b1 * md[i] + (1 - b1) * gi;
      vd[i] = b2 * vd[i] + (1 - b2) * gi * gi;
      const double exact = before[i] * (1 - lr * wd) -
                           lr * (md[i] / (1 - std::pow(b1, t))) / (std::sqrt(vd[i] / (1 - std::pow(b2, t))) + eps);
      const double ref = static_cast<double>(static_cast<T>(exact)), got = static_cast<double>(p[i]);
      CAPTURE(t, i, got, ref);
      CHECK(std::abs(got - ref) <= 2 * u * std::abs(ref) + floor);
    }
  }
}

template <class T>
std::vector<std::vector<double>> run_sgd() {
  auto p = convert<T>(p0);
  std::vector<loom::acc_t<T>> buf(p.size(), 12345);  // overwritten on the first step
  std::vector<std::vector<double>> out;
  for (int t = 1; t <= 3; ++t) {
    const auto g = convert<T>(grads[t - 1]);
    k::sgd_step(p.data(), g.data(), buf.data(), p.size(), 0.1, 0.9, 0.05, t == 1);
    out.push_back(to_double(p));
  }
  return out;
}

}  // namespace

TEST_CASE("adamw_step equals the formula and torch.optim.AdamW", "[kernels][optim]") {
  // The formula, step by step in double.
  std::vector<double> p = p0, m(5, 0.0), v(5, 0.0);
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  const auto got = run_adamw<double>();
  for (int t = 1; t <= 3; ++t) {
    for (int i = 0; i < 5; ++i) {
      const double g = grads[t - 1][i];
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      p[i] -= lr * (m[i] / (1 - std::pow(b1, t))) / (std::sqrt(v[i] / (1 - std::pow(b2, t))) + eps);
    }
    CAPTURE(t);
    REQUIRE(rel_err(got[t - 1], p) < 1e-15);
    REQUIRE(rel_err(got[t - 1], torch_adamw_f64[t - 1]) < 1e-15);
  }
  const auto got32 = run_adamw<float>();
  for (int t = 0; t < 3; ++t) REQUIRE(rel_err(got32[t], torch_adamw_f32[t]) < 1e-8);  // within an ulp
  check_adamw_rounding<bf16>();
  check_adamw_rounding<fp16>();
}

TEST_CASE("sgd_step equals the formula and torch.optim.SGD", "[kernels][optim]") {
  std::vector<double> p = p0, buf(5);
  const auto got = run_sgd<double>();
  for (int t = 1; t <= 3; ++t) {
    for (int i = 0; i < 5; ++i) {
      const double g = grads[t - 1][i] + 0.05 * p[i];
      buf[i] = t == 1 ? g : 0.9 * buf[i] + g;
      p[i] -= 0.1 * buf[i];
    }
    REQUIRE(rel_err(got[t - 1], p) < 1e-15);
    REQUIRE(rel_err(got[t - 1], torch_sgd_f64[t - 1]) < 1e-15);
  }
  const auto got32 = run_sgd<float>();
  for (int t = 0; t < 3; ++t) REQUIRE(rel_err(got32[t], torch_sgd_f32[t]) < 2e-7);

  // Without momentum there is no buffer.
  auto q = p0;
  k::sgd_step<double>(q.data(), grads[0].data(), nullptr, q.size(), 0.1, 0.0, 0.0, false);
  for (int i = 0; i < 5; ++i) REQUIRE(q[i] == p0[i] - 0.1 * grads[0][i]);
}

TEST_CASE("SwiGLU: silu(gate) times up, and its backward against finite differences", "[kernels][swiglu][backward]") {
  const int R = 5, F = 7;
  const auto h = random_vector(R * 2 * F, 41, -3.0, 3.0), W = random_vector(R * F, 42);
  std::vector<double> out(R * F);
  k::swiglu_forward(h.data(), out.data(), R, F);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < F; ++c) {
      const double g = h[r * 2 * F + c], u = h[r * 2 * F + F + c];
      REQUIRE(std::abs(out[r * F + c] - g / (1 + std::exp(-g)) * u) <= 1e-15 * (1 + std::abs(g * u)));
    }
  auto loss = [&](const std::vector<double>& x) {
    std::vector<double> o(R * F);
    k::swiglu_forward(x.data(), o.data(), R, F);
    return dot(o, W);
  };
  std::vector<double> dh(R * 2 * F);
  k::swiglu_backward(h.data(), W.data(), dh.data(), R, F);
  REQUIRE(fd_error(loss, h, dh) < 1e-9);
}

TEMPLATE_TEST_CASE("SwiGLU in float, bf16 and fp16 against double", "[kernels][swiglu][dtype]", float, bf16, fp16) {
  const int R = 9, F = 300;
  const auto h = rounded<TestType>(random_vector(R * 2 * F, 43, -3.0, 3.0));
  std::vector<double> out(R * F);
  k::swiglu_forward(h.data(), out.data(), R, F);
  const auto ht = convert<TestType>(h);
  std::vector<TestType> o(R * F);
  k::swiglu_forward(ht.data(), o.data(), R, F);
  REQUIRE(rel_err(o, out) <= 4 * unit_roundoff<TestType>());
}

TEST_CASE("RMS norm: forward by its formula, backward against finite differences", "[kernels][rmsnorm][backward]") {
  const int R = 4, C = 9;
  const double eps = 1e-6;
  const auto x = random_vector(R * C, 51, -2.0, 2.0), w = random_vector(C, 52, 0.5, 1.5), W = random_vector(R * C, 53);
  std::vector<double> out(R * C), rstd(R);
  k::rmsnorm_forward(x.data(), w.data(), out.data(), rstd.data(), R, C, eps);
  for (int r = 0; r < R; ++r) {
    double ms = 0;
    for (int c = 0; c < C; ++c) ms += x[r * C + c] * x[r * C + c] / C;
    REQUIRE(std::abs(rstd[r] - 1 / std::sqrt(ms + eps)) <= 1e-14 * rstd[r]);
    for (int c = 0; c < C; ++c)
      REQUIRE(std::abs(out[r * C + c] - x[r * C + c] / std::sqrt(ms + eps) * w[c]) <= 1e-14);
  }
  auto loss_x = [&](const std::vector<double>& xx) {
    std::vector<double> o(R * C), rs(R);
    k::rmsnorm_forward(xx.data(), w.data(), o.data(), rs.data(), R, C, eps);
    return dot(o, W);
  };
  auto loss_w = [&](const std::vector<double>& ww) {
    std::vector<double> o(R * C), rs(R);
    k::rmsnorm_forward(x.data(), ww.data(), o.data(), rs.data(), R, C, eps);
    return dot(o, W);
  };
  std::vector<double> dx(R * C);
  k::rmsnorm_backward_input(W.data(), x.data(), w.data(), rstd.data(), dx.data(), R, C);
  REQUIRE(fd_error(loss_x, x, dx) < 1e-8);
  const auto dw0 = random_vector(C, 54);
  auto dw = dw0;
  k::rmsnorm_backward_weight(W.data(), x.data(), rstd.data(), dw.data(), R, C);
  for (int c = 0; c < C; ++c) dw[c] -= dw0[c];
  REQUIRE(fd_error(loss_w, w, dw) < 1e-9);
}

TEST_CASE("rotary positions: rotate-half by each position's angle, undone by the inverse", "[kernels][rope]") {
  const int n = 3, heads = 2, hd = 4, ld = 10, t0 = 2, h = hd / 2, positions = t0 + n;
  std::vector<double> cos(positions * h), sin(positions * h);
  for (int t = 0; t < positions; ++t)
    for (int j = 0; j < h; ++j) cos[t * h + j] = std::cos(0.3 * t * (j + 1)), sin[t * h + j] = std::sin(0.3 * t * (j + 1));
  const auto x0 = random_vector(n * ld, 61);
  auto x = x0;
  k::rope_rotate(x.data(), cos.data(), sin.data(), n, ld, heads, hd, t0, false);
  for (int i = 0; i < n; ++i) {
    for (int hh = 0; hh < heads; ++hh)
      for (int j = 0; j < h; ++j) {
        const int a = i * ld + hh * hd + j, b = a + h;
        const double th = 0.3 * (t0 + i) * (j + 1);
        REQUIRE(std::abs(x[a] - (x0[a] * std::cos(th) - x0[b] * std::sin(th))) < 1e-15);
        REQUIRE(std::abs(x[b] - (x0[b] * std::cos(th) + x0[a] * std::sin(th))) < 1e-15);
      }
    for (int c = heads * hd; c < ld; ++c) REQUIRE(x[i * ld + c] == x0[i * ld + c]);  // beyond the heads: untouched
  }
  // The rotation is orthogonal: its backward (the inverse) is its transpose, so <R x, y> = <x, R^-1 y>.
  const auto y0 = random_vector(n * ld, 62);
  auto y = y0;
  k::rope_rotate(y.data(), cos.data(), sin.data(), n, ld, heads, hd, t0, true);
  REQUIRE(std::abs(dot(x, y0) - dot(x0, y)) < 1e-13);
  k::rope_rotate(x.data(), cos.data(), sin.data(), n, ld, heads, hd, t0, true);
  for (int i = 0; i < n * ld; ++i) REQUIRE(std::abs(x[i] - x0[i]) < 1e-15);
}

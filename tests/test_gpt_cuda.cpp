// The GPT on a CUDA device against the same model on the host, for multi-head and grouped-query attention: the same
// seed gives the same parameters bit for bit; the loss and every parameter's gradient agree (the norm of the
// difference over the norm of the host's: float 1e-4, double 1e-10), with and without dropout and recompute, and
// with the split backward; gather and scatter move parameters between the device and the single-rank layout; AdamW
// steps (with gradient clipping) give the host's losses; a bf16 model's loss falls. Without a CUDA device it prints
// "SKIPPED: no CUDA device here" and exits with 77.
#include "catch.hpp"
#include "gpt_batch.hpp"
#include "gpu_skip.hpp"

#include <loom/kernels/cuda/device_ops.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace loom;
using models::Gpt;
using models::GptOptions;
using models::GptShape;

namespace {

constexpr GptShape mha{2, 4, 4, 32, 64, 16};  // head_dim 8
constexpr GptShape gqa{2, 4, 2, 32, 61, 16};  // 4 query heads over 2 key/value heads; an odd vocabulary
// Llama 3's parts: RMSNorm, RoPE with Llama 3's scaling, SwiGLU, no biases, an untied output layer.
constexpr GptShape llama = models::llama3_spec({2, 4, 2, 32, 61, 16, 48}, 10000, {4, 1, 4, 8});

template <GptShape S, class T>
using HostGpt = Gpt<S, T>;
template <GptShape S, class T>
using CudaGpt = Gpt<S, T, Parallel<>, Cuda>;

using test::Batch;
using test::batch;

//! Agreement of float results computed in different orders; double's.
template <class T>
constexpr double tol() {
  return std::is_same_v<T, double> ? 1e-10 : 1e-4;
}

//! The elements of a device tensor, on the host.
template <class T>
std::vector<T> on_host(const Tensor<T, Cuda>& t) {
  const Tensor<T> h = to_host(t);
  return std::vector<T>(h.data(), h.data() + h.numel());
}

template <class T>
double squares(const T* x, std::int64_t n) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return s;
}

//! Each parameter's gradient from the device against the host's: the norm of the difference over the norm of the
//! host's (over a thousandth of the whole gradient's norm for a parameter whose gradient is smaller than that).
template <class T>
void check_grads(const std::vector<models::ParamSpec>& specs, const Tensor<T>& want,
                 const Tensor<T, Cuda>& got_on_device, double tolerance) {
  const auto got = on_host(got_on_device);
  REQUIRE(static_cast<std::int64_t>(got.size()) == want.numel());
  const double total = std::sqrt(squares(want.data(), want.numel()));
  REQUIRE(total > 0);
  for (const auto& s : specs) {
    const std::int64_t n = numel_of(s.shape);
    double diff = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const double d = static_cast<double>(got[s.offset + i]) - static_cast<double>(want.data()[s.offset + i]);
      diff += d * d;
    }
    const double norm = std::sqrt(squares(want.data() + s.offset, n));
    const double rel = std::sqrt(diff) / std::max(norm, 1e-3 * total);
    INFO(s.name << ": |device - host| / |host| = " << rel << " (|host| = " << norm << ")");
    CHECK(rel <= tolerance);
  }
}

bool near(double got, double want, double tolerance) { return std::abs(got - want) <= tolerance * std::abs(want); }

//! One step's loss and gradients on both devices: a batch, then a second micro-batch of another length that
//! accumulates at half weight.
template <GptShape S, class T>
void compare_gradients(GptOptions o) {
  HostGpt<S, T> h(42, o);
  GptOptions fused = o;  // the device's loss leaves its gradient in the logits at forward, as in training
  fused.loss_gradient_in_forward = true;
  CudaGpt<S, T> d(42, fused);
  const int B = 2, T1 = S.max_seq - 3;  // off the attention kernels' tile sizes
  const auto b = batch(B, T1, S.vocab);
  h.zero_grad();
  d.zero_grad();
  const double lh = h.forward(b.ids.data(), b.targets.data(), B, T1, 3);
  const double ld = d.forward(b.ids.data(), b.targets.data(), B, T1, 3);
  INFO("loss: host " << lh << " device " << ld);
  CHECK(near(ld, lh, tol<T>()));
  h.backward();
  d.backward();
  const auto b2 = batch(1, S.max_seq, S.vocab, 5);
  const double lh2 = h.forward(b2.ids.data(), b2.targets.data(), 1, S.max_seq, 4, 2);
  const double ld2 = d.forward(b2.ids.data(), b2.targets.data(), 1, S.max_seq, 4, 2);
  CHECK(near(ld2, lh2, tol<T>()));
  h.backward(0.5);
  d.backward(0.5);
  check_grads(h.specs(), h.grads(), d.grads(), tol<T>());
  const double nh = h.grad_norm(), nd = d.grad_norm();
  INFO("gradient norm: host " << nh << " device " << nd);
  CHECK(nh > 0);
  CHECK(near(nd, nh, tol<T>()));
}

}  // namespace

TEMPLATE_TEST_CASE_SIG("the same seed gives the device the host's parameters", "[gpt][cuda]",
                       ((GptShape S, class T), S, T), (mha, float), (gqa, float), (mha, bf16), (gqa, double)) {
  HostGpt<S, T> h(7);
  CudaGpt<S, T> d(7);
  REQUIRE(d.specs().size() == h.specs().size());
  const auto p = on_host(d.params());
  REQUIRE(static_cast<std::int64_t>(p.size()) == h.params().numel());
  CHECK(std::memcmp(p.data(), h.params().data(), p.size() * sizeof(T)) == 0);
  const auto g = on_host(d.grads());
  CHECK(std::all_of(g.begin(), g.end(), [](T x) { return static_cast<double>(x) == 0.0; }));
  // Another seed, another model.
  CudaGpt<S, T> other(8);
  CHECK(std::memcmp(on_host(other.params()).data(), p.data(), p.size() * sizeof(T)) != 0);
}

TEMPLATE_TEST_CASE_SIG("the loss and every gradient on the device match the host's", "[gpt][cuda]",
                       ((GptShape S, class T), S, T), (mha, float), (gqa, float), (mha, double), (gqa, double),
                       (llama, float), (llama, double)) {
  GptOptions o;
  o.dropout = GENERATE(0.0f, 0.1f);
  o.recompute = GENERATE(models::Recompute::none, models::Recompute::selective, models::Recompute::full);
  INFO("dropout " << o.dropout << ", recompute " << models::describe_recompute(o.recompute));
  compare_gradients<S, T>(o);
}

TEST_CASE("the split backward on the device gives the host's gradients", "[gpt][cuda]") {
  GptOptions o;
  o.dropout = 0.1f;
  HostGpt<gqa, float> h(3, o);
  CudaGpt<gqa, float> d(3, o);
  const int B = 2, T = gqa.max_seq;
  const auto b = batch(B, T, gqa.vocab, 1);
  h.zero_grad();
  d.zero_grad();
  const double lh = h.forward(b.ids.data(), b.targets.data(), B, T, 2);
  h.backward();
  const double ld = d.forward(0, {b.ids.data(), b.targets.data(), B, T, 2, 0});
  CHECK(near(ld, lh, tol<float>()));
  d.backward_inputs(0, 1.0);
  d.backward_weights(0);
  check_grads(h.specs(), h.grads(), d.grads(), tol<float>());
}

TEST_CASE("gather and scatter move a device model's parameters to and from the single-rank layout", "[gpt][cuda]") {
  HostGpt<gqa, float> h(5);
  CudaGpt<gqa, float> d(5);
  const std::vector<float> whole = d.gather(d.params().data());
  CHECK(whole == h.gather(h.params().data()));
  std::vector<float> changed = whole;
  for (auto& x : changed) x = 2 * x + 1;
  d.scatter(changed.data(), d.params().data());
  CHECK(on_host(d.params()) == changed);
  CHECK(d.gather(d.params().data()) == changed);
}

TEMPLATE_TEST_CASE_SIG("AdamW steps on the device give the host's losses", "[gpt][cuda][optim]",
                       ((GptShape S, class T), S, T), (mha, float), (gqa, float), (gqa, double), (llama, double)) {
  GptOptions o;
  o.dropout = GENERATE(0.0f, 0.1f);
  HostGpt<S, T> h(11, o);
  CudaGpt<S, T> d(11, o);
  optim::AdamW<T> opt_h(h.specs(), h.params().numel());
  optim::AdamW<T, Cuda> opt_d(d.specs(), d.params().numel(), {}, d.ops());
  const int B = 2, T_ = S.max_seq;
  for (int step = 0; step < 5; ++step) {
    const auto b = batch(B, T_, S.vocab, step);
    h.zero_grad();
    d.zero_grad();
    const double lh = h.forward(b.ids.data(), b.targets.data(), B, T_, step);
    const double ld = d.forward(b.ids.data(), b.targets.data(), B, T_, step);
    INFO("step " << step << ", dropout " << o.dropout << ": loss host " << lh << " device " << ld);
    CHECK(near(ld, lh, tol<T>()));
    h.backward();
    d.backward();
    // Clipped well below the gradients' norm, so that both devices scale them.
    const double nh = optim::clip_grad_norm(h.grads(), 0.01), nd = optim::clip_grad_norm(d.grads(), 0.01, d.ops());
    CHECK(nh > 0.01);
    CHECK(near(nd, nh, tol<T>()));
    CHECK(near(optim::grad_norm(d.grads(), d.ops()), optim::grad_norm(h.grads()), tol<T>()));
    opt_h.step(h.params(), h.grads(), 1e-3);
    opt_d.step(d.params(), d.grads(), 1e-3);
  }
  CHECK(opt_d.steps() == 5);
  const double moment_h = std::sqrt(squares(opt_h.second_moment().data(), opt_h.second_moment().numel()));
  const auto v = on_host(opt_d.second_moment());
  CHECK(near(std::sqrt(squares(v.data(), static_cast<std::int64_t>(v.size()))), moment_h, 1e3 * tol<T>()));
}

TEST_CASE("a bf16 model on the device lowers its loss", "[gpt][cuda][train]") {
  constexpr GptShape s{2, 4, 4, 64, 64, 32};  // head_dim 16: the tensor-core attention path
  CudaGpt<s, bf16> m(1);
  optim::AdamW<bf16, Cuda> opt(m.specs(), m.params().numel(), {0.9, 0.999, 1e-8, 0.0});
  const int B = 4, T = s.max_seq;
  const auto b = batch(B, T, s.vocab);  // the same batch every step: a table of next tokens to learn
  std::vector<double> losses;
  for (int step = 0; step < 20; ++step) {
    m.zero_grad();
    losses.push_back(m.forward(b.ids.data(), b.targets.data(), B, T, step));
    m.backward();
    optim::clip_grad_norm(m.grads(), 1.0, m.ops());
    opt.step(m.params(), m.grads(), 1e-2);
  }
  INFO("first " << losses.front() << " last " << losses.back());
  for (double l : losses) REQUIRE(std::isfinite(l));
  CHECK(losses.front() == Approx(std::log(64.0)).epsilon(0.05));
  CHECK(losses.back() < 0.5 * losses.front());
}

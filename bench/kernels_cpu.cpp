// CPU kernel micro-benchmark: the best time of each kernel of a GPT-2 (124M) layer at a training step's shapes,
// as GFLOP/s for products and attention, GB/s of memory touched for the rest.
//
//   kernels_cpu [--tokens 1024] [--reps 5] [--json FILE]
#include <loom/kernels/cpu/ops.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

namespace k = loom::kernels::cpu;
using loom::bf16;

struct Row {
  std::string kernel, dtype, shape;
  double time_ms, rate;
  std::string unit;
};

void to_json(nlohmann::json& j, const Row& r) {
  j = {{"kernel", r.kernel}, {"dtype", r.dtype}, {"shape", r.shape}, {"time_ms", r.time_ms}, {"rate", r.rate},
       {"unit", r.unit}};
}

double best_time(const std::function<void()>& f, int reps) {
  f();  // warm-up: page faults, caches
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

template <class T>
std::vector<T> random(std::size_t n, float lo = -1, float hi = 1) {
  std::mt19937 gen(42);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = T(d(gen));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int N = 1024, reps = 5;  // N tokens: batch 4 x 256
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 < argc && a == "--tokens") N = std::stoi(argv[++i]);
    else if (i + 1 < argc && a == "--reps") reps = std::stoi(argv[++i]);
    else if (i + 1 < argc && a == "--json") json = argv[++i];
    else {
      const bool help = a == "-h" || a == "--help";
      std::fprintf(help ? stdout : stderr, "usage: kernels_cpu [--tokens 1024] [--reps 5] [--json FILE]\n");
      return help ? 0 : 2;
    }
  }
  N = std::max(N, 1);
  const int C = 768, H = 12, D = 64, T = std::min(N, 256), B = N / T, V = 50257;  // attention: B x T <= N
  std::vector<Row> rows;
  auto add = [&](std::string kernel, std::string dtype, std::string shape, double t, double work, std::string unit) {
    rows.push_back({std::move(kernel), std::move(dtype), std::move(shape), t * 1e3, work / t / 1e9, std::move(unit)});
    const Row& r = rows.back();
    std::printf("%-22s %-5s %-22s %10.3f %10.1f %s\n", r.kernel.c_str(), r.dtype.c_str(), r.shape.c_str(), r.time_ms,
                r.rate, r.unit.c_str());
    std::fflush(stdout);
  };
  std::printf("%-22s %-5s %-22s %10s %10s\n", "kernel", "dtype", "shape", "time_ms", "rate");

  // The MLP's first product, forward and its two gradients: x W^T with W stored out x in, as torch.nn.Linear.
  auto matmuls = [&](auto tag, const char* name) {
    using T_ = typename decltype(tag)::type;
    const int M = N, Nout = 4 * C, K = C;
    const auto x = random<T_>(std::size_t(M) * K), w = random<T_>(std::size_t(Nout) * K);
    auto y = random<T_>(std::size_t(M) * Nout), dx = random<T_>(std::size_t(M) * K), dw = w;
    const double flops = 2.0 * M * Nout * K;
    const std::string shape = std::to_string(M) + "x" + std::to_string(Nout) + "x" + std::to_string(K);
    auto gemm = [&](const char* kernel, auto&& f) { add(kernel, name, shape, best_time(f, reps), flops, "GFLOP/s"); };
    gemm("matmul x W^T", [&] { k::matmul(x.data(), w.data(), y.data(), M, Nout, K, false, true); });
    gemm("matmul dy W", [&] { k::matmul(y.data(), w.data(), dx.data(), M, K, Nout, false, false); });
    gemm("matmul dW += dy^T x", [&] { k::matmul(y.data(), x.data(), dw.data(), Nout, K, M, true, false, 1.0f, 1.0f); });
  };
  matmuls(loom::type_tag<float>{}, "f32");
  matmuls(loom::type_tag<bf16>{}, "bf16");

  {
    const std::ptrdiff_t ld = 3 * C;
    const k::AttentionShape s{B, T, H, H, D, ld, ld, C, 0.125f};
    const auto qkv = random<float>(std::size_t(B) * T * ld), dout = random<float>(std::size_t(B) * T * C);
    std::vector<float> out(std::size_t(B) * T * C), lse(std::size_t(B) * H * T), dqkv(qkv.size());
    const double flops = 4.0 * B * H * D * (double(T) * (T + 1) / 2);  // causal: QK^T and PV over half the pairs
    const std::string shape = "B" + std::to_string(B) + " T" + std::to_string(T) + " H12 D64";
    const float* q = qkv.data();
    add("attention forward", "f32", shape,
        best_time([&] { k::attention_forward(q, q + C, q + 2 * C, out.data(), lse.data(), s); }, reps), flops,
        "GFLOP/s");
    float* dq = dqkv.data();
    add("attention backward", "f32", shape, best_time([&] {
          k::attention_backward(dout.data(), q, q + C, q + 2 * C, out.data(), lse.data(), dq, dq + C, dq + 2 * C, s);
        }, reps),
        2.5 * flops, "GFLOP/s");  // QK^T, dP, dV, dQ, dK: five products where forward has two
  }
  {
    const auto x = random<float>(std::size_t(N) * C), w = random<float>(C), b = random<float>(C);
    std::vector<float> out(x.size()), dx(x.size()), mean(N), rstd(N), dw(C), db(C);
    const double bytes = 4.0 * N * C;
    const std::string shape = std::to_string(N) + "x" + std::to_string(C);
    add("layernorm forward", "f32", shape, best_time([&] {
          k::layernorm_forward(x.data(), w.data(), b.data(), out.data(), mean.data(), rstd.data(), N, C);
        }, reps),
        2 * bytes, "GB/s");
    add("layernorm bwd input", "f32", shape, best_time([&] {
          k::layernorm_backward_input(out.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(), N, C);
        }, reps),
        3 * bytes, "GB/s");
    add("layernorm bwd weight", "f32", shape, best_time([&] {
          k::layernorm_backward_weight(out.data(), x.data(), mean.data(), rstd.data(), dw.data(), db.data(), N, C);
        }, reps),
        2 * bytes, "GB/s");
  }
  {
    const std::size_t n = std::size_t(N) * 4 * C;
    const auto x = random<float>(n, -4, 4);
    std::vector<float> y(n), dx(n);
    const std::string shape = std::to_string(N) + "x" + std::to_string(4 * C);
    add("gelu forward", "f32", shape, best_time([&] { k::gelu_forward(x.data(), y.data(), n); }, reps), 8.0 * n,
        "GB/s");
    add("gelu backward", "f32", shape, best_time([&] { k::gelu_backward(x.data(), y.data(), dx.data(), n); }, reps),
        12.0 * n, "GB/s");
    add("dropout forward", "f32", shape,
        best_time([&] { k::dropout_forward(x.data(), y.data(), n, 0.1f, 1, 0); }, reps), 8.0 * n, "GB/s");
  }
  {
    const int R = std::min(N, 256);  // the logits of 256 tokens: 51 MB
    const auto logits = random<float>(std::size_t(R) * V, -5, 5);
    std::vector<std::int32_t> targets(R);
    for (int r = 0; r < R; ++r) targets[r] = (r * 7919) % V;
    std::vector<float> losses(R), mx(R), se(R), dloss(R, 1.0f / R), dlogits(logits.size());
    const std::string shape = std::to_string(R) + "x" + std::to_string(V);
    add("cross-entropy forward", "f32", shape, best_time([&] {
          k::cross_entropy_forward(logits.data(), targets.data(), losses.data(), mx.data(), se.data(), R, V);
        }, reps),
        4.0 * R * V, "GB/s");
    add("cross-entropy backward", "f32", shape, best_time([&] {
          k::ce_backward(logits.data(), targets.data(), mx.data(), se.data(), dloss.data(), dlogits.data(), R, V, 0);
        }, reps),
        8.0 * R * V, "GB/s");
  }
  {
    const std::size_t n = 124'000'000 / 8;  // an eighth of GPT-2's parameters
    auto p = random<float>(n);
    const auto g = random<float>(n);
    std::vector<float> m(n), v(n);
    int t = 0;
    add("adamw", "f32", std::to_string(n), best_time([&] {
          k::adamw_step(p.data(), g.data(), m.data(), v.data(), n, 6e-4, 0.9, 0.95, 1e-8, 0.1, ++t);
        }, reps),
        28.0 * n, "GB/s");  // reads p, g, m, v; writes p, m, v
  }

  if (!json.empty()) {
    std::ofstream f(json);
    for (const auto& r : rows) f << nlohmann::json(r).dump() << "\n";
    if (!f) {
      std::fprintf(stderr, "loom: cannot write %s\n", json.c_str());
      return 1;
    }
  }
  return 0;
}

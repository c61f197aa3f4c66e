// loom-plan --calibrate: this machine measured into a cluster description. The rates of the classes the planner's
// roofline uses (matrix products, attention, memory-bound element-wise work) with loom's own CPU kernels, at one
// thread and at every hardware thread, the fixed cost of one small operation, and the latency and bandwidth of an
// all-reduce between two ranks as threads (the Local backend) and, in a build with MPI, as two processes (the Mpi
// backend, this program relaunched under mpirun).
#include "loom_plan_calibrate.hpp"

#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/core/error.hpp>
#include <loom/core/threads.hpp>
#include <loom/kernels/ops.hpp>

#ifdef LOOM_HAS_MPI
#include <loom/comm/mpi.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <span>
#include <thread>
#include <vector>

#include <unistd.h>

namespace loom_plan {

namespace {

using Clock = std::chrono::steady_clock;

//! The fastest of `repeats` timings of fn, seconds: the machine's rate without the noise of other work.
template <class F>
double best_of(int repeats, F&& fn) {
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

//! What one class of work reaches with `threads` threads: FLOP/s, or bytes/s for element-wise work.
struct Rates {
  double matmul = 0, attention = 0, memory = 0;
};

//! A training step's shapes at the scale train_gpt's small models run on this machine: a block's matrix products,
//! causal attention over 4 sequences of 128 with 8 heads of 32, and a block's element-wise kernels over 1024 rows.
template <class T>
Rates measure(int threads) {
  loom::use_threads(threads);
  const loom::kernels::Ops<loom::Host> ops;
  Rates r;
  {
    // A block's four products (q|k|v, the attention's output, the MLP's up and down: d 256 to 768, 256, 1024 and
    // 1024 to 256) over 1024 rows, each as forward (x W), backward's input gradient (dy W^T) and weight gradient
    // (x^T dy) run it.
    const int M = 1024;
    std::vector<T> a(std::size_t(M) * 1024, T(0.5)), b(std::size_t(1024) * 1024, T(0.25)), c(a.size());
    double flops = 0, secs = 0;
    for (auto [K, N] : {std::pair{256, 768}, {256, 256}, {256, 1024}, {1024, 256}}) {
      secs += best_of(6, [&] { ops.matmul(a.data(), b.data(), c.data(), M, N, K, false, false); });
      secs += best_of(6, [&] { ops.matmul(c.data(), b.data(), a.data(), M, K, N, false, true); });
      secs += best_of(6, [&] { ops.matmul(a.data(), c.data(), b.data(), K, N, M, true, false); });
      flops += 3 * 2.0 * M * N * K;
    }
    r.matmul = flops / secs;
  }
  {
    // Forward and backward, against what the planner charges for them: the forward's FLOPs (causal: half the
    // square) and 2.5 times those for backward.
    const int B = 4, Tq = 128, H = 8, D = 32;
    const std::ptrdiff_t ld = std::ptrdiff_t(H) * D;
    std::vector<T> q(std::size_t(B) * Tq * ld, T(0.01)), o(q.size()), dq(q.size()), dk(q.size()), dv(q.size());
    std::vector<loom::acc_t<T>> lse(std::size_t(B) * H * Tq);
    const loom::kernels::AttentionShape s{B, Tq, H, H, D, ld, ld, ld, 1.0 / 32};
    const double secs = best_of(6, [&] {
      ops.attention_forward(q.data(), q.data(), q.data(), o.data(), lse.data(), s);
      ops.attention_backward(o.data(), q.data(), q.data(), q.data(), o.data(), lse.data(), dq.data(), dk.data(),
                             dv.data(), s);
    });
    r.attention = 3.5 * 4.0 * B * H * Tq * (Tq / 2.0) * D / secs;
  }
  {
    // A block's element-wise work as the planner counts it: ten passes over its rows of d (two norms, two residual
    // additions, the biases of the attention's products) and two over the MLP's 4d (its bias and GELU), timed as
    // the kernels that do it, 1024 rows of 256: bytes the planner charges over the time the kernels take.
    const int R = 1024, d = 256, f = 4 * d;
    std::vector<T> x(std::size_t(R) * f, T(0.5)), y(x.size()), w(f, T(1)), b(f, T(0));
    std::vector<loom::acc_t<T>> mean(R), rstd(R);
    const std::size_t n = std::size_t(R) * d;
    const double secs = best_of(6, [&] {
      for (int i = 0; i < 2; ++i) {
        ops.layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), R, d, 1e-5);
        ops.add(x.data(), y.data(), y.data(), n);
      }
      ops.bias_add(x.data(), b.data(), y.data(), R, 3 * d);
      ops.bias_add(x.data(), b.data(), y.data(), R, d);
      ops.bias_add(x.data(), b.data(), y.data(), R, f);
      ops.gelu_forward(y.data(), x.data(), std::size_t(R) * f);
      ops.bias_add(x.data(), b.data(), y.data(), R, d);
    });
    r.memory = (10.0 * double(n) + 2.0 * R * f) * sizeof(T) / secs;
  }
  return r;
}

//! One thread's rates while `n` threads measure at once, each its own data: the slowest thread's.
template <class T>
Rates side_by_side(int n) {
  std::vector<Rates> each(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) threads.emplace_back([&, i] { each[std::size_t(i)] = measure<T>(1); });
  for (auto& t : threads) t.join();
  Rates r = each.front();
  for (const Rates& e : each)
    r.matmul = std::min(r.matmul, e.matmul), r.attention = std::min(r.attention, e.attention),
    r.memory = std::min(r.memory, e.memory);
  return r;
}

//! One thread's rate on a product of 1024 x 1024 x 1024, FLOP/s.
template <class T>
double peak_rate() {
  loom::use_threads(1);
  const loom::kernels::Ops<loom::Host> ops;
  const int n = 1024;
  std::vector<T> a(std::size_t(n) * n, T(0.5)), c(a.size());
  return 2.0 * n * n * n / best_of(3, [&] { ops.matmul(a.data(), a.data(), c.data(), n, n, n, false, false); });
}

//! The fixed cost of one operation: a product of 8 x 8 x 8, repeated.
double launch_cost() {
  loom::use_threads(1);
  const loom::kernels::Ops<loom::Host> ops;
  std::vector<float> a(64, 1.0f), c(64);
  const int n = 2000;
  return best_of(5, [&] {
           for (int i = 0; i < n; ++i) ops.matmul(a.data(), a.data(), c.data(), 8, 8, 8, false, false);
         }) /
         n;
}

//! One rank's timing of all-reduces over comm: of `n` all-reduces of `count` floats in a row, the average, the
//! best of five such rows (every rank times the same rows, after a barrier).
template <class Comm>
double all_reduce_seconds(Comm& comm, std::size_t count, int n) {
  std::vector<float> v(count, 1.0f);
  comm.all_reduce(std::span<float>(v), loom::comm::Reduce::sum);  // warm
  double best = 1e30;
  for (int row = 0; row < 5; ++row) {
    comm.barrier();
    const auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) comm.all_reduce(std::span<float>(v), loom::comm::Reduce::sum);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / n);
  }
  return best;
}

//! A link from an all-reduce of 4 bytes (its latency: two steps of a ring of two) and of 16 MiB (its bandwidth: the
//! ring of two sends and receives half the array twice, S bytes in all, per rank).
template <class Comm>
loom::plan::Link measure_link(Comm& comm) {
  const double small = all_reduce_seconds(comm, 1, 100);
  const std::size_t big = std::size_t(1) << 22;
  const double large = all_reduce_seconds(comm, big, 4);
  return {double(big) * sizeof(float) / std::max(large - small, 1e-9), small / 2};
}

}  // namespace

loom::plan::Cluster calibrate(const char* self, std::FILE* log) {
  using loom::plan::Cluster;
  const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
  Cluster c = *loom::plan::cluster_named("cpu");
  c.name = "calibrated";
  c.devices_per_node = hw, c.shared_threads = hw;
  // A device's rates are one thread's while every thread of the host runs a rank (they share its caches and
  // memory): `hw` threads measure at once and the slowest counts. A rank alone uses every thread.
  const Rates one = side_by_side<float>(hw), all = measure<float>(hw);
  const Rates one64 = side_by_side<double>(hw);
  // The peaks MFU is measured against, per device (one hardware thread): its products' rate on a square of 1024
  // (bf16 is computed in f32 on the host).
  const double peak32 = peak_rate<float>(), peak64 = peak_rate<double>();
  c.peak_flops = {peak64, peak32, peak32};
  // Each: a thread's, while the others measure too; then one thread alone with all of them.
  std::fprintf(log, "loom-plan: calibrate: f32 products %.2f GFLOP/s a thread, %.2f on %d; f64 %.2f a thread\n",
               one.matmul / 1e9, all.matmul / 1e9, hw, one64.matmul / 1e9);
  std::fprintf(log, "loom-plan: calibrate: attention %.2f GFLOP/s a thread, %.2f on %d\n", one.attention / 1e9,
               all.attention / 1e9, hw);
  std::fprintf(log, "loom-plan: calibrate: element-wise %.2f GB/s (as counted) a thread, %.2f on %d\n",
               one.memory / 1e9, all.memory / 1e9, hw);
  std::fprintf(log, "loom-plan: calibrate: peak (a product of 1024^3) %.2f GFLOP/s f32, %.2f f64 on 1 thread\n",
               peak32 / 1e9, peak64 / 1e9);
  // Efficiencies against the f32 peak at a step's shapes; f64's products are taken at f32's efficiency (the planner
  // has one per class), so f64's peak becomes what makes them come out as measured.
  c.matmul_efficiency = one.matmul / c.peak_flops[1];
  c.peak_flops[0] = one64.matmul / c.matmul_efficiency;
  c.attention_efficiency = one.attention / c.peak_flops[1];
  c.memory_bandwidth = one.memory, c.memory_efficiency = 1.0;
  c.speedup = {all.matmul / one.matmul, all.attention / one.attention, all.memory / one.memory};
  c.launch = launch_cost();
  std::fprintf(log, "loom-plan: calibrate: %.2f us per small operation\n", c.launch * 1e6);
  loom::plan::Link threads;
  loom::run_local<loom::Parallel<loom::DP<2>>>([&](auto& ctx) {
    const loom::plan::Link l = measure_link(ctx.world());
    if (ctx.rank() == 0) threads = l;
  });
  c.intra = threads, c.inter = threads, c.collective_base = 0;
  // Four ranks a thread: an all-reduce of 4 bytes over a ring of 4 * hw ranks takes 2(n - 1) steps.
  double oversubscribed = 0;
  auto over = [&](auto& ctx) {
    const double t = all_reduce_seconds(ctx.world(), 1, 50);
    if (ctx.rank() == 0) oversubscribed = t / (2.0 * (ctx.world().size() - 1));
  };
  if (hw <= 2) loom::run_local<loom::Parallel<loom::DP<8>>>(over);
  else if (hw <= 4) loom::run_local<loom::Parallel<loom::DP<16>>>(over);
  else loom::run_local<loom::Parallel<loom::DP<32>>>(over);
  c.oversubscribed_latency = oversubscribed;
  std::fprintf(log, "loom-plan: calibrate: threads, 4 ranks a hardware thread: %.2f us a step\n",
               oversubscribed * 1e6);
  std::fprintf(log, "loom-plan: calibrate: threads: all-reduce latency %.2f us a step, %.2f GB/s\n",
               threads.latency * 1e6, threads.bandwidth / 1e9);
#ifdef LOOM_HAS_MPI
  // Two processes under mpirun: this program again, which writes its link to a file.
  const std::string part = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/loom-plan-mpi-" +
                           std::to_string(::getpid()) + ".txt";
  const std::string cmd = loom::detail::cat("mpirun --oversubscribe --bind-to none -np 2 '", self,
                                            "' --calibrate-mpi '", part, "' > /dev/null 2>&1");
  if (std::system(cmd.c_str()) == 0) {
    std::ifstream in(part);
    loom::plan::Link m;
    if (in >> m.bandwidth >> m.latency) {
      c.inter = m;
      std::fprintf(log, "loom-plan: calibrate: processes (MPI): all-reduce latency %.2f us a step, %.2f GB/s\n",
                   m.latency * 1e6, m.bandwidth / 1e9);
    }
  } else {
    std::fprintf(log, "loom-plan: calibrate: '%s' failed; processes are described as threads\n", cmd.c_str());
  }
  std::remove(part.c_str());
#else
  (void)self;
#endif
  c.overlap_efficiency = 0;  // ranks share the cores: a collective takes time from computation
  loom::use_threads(loom::threads_per_rank(1));
  return c;
}

int calibrate_mpi_child(int& argc, char**& argv, const std::string& out) {
#ifdef LOOM_HAS_MPI
  return loom::run_mpi<loom::Parallel<loom::DP<2>>>(argc, argv, [&](auto& ctx) {
    const loom::plan::Link l = measure_link(ctx.world());
    if (ctx.rank() == 0) {
      const std::string tmp = out + ".tmp";
      std::ofstream(tmp) << l.bandwidth << ' ' << l.latency << '\n';
      std::rename(tmp.c_str(), out.c_str());
    }
  });
#else
  (void)argc, (void)argv, (void)out;
  return 1;
#endif
}

}  // namespace loom_plan

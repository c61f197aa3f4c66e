// What bench/ddp.cpp (CPU ranks, and the driver) and bench/ddp_cuda.cpp (ranks sharing a CUDA device) share: the
// options, one row, and the measurement of one layout.
#pragma once

#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/train/data_parallel.hpp>


#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

namespace ddp_bench {

using namespace loom;
using Clock = std::chrono::steady_clock;

struct DdpOptions {
  std::string model = "small", device = "cpu", dtype = "f32";
  std::vector<int> dp{2, 4};
  int batch = 8, seq = 128, steps = 5;
  double bucket_mb = 1;
  std::string json;
};

struct Row {
  std::string model, device, dtype;
  int dp, batch, seq, buckets;
  double compute_ms, comm_ms, serial_ms, overlap_ms, exposed;
};

//! The model's gradients, in double on the host.
template <class Model>
std::vector<double> grads_of(const Model& m) {
  const auto& g = m.grads();
  std::vector<double> out(static_cast<std::size_t>(g.numel()));
  if constexpr (kernels::is_host_v<typename std::remove_cvref_t<decltype(g)>::device>) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(g.data()[i]);
  } else {
    const auto h = to_host(g);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(h.data()[i]);
  }
  return out;
}

//! N ranks of a GPT of shape S in T on Dev (threads of this process; on a GPU they share it): compute alone, the
//! buckets' reduction alone, and the step with the reduction after backward and overlapped with it.
template <models::GptShape S, int N, class T = float, class Dev = Host>
Row measure(const DdpOptions& o) {
  using Model = models::Gpt<S, T, Parallel<>, Dev>;
  Row row{o.model, o.device, o.dtype, N, o.batch, std::min(o.seq, S.max_seq), 0, 0, 0, 0, 0, 0};
  const int seq = row.seq, rows = o.batch / N;
  LOOM_CHECK(rows >= 1 && o.batch % N == 0, "--batch ", o.batch, " must be a multiple of dp ", N);
  run_local<Parallel<DP<N>>>([&](auto& ctx) {
    Model m(1);
    auto& dp = ctx.template comm<Axis::dp>();
    const auto bucket_bytes = static_cast<std::size_t>(o.bucket_mb * (1 << 20));
    train::DataParallel<Model, std::remove_reference_t<decltype(dp)>> on(m, dp, bucket_bytes, true),
        off(m, dp, bucket_bytes, false);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(rows) * seq), tg(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i)
      ids[i] = static_cast<std::int32_t>((i * 13 + ctx.rank()) % S.vocab), tg[i] = ids[(i + 1) % ids.size()];
    auto timed = [&](auto&& body) {
      std::vector<double> t;
      for (int i = 0; i < o.steps + 1; ++i) {
        dp.barrier();
        const auto t0 = Clock::now();
        body();
        m.ops().synchronize();
        dp.barrier();
        if (i > 0) t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
      std::sort(t.begin(), t.end());
      return t[t.size() / 2];
    };
    auto fwd = [&] {
      m.zero_grad();
      m.forward(ids.data(), tg.data(), rows, seq);
    };
    const double compute = timed([&] { fwd(), m.backward(); });
    const double comm = timed([&] {
      for (const auto& b : on.buckets())
        dp.all_reduce(std::span<T>(m.grads().data() + b.lo, static_cast<std::size_t>(b.hi - b.lo)),
                      comm::Reduce::avg);
    });
    const double serial = timed([&] { fwd(), off.backward(0, 1.0); });
    const std::vector<double> averaged = grads_of(m);
    const double overlap = timed([&] { fwd(), on.backward(0, 1.0); });
    // The overlapped averages are the serial ones: the same buckets, each reduced alike once its gradients are
    // written (a copy or a collective that read a bucket before backward wrote it would differ by a gradient).
    // Bucket by bucket: a small-valued bucket (a norm's, a bias's) read before it was written is caught too.
    const std::vector<double> overlapped = grads_of(m);
    for (const auto& b : on.buckets()) {
      double largest = 0, worst = 0;
      auto at = b.lo;
      for (auto i = b.lo; i < b.hi; ++i) {
        const auto u = static_cast<std::size_t>(i);
        largest = std::max(largest, std::abs(averaged[u]));
        if (std::abs(overlapped[u] - averaged[u]) > worst) worst = std::abs(overlapped[u] - averaged[u]), at = i;
      }
      const auto u = static_cast<std::size_t>(at);
      LOOM_CHECK(worst <= 1e-2 * largest, "rank ", ctx.rank(), ": the overlapped average of gradient ", at, " is ",
                 overlapped[u], ", the serial one ", averaged[u], " (the largest of its bucket, [", b.lo, ", ", b.hi,
                 "), is ", largest, ")");
    }
    if (ctx.rank() == 0) {
      row.buckets = static_cast<int>(on.buckets().size());
      row.compute_ms = compute, row.comm_ms = comm, row.serial_ms = serial, row.overlap_ms = overlap;
      row.exposed = (overlap - compute) / comm;
    }
  });
  return row;
}

//! The rows of ranks sharing a CUDA device (bench/ddp_cuda.cpp); throws where loom was built without CUDA.
std::vector<Row> measure_cuda(const DdpOptions& o);

}  // namespace ddp_bench

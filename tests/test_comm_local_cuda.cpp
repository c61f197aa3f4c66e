// The Local backend on device memory: rank threads sharing one GPU pass device buffers to every collective and to
// point-to-point exchanges, and get the serial reference's results (the inputs of comm_cases.hpp are small
// integers, so every algorithm's order of operations gives exact results). Ranks that mix host and device memory
// in one collective are told so. Without a CUDA device it prints "SKIPPED: no CUDA device here" and exits with 77.
#include "catch.hpp"
#include "gpu_skip.hpp"

#include <loom/comm/local_cuda.hpp>
#include <loom/kernels/cuda/check.cuh>

#include <cuda_runtime.h>

#include "comm_cases.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

using namespace loom;
using comm::Algorithm;
using comm::Reduce;

namespace {

//! A device copy of a host vector, and back.
template <class T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& h) : n_(h.size()) {
    LOOM_CUDA(cudaMalloc(&p_, std::max<std::size_t>(1, n_) * sizeof(T)));
    if (n_) LOOM_CUDA(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  DeviceVector(const DeviceVector&) = delete;
  ~DeviceVector() { cudaFree(p_); }
  std::span<T> span() { return {p_, n_}; }
  std::vector<T> host() const {
    std::vector<T> h(n_);
    if (n_) LOOM_CUDA(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

template <class T, class Comm>
void expect_values(Comm& c, const char* what, const std::vector<T>& got, const std::vector<T>& want) {
  test::expect(got.size() == want.size(), what, ": ", got.size(), " elements, want ", want.size());
  for (std::size_t i = 0; i < got.size(); ++i) test::check_equal(c, what, got, i, want[i], i);
}

template <class T, class Comm>
void device_all_reduce(Comm& c, Reduce op, std::size_t n) {
  const int me = c.group().ranks[c.rank()];
  const auto& members = c.group().ranks;
  std::vector<T> want(n);
  for (std::size_t i = 0; i < n; ++i) want[i] = test::reference<T>(members, i, op);
  DeviceVector<T> send(test::inputs<T>(me, n, op)), recv(std::vector<T>(n, T(99)));
  c.all_reduce(send.span(), recv.span(), op);
  expect_values(c, "device all_reduce", recv.host(), want);
  DeviceVector<T> buf(test::inputs<T>(me, n, op));
  c.all_reduce_async(buf.span(), op).wait();
  expect_values(c, "device all_reduce in place", buf.host(), want);
}

template <class T, class Comm>
void device_movement(Comm& c, std::size_t n) {
  const int me = c.group().ranks[c.rank()];
  const auto& members = c.group().ranks;
  const int size = c.size();
  // reduce_scatter
  {
    DeviceVector<T> send(test::inputs<T>(me, n * size, Reduce::sum)), recv(std::vector<T>(n, T(99)));
    c.reduce_scatter(send.span(), recv.span(), Reduce::sum);
    std::vector<T> want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = test::reference<T>(members, c.rank() * n + i, Reduce::sum);
    expect_values(c, "device reduce_scatter", recv.host(), want);
  }
  // all_gather
  {
    DeviceVector<T> mine(test::inputs<T>(me, n, Reduce::sum, 3)), all(std::vector<T>(n * size, T(99)));
    c.all_gather(std::span<const T>(mine.span()), all.span());
    std::vector<T> want;
    for (int q = 0; q < size; ++q)
      for (std::size_t i = 0; i < n; ++i) want.push_back(test::input<T>(members[q], i, Reduce::sum, 3));
    expect_values(c, "device all_gather", all.host(), want);
  }
  // broadcast from the last rank
  {
    const int root = size - 1;
    DeviceVector<T> b(c.rank() == root ? test::inputs<T>(me, n, Reduce::sum, 4) : std::vector<T>(n, T(99)));
    c.broadcast(b.span(), root);
    expect_values(c, "device broadcast", b.host(), test::inputs<T>(members[root], n, Reduce::sum, 4));
  }
  // all_to_all: block q of rank p holds input(p, i, salt q)
  {
    std::vector<T> s(n * size);
    for (int q = 0; q < size; ++q)
      for (std::size_t i = 0; i < n; ++i) s[q * n + i] = test::input<T>(me, i, Reduce::sum, q);
    DeviceVector<T> send(s), recv(std::vector<T>(n * size, T(99)));
    c.all_to_all(std::span<const T>(send.span()), recv.span());
    std::vector<T> want;
    for (int q = 0; q < size; ++q)
      for (std::size_t i = 0; i < n; ++i) want.push_back(test::input<T>(members[q], i, Reduce::sum, c.rank()));
    expect_values(c, "device all_to_all", recv.host(), want);
  }
  // a ring shift by batched send/recv, the receive listed first
  if (size > 1) {
    const int right = (c.rank() + 1) % size, left = (c.rank() + size - 1) % size;
    DeviceVector<T> out(test::inputs<T>(me, n, Reduce::sum, 5)), in(std::vector<T>(n, T(99)));
    c.exchange({comm::recv_op(in.span(), left), comm::send_op(std::span<const T>(out.span()), right)});
    expect_values(c, "device exchange", in.host(), test::inputs<T>(members[left], n, Reduce::sum, 5));
  }
}

comm::LocalOptions options(Algorithm a) {
  comm::LocalOptions o;
  o.timeout = std::chrono::milliseconds(20000);
  o.algorithm = a;
  return o;
}

}  // namespace

TEMPLATE_TEST_CASE("all_reduce on device buffers matches the serial reference with every algorithm", "[comm][cuda]",
                   (Parallel<DP<2>>), (Parallel<DP<3>>), (Parallel<DP<4>>), (Parallel<DP<8>>)) {
  for (Algorithm a : {Algorithm::ring, Algorithm::halving_doubling, Algorithm::direct}) {
    INFO("algorithm " << comm::name_of(a));
    REQUIRE_NOTHROW(run_local<TestType>(
        [](auto& ctx) {
          auto& c = ctx.world();
          for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{100003}})
            for (Reduce op : test::all_reductions) {
              device_all_reduce<float>(c, op, n);
              device_all_reduce<double>(c, op, n);
              device_all_reduce<bf16>(c, op, n);
              device_all_reduce<std::int64_t>(c, op, n);
            }
        },
        options(a)));
  }
}

TEMPLATE_TEST_CASE("the other collectives and send/recv move device buffers", "[comm][cuda]",
                   (Parallel<TP<2>, DP<2>>), (Parallel<DP<3>>), (Parallel<DP<8>>)) {
  REQUIRE_NOTHROW(run_local<TestType>(
      [](auto& ctx) {
        for (std::size_t n : {std::size_t{1}, std::size_t{1000}, std::size_t{4099}}) {
          device_movement<float>(ctx.world(), n);
          device_movement<fp16>(ctx.world(), n);
          device_movement<std::int32_t>(ctx.template comm<Axis::dp>(), n);
        }
      },
      options(Algorithm::automatic)));
}

namespace {
void hold_stream(void* seconds) {
  std::this_thread::sleep_for(std::chrono::duration<double>(*static_cast<double*>(seconds)));
}
}  // namespace

TEST_CASE("a collective ordered on a stream reads what the stream wrote before it", "[comm][cuda]") {
  REQUIRE_NOTHROW(run_local<Parallel<DP<2>>>(
      [](auto& ctx) {
        cudaStream_t s = nullptr;
        LOOM_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        const std::size_t n = 4099;
        DeviceVector<std::int32_t> buf(std::vector<std::int32_t>(n, 0));
        LOOM_CUDA(cudaStreamSynchronize(nullptr));  // s does not wait for the legacy stream's copy
        static double hold = 0.3;
        LOOM_CUDA(cudaLaunchHostFunc(s, hold_stream, &hold));
        LOOM_CUDA(cudaMemsetAsync(buf.span().data(), 1, n * sizeof(std::int32_t), s));  // 0x01010101 after the hold
        {
          const auto on = ctx.world().on_stream(s);
          ctx.world().all_reduce(buf.span());
        }
        const auto got = buf.host();
        LOOM_CUDA(cudaStreamDestroy(s));
        for (std::size_t i = 0; i < n; i += 97)
          test::expect(got[i] == 2 * 0x01010101, "an all_reduce ordered on a held stream got ", got[i], " at ", i,
                       ": it read before the stream's write");
      },
      options(Algorithm::automatic)));
}

TEST_CASE("ranks that mix host and device memory in one collective are told so", "[comm][cuda][failure]") {
  std::string msg;
  try {
    run_local<Parallel<DP<2>>>(
        [](auto& ctx) {
          std::vector<float> host(4, 1.0f);
          DeviceVector<float> dev(host);
          if (ctx.rank() == 0) ctx.world().all_reduce(std::span<float>(host));
          else ctx.world().all_reduce(dev.span());
        },
        options(Algorithm::automatic));
  } catch (const std::exception& e) {
    msg = e.what();
  }
  INFO(msg);
  CHECK(msg.find("global rank 0 passed host memory but global rank 1 passed device memory") != std::string::npos);
}

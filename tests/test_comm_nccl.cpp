// The Nccl backend on GPUs: the collective cases every backend runs (tests/comm_cases.hpp) on host vectors given to
// it directly (it stages them) and through an adapter that mirrors them in device memory, plus what only a device
// communicator has (its stream, error codes, the timeout). Without a CUDA device it prints "SKIPPED: no CUDA device
// here" and exits with 77.
//   mpirun -np 1 test_comm_nccl cases | timeout      (-np 2, 4, 8 on as many GPUs: every group of a layout)
#include "comm_cases.hpp"
#include "gpu_skip.hpp"

#include <loom/comm/nccl.hpp>

#include <cstdio>
#include <cstring>
#include <thread>

using namespace loom;

namespace {

//! Device copies of host ranges for one operation: a range inside one mapped before shares its device memory, so
//! in-place calls stay in place. copy_back() returns every range to the host, sends included, so that a send buffer
//! the operation wrote to shows on the host.
class Mirror {
 public:
  explicit Mirror(cudaStream_t s) : s_(s) {}
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  ~Mirror() {
    for (auto& r : regions_) cudaFreeAsync(r.dev, s_);
    cudaStreamSynchronize(s_);
  }

  template <comm::Buffer R>
  std::span<comm::element_t<R>> map(R&& r) {
    using T = comm::element_t<R>;
    const std::size_t n = std::ranges::size(r);
    return {static_cast<T*>(raw(std::ranges::data(r), n * sizeof(T))), n};
  }
  comm::P2P map(const comm::P2P& p) {
    comm::P2P d = p;
    d.data = raw(p.data, p.count * size_of(p.dtype));
    return d;
  }

  void copy_back() {
    for (auto& r : regions_) LOOM_CUDA(cudaMemcpyAsync(r.host, r.dev, r.bytes, cudaMemcpyDeviceToHost, s_));
    LOOM_CUDA(cudaStreamSynchronize(s_));
  }

 private:
  struct Region {
    char* host;
    std::size_t bytes;
    char* dev;
  };
  void* raw(const void* host, std::size_t bytes) {
    if (bytes == 0) return nullptr;
    auto* h = const_cast<char*>(static_cast<const char*>(host));
    for (auto& r : regions_)
      if (h >= r.host && h + bytes <= r.host + r.bytes) return r.dev + (h - r.host);
    void* d = nullptr;
    LOOM_CUDA(cudaMallocAsync(&d, bytes, s_));
    regions_.push_back({h, bytes, static_cast<char*>(d)});
    LOOM_CUDA(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s_));
    return d;
  }

  cudaStream_t s_;
  std::vector<Region> regions_;
};

//! An NcclComm with the host-vector methods the shared cases call: each copies to the device, runs the operation on
//! device memory, and copies back.
class OnDevice {
 public:
  explicit OnDevice(comm::NcclComm& c) : c_(c) {}

  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  const comm::GroupInfo& group() const { return c_.group(); }

  template <comm::Buffer S, comm::Buffer R>
  void all_reduce(const S& send, R&& recv, comm::Reduce op) {
    Mirror m(c_.stream());
    auto r = m.map(recv);
    c_.all_reduce(m.map(send), r, op);
    m.copy_back();
  }
  //! Waits before returning: the copy back needs the result. The operation itself goes through the async path.
  template <comm::Buffer B>
  comm::Handle all_reduce_async(B&& buf, comm::Reduce op) {
    Mirror m(c_.stream());
    auto d = m.map(buf);
    auto h = c_.all_reduce_async(d, op);
    h.wait();
    m.copy_back();
    return comm::Handle::ready();
  }
  template <comm::Buffer S, comm::Buffer R>
  void reduce_scatter(const S& send, R&& recv, comm::Reduce op) {
    Mirror m(c_.stream());
    auto s = m.map(send);
    c_.reduce_scatter(s, m.map(recv), op);
    m.copy_back();
  }
  template <comm::Buffer S, comm::Buffer R>
  void reduce(const S& send, R&& recv, comm::Reduce op, int root) {
    Mirror m(c_.stream());
    auto s = m.map(send);
    c_.reduce(s, m.map(recv), op, root);
    m.copy_back();
  }
  template <comm::Buffer S, comm::Buffer R>
  void all_gather(const S& send, R&& recv) {
    Mirror m(c_.stream());
    auto r = m.map(recv);  // first: an in-place send lies inside it
    c_.all_gather(m.map(send), r);
    m.copy_back();
  }
  template <comm::Buffer B>
  void broadcast(B&& buf, int root) {
    Mirror m(c_.stream());
    c_.broadcast(m.map(buf), root);
    m.copy_back();
  }
  template <comm::Buffer S, comm::Buffer R>
  void all_to_all(const S& send, R&& recv) {
    Mirror m(c_.stream());
    auto s = m.map(send);
    c_.all_to_all(s, m.map(recv));
    m.copy_back();
  }
  template <comm::Buffer S, class C1, class C2, comm::Buffer R, class C3, class C4>
  void all_to_all_v(const S& send, const C1& sc, const C2& sd, R&& recv, const C3& rc, const C4& rd) {
    Mirror m(c_.stream());
    auto r = m.map(recv);
    c_.all_to_all_v(m.map(send), sc, sd, r, rc, rd);
    m.copy_back();
  }
  void exchange(std::initializer_list<comm::P2P> ops) { run_p2p(ops, false); }
  template <comm::Buffer S>
  comm::Handle send_async(const S& data, int peer) {
    run_p2p({comm::send_op(data, peer)}, true);
    return comm::Handle::ready();
  }
  template <comm::Buffer R>
  void recv(R&& data, int peer) { run_p2p({comm::recv_op(data, peer)}, false); }
  void barrier() { c_.barrier(); }

 private:
  void run_p2p(std::initializer_list<comm::P2P> ops, bool async) {
    Mirror m(c_.stream());
    std::vector<comm::P2P> dev;
    for (const auto& p : ops) dev.push_back(m.map(p));
    if (async) c_.exchange_async(dev).wait();
    else c_.exchange(dev);
    m.copy_back();
  }

  comm::NcclComm& c_;
};

//! What the host-vector cases cannot see: operations on device spans order after work already on stream(); a
//! second communicator over the same group works beside the first and runs blocking operations on the caller's
//! thread; error codes become BackendError with the call's name and NCCL's or CUDA's text.
void device_checks(comm::NcclComm& c) {
  int current = -1;
  LOOM_CUDA(cudaGetDevice(&current));
  test::expect(current == c.device(), "the current device is ", current, " but the communicator's is ", c.device());

  const std::size_t n = 1000;
  std::int32_t *send = nullptr, *recv = nullptr;
  LOOM_CUDA(cudaMalloc(&send, n * sizeof(std::int32_t)));
  LOOM_CUDA(cudaMalloc(&recv, n * sizeof(std::int32_t)));
  LOOM_CUDA(cudaMemsetAsync(send, 1, n * sizeof(std::int32_t), c.stream()));  // every element 0x01010101
  LOOM_CUDA(cudaMemsetAsync(recv, 0, n * sizeof(std::int32_t), c.stream()));
  c.all_reduce(std::span<const std::int32_t>(send, n), std::span<std::int32_t>(recv, n), comm::Reduce::max);
  std::vector<std::int32_t> got(n);
  LOOM_CUDA(cudaMemcpy(got.data(), recv, n * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  for (std::size_t i = 0; i < n; ++i)
    test::expect(got[i] == 0x01010101, "all_reduce after a memset on stream() got ", got[i], " at ", i);

  comm::NcclComm second(c.group(), c.device());
  test::expect(second.rank() == c.rank() && second.size() == c.size(), "a second communicator disagrees on rank");
  test::expect(second.stream() != c.stream(), "two communicators share a stream");
  LOOM_CUDA(cudaMemsetAsync(recv, 0, n * sizeof(std::int32_t), second.stream()));
  second.all_reduce(std::span<const std::int32_t>(send, n), std::span<std::int32_t>(recv, n), comm::Reduce::min);
  LOOM_CUDA(cudaMemcpy(got.data(), recv, n * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  test::expect(got[0] == 0x01010101 && got[n - 1] == 0x01010101, "the second communicator's all_reduce got ", got[0]);
  second.barrier();

  try {
    LOOM_NCCL(ncclAllReduce(send, recv, n, static_cast<ncclDataType_t>(99), ncclSum, second.native(), second.stream()));
    test::expect(false, "ncclAllReduce with datatype 99 did not fail");
  } catch (const BackendError& e) {
    const std::string what = e.what();
    test::expect(what.starts_with("loom: ncclAllReduce failed: invalid argument"), "NCCL error message: ", what);
  }
  try {
    LOOM_CUDA(cudaSetDevice(-1));
    test::expect(false, "cudaSetDevice(-1) did not fail");
  } catch (const BackendError& e) {
    const std::string what = e.what();
    test::expect(what.starts_with("loom: cudaSetDevice failed: invalid device ordinal"), "CUDA error message: ", what);
  }
  LOOM_CUDA(cudaFree(send));
  LOOM_CUDA(cudaFree(recv));
}

void block_stream(void* seconds) {
  std::this_thread::sleep_for(std::chrono::duration<double>(*static_cast<double*>(seconds)));
}

//! Operations ordered on a stream of the caller (on_stream): the call returns while that stream is still held by a
//! host function, the collective reads what the stream wrote after it, and the stream's next copy reads its result;
//! asynchronous ones alike at wait(); with host buffers (staged) the call waits and the values come back.
void stream_ordered_checks(comm::NcclComm& c) {
  cudaStream_t s = nullptr;
  LOOM_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::size_t n = 1 << 20;
  std::int32_t *send = nullptr, *recv = nullptr;
  LOOM_CUDA(cudaMalloc(&send, n * sizeof(std::int32_t)));
  LOOM_CUDA(cudaMalloc(&recv, n * sizeof(std::int32_t)));
  std::vector<std::int32_t> got(n);
  for (const bool async : {false, true}) {
    LOOM_CUDA(cudaMemset(send, 0, n * sizeof(std::int32_t)));
    LOOM_CUDA(cudaMemset(recv, 0, n * sizeof(std::int32_t)));
    LOOM_CUDA(cudaStreamSynchronize(nullptr));  // the streams below do not wait for the legacy one
    static double hold = 0.5;
    LOOM_CUDA(cudaLaunchHostFunc(s, block_stream, &hold));
    LOOM_CUDA(cudaMemsetAsync(send, 1, n * sizeof(std::int32_t), s));  // 0x01010101, once the hold ends
    const auto t0 = std::chrono::steady_clock::now();
    comm::Handle h;
    {
      const auto on = c.on_stream(s);
      if (async) h = c.all_reduce_async(std::span<const std::int32_t>(send, n), std::span<std::int32_t>(recv, n),
                                        comm::Reduce::max);
      else c.all_reduce(std::span<const std::int32_t>(send, n), std::span<std::int32_t>(recv, n), comm::Reduce::max);
    }
    h.wait();
    const auto took = std::chrono::steady_clock::now() - t0;
    test::expect(cudaStreamQuery(s) == cudaErrorNotReady, "the caller's stream finished before an ordered ",
                 async ? "asynchronous " : "", "all_reduce returned: the host waited for it");
    test::expect(took < std::chrono::milliseconds(300), "an ordered all_reduce took ",
                 std::chrono::duration_cast<std::chrono::milliseconds>(took).count(),
                 " ms to return while the stream was held for 500 ms");
    LOOM_CUDA(cudaMemcpyAsync(got.data(), recv, n * sizeof(std::int32_t), cudaMemcpyDeviceToHost, s));
    LOOM_CUDA(cudaStreamSynchronize(s));
    for (std::size_t i = 0; i < n; i += 4099)
      test::expect(got[i] == 0x01010101, "an ordered ", async ? "asynchronous " : "", "all_reduce got ", got[i],
                   " at ", i, ": it did not read after the stream's write, or the stream's copy did not wait for it");
  }
  // An asynchronous one: the caller's stream waits for it from wait() on, not before, so what the caller queues in
  // between runs beside it (here while the communicator's stream is held).
  {
    static double hold = 0.5;
    LOOM_CUDA(cudaLaunchHostFunc(c.stream(), block_stream, &hold));
    comm::Handle h;
    {
      const auto on = c.on_stream(s);
      h = c.all_reduce_async(std::span<const std::int32_t>(send, n), std::span<std::int32_t>(recv, n),
                             comm::Reduce::max);
    }
    cudaEvent_t between = nullptr;
    LOOM_CUDA(cudaEventCreateWithFlags(&between, cudaEventDisableTiming));
    LOOM_CUDA(cudaMemsetAsync(recv, 0, sizeof(std::int32_t), s));  // (the collective's result comes after)
    LOOM_CUDA(cudaEventRecord(between, s));
    const auto t0 = std::chrono::steady_clock::now();
    LOOM_CUDA(cudaEventSynchronize(between));
    const auto took = std::chrono::steady_clock::now() - t0;
    test::expect(took < std::chrono::milliseconds(300), "work queued on the caller's stream before wait() waited ",
                 std::chrono::duration_cast<std::chrono::milliseconds>(took).count(),
                 " ms for an asynchronous ordered all_reduce held 500 ms");
    h.wait();
    test::expect(cudaStreamQuery(s) == cudaErrorNotReady, "the caller's stream does not wait for an asynchronous "
                 "ordered all_reduce after wait()");
    LOOM_CUDA(cudaMemcpyAsync(got.data(), recv, n * sizeof(std::int32_t), cudaMemcpyDeviceToHost, s));
    LOOM_CUDA(cudaStreamSynchronize(s));
    LOOM_CUDA(cudaEventDestroy(between));
    test::expect(got[0] == 0x01010101 && got[n - 1] == 0x01010101, "an asynchronous ordered all_reduce got ", got[0],
                 " and ", got[n - 1]);
  }
  std::vector<float> host{1.5f, -2.0f, 3.0f};
  {
    const auto on = c.on_stream(s);
    c.all_reduce(host, comm::Reduce::max);
  }
  test::expect(host[0] == 1.5f && host[1] == -2.0f && host[2] == 3.0f, "an ordered all_reduce of host memory got ",
               host[0], ", ", host[1], ", ", host[2]);
  LOOM_CUDA(cudaFree(send));
  LOOM_CUDA(cudaFree(recv));
  LOOM_CUDA(cudaStreamDestroy(s));
}

template <class T>
void on_device(comm::NcclComm& c) {
  OnDevice d(c);
  test::collective_cases<T>(d);
}

void all_cases(comm::NcclComm& c) {
  // Host vectors handed to the communicator itself: it stages them through device memory (a trainer's scalars).
  test::collective_cases<float>(c);
  test::collective_cases<std::int64_t>(c);
  on_device<float>(c);
  on_device<double>(c);
  on_device<bf16>(c);
  on_device<fp16>(c);
  on_device<std::int32_t>(c);
  on_device<std::int64_t>(c);
}

template <class Cfg>
int cases(int& argc, char**& argv) {
  return run_nccl<Cfg>(argc, argv, [](auto& ctx) {
    // With one rank every group is the world; with more, each group of the layout in turn.
    all_cases(ctx.template comm<Axis::tp>());
    all_cases(ctx.template comm<Axis::dp>());
    all_cases(ctx.template comm<Axis::pp>());
    all_cases(ctx.template comm<Axis::dp, Axis::cp>());
    all_cases(ctx.world());
    device_checks(ctx.world());
    stream_ordered_checks(ctx.world());
    if (ctx.rank() == 0)
      std::printf("test_comm_nccl: every collective on every group of %s passed on the device\n",
                  std::string(Cfg::name()).c_str());
  });
}

//! An operation on a communicator aborted by a failure says so.
void expect_aborted(comm::NcclComm& c) {
  std::string after;
  try {
    c.barrier();
  } catch (const Error& e) {
    after = e.what();
  }
  test::expect(after.find("aborted by an earlier failure") != std::string::npos,
               "an operation on the aborted communicator: '", after, "'");
}

//! Issues an all_reduce ordered on `s` that cannot finish within c's timeout of 1 s (a stream is held): the call
//! returns at once, `s` waits for it; 1.5 s later the next operation throws what the watchdog met, returned here.
std::string after_watchdog(comm::NcclComm& c, cudaStream_t s, float* send, float* recv, std::size_t n) {
  const auto t0 = std::chrono::steady_clock::now();
  {
    const auto on = c.on_stream(s);
    c.all_reduce(std::span<const float>(send, n), std::span<float>(recv, n));
  }
  const auto returned = std::chrono::steady_clock::now() - t0;
  test::expect(returned < std::chrono::milliseconds(500), "an ordered all_reduce took ",
               std::chrono::duration_cast<std::chrono::milliseconds>(returned).count(), " ms to return");
  test::expect(cudaStreamQuery(s) == cudaErrorNotReady, "the caller's stream does not wait for an ordered all_reduce "
               "that cannot finish");
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  try {
    c.barrier();
  } catch (const TimeoutError& e) {
    return e.what();
  }
  return {};
}

//! One rank can still time out: a host function holds the stream longer than the timeout, so the all_reduce
//! behind it cannot finish. The communicator is then aborted and refuses further operations. The same for an
//! operation ordered on the caller's stream, which the watchdog times out.
int timeout_case(int& argc, char**& argv) {
  return run_nccl<Parallel<>>(argc, argv, [](auto& ctx) {
    auto& world = ctx.world();
    comm::NcclComm c(world.group(), world.device(), std::chrono::milliseconds(1000));
    const std::size_t n = 16;
    float *send = nullptr, *recv = nullptr;
    LOOM_CUDA(cudaMalloc(&send, n * sizeof(float)));
    LOOM_CUDA(cudaMalloc(&recv, n * sizeof(float)));
    c.all_reduce(std::span<const float>(send, n), std::span<float>(recv, n));  // #1 completes
    static double hold = 3;
    LOOM_CUDA(cudaLaunchHostFunc(c.stream(), block_stream, &hold));
    const auto t0 = std::chrono::steady_clock::now();
    std::string what;
    try {
      c.all_reduce(std::span<const float>(send, n), std::span<float>(recv, n));
    } catch (const TimeoutError& e) {
      what = e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - t0;
    test::expect(!what.empty(), "an all_reduce behind a blocked stream did not time out");
    test::expect(what.starts_with("loom: all_reduce #2 on group world{0} timed out after 1 s on global rank 0"),
                 "timeout message: ", what);
    test::expect(waited >= std::chrono::milliseconds(990), "the timeout of 1 s fired after ",
                 std::chrono::duration_cast<std::chrono::milliseconds>(waited).count(), " ms");
    expect_aborted(c);
    LOOM_CUDA(cudaStreamSynchronize(c.stream()));  // the held stream drains before its buffers go

    // Ordered on a stream of the caller, the operation returns at once; held on the communicator's stream, it
    // cannot finish: the watchdog times it out from when the caller's stream reached it and aborts the
    // communicator, and the next operation reports it.
    comm::NcclComm w(world.group(), world.device(), std::chrono::milliseconds(1000));
    cudaStream_t s = nullptr;
    LOOM_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    LOOM_CUDA(cudaLaunchHostFunc(w.stream(), block_stream, &hold));
    const std::string watched = after_watchdog(w, s, send, recv, n);
    test::expect(watched.starts_with("loom: all_reduce #1 on group world{0} timed out after 1 s on global rank 0 "
                                     "(all_reduce(count=16, f32, sum), ordered on the caller's stream); the NCCL "
                                     "communicator was aborted"),
                 "the watchdog's timeout, reported by the next operation: '", watched, "'");
    expect_aborted(w);
    LOOM_CUDA(cudaStreamSynchronize(s));  // the hold ends, and the copy behind it
    LOOM_CUDA(cudaStreamSynchronize(w.stream()));

    // Held on the caller's stream instead, the operation never starts: the watchdog says so after the timeout.
    comm::NcclComm x(world.group(), world.device(), std::chrono::milliseconds(1000));
    LOOM_CUDA(cudaLaunchHostFunc(s, block_stream, &hold));
    const std::string stuck = after_watchdog(x, s, send, recv, n);
    test::expect(stuck.starts_with("loom: all_reduce #1 on group world{0} did not start within 1 s on global rank 0 "
                                   "(all_reduce(count=16, f32, sum)): the caller's stream did not reach it"),
                 "the watchdog on a caller's stream that never reaches the operation: '", stuck, "'");
    LOOM_CUDA(cudaStreamSynchronize(s));
    LOOM_CUDA(cudaStreamSynchronize(x.stream()));
    LOOM_CUDA(cudaStreamDestroy(s));
    LOOM_CUDA(cudaFree(send));
    LOOM_CUDA(cudaFree(recv));
    std::printf("test_comm_nccl: timeout: %s\n", what.c_str());
    std::printf("test_comm_nccl: timeout of an ordered operation: %s\n", watched.c_str());
    std::printf("test_comm_nccl: an ordered operation its stream never reached: %s\n", stuck.c_str());
  });
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "cases";
  if (std::strcmp(mode, "timeout") == 0) return timeout_case(argc, argv);
  const char* np = std::getenv("OMPI_COMM_WORLD_SIZE");
  const int size = np ? std::atoi(np) : 1;
  if (size == 8) return cases<Parallel<TP<2>, PP<2>, DP<2>>>(argc, argv);
  if (size == 4) return cases<Parallel<TP<2>, DP<2>>>(argc, argv);
  if (size == 2) return cases<Parallel<DP<2>>>(argc, argv);
  return cases<Parallel<>>(argc, argv);
}

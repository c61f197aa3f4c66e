// Typed stages on CUDA streams: two stages on two streams overlap on the device, ordered by events; on one stream
// they do not. Skipped (exit 77) where no CUDA device exists.
#include <loom/exec/cuda_pipeline.hpp>

#include "gpu_skip.hpp"

#include <chrono>
#include <cstdio>

using namespace loom;

__global__ void spin(long long ns, int* out, int value) {
  const long long t0 = clock64();
  // clock64 counts cycles; about 1.5-2 GHz on the devices this runs on: wait at least ns nanoseconds.
  while (clock64() - t0 < ns) {
  }
  if (out) *out = value;
}

struct Produce {
  int* slot;
  int operator()(std::size_t i, cudaStream_t s) const {
    spin<<<1, 1, 0, s>>>(4'000'000, slot + i, static_cast<int>(i) + 1);
    return static_cast<int>(i);
  }
};
struct Consume {
  int* slot;
  int* copy;
  void operator()(int i, cudaStream_t s) const {
    spin<<<1, 1, 0, s>>>(4'000'000, nullptr, 0);
    cudaMemcpyAsync(copy + i, slot + i, sizeof(int), cudaMemcpyDeviceToDevice, s);
  }
};

#define EXPECT(c)                                                   \
  do {                                                              \
    if (!(c)) {                                                     \
      std::fprintf(stderr, "FAILED: %s (line %d)\n", #c, __LINE__); \
      return 1;                                                     \
    }                                                               \
  } while (0)

template <class R0, class R1>
double run(exec::Streams st, int* slot, int* copy, int n) {
  exec::StreamPipeline<exec::Stage<R0, Produce>, exec::Stage<R1, Consume>> p(st, Produce{slot}, Consume{slot, copy});
  cudaDeviceSynchronize();
  const auto t0 = std::chrono::steady_clock::now();
  p.run(n);
  p.wait();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

int main() {
  exec::Streams st;
  cudaStreamCreateWithFlags(&st.compute, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&st.comm, cudaStreamNonBlocking);
  const int n = 8;
  int *slot, *copy;
  cudaMalloc(&slot, n * sizeof(int));
  cudaMalloc(&copy, n * sizeof(int));
  run<exec::Compute, exec::Comm>(st, slot, copy, n);  // warm up
  cudaMemset(copy, 0, n * sizeof(int));
  const double two = run<exec::Compute, exec::Comm>(st, slot, copy, n);
  int host[n];
  cudaMemcpy(host, copy, sizeof host, cudaMemcpyDeviceToHost);
  for (int i = 0; i < n; ++i) EXPECT(host[i] == i + 1);  // each consumer saw its producer's write: events order them
  const double one = run<exec::Compute, exec::Compute>(st, slot, copy, n);
  std::printf("two streams %.1f ms, one stream %.1f ms\n", two, one);
  EXPECT(two < 0.75 * one);  // fill + n*max against n*sum
  std::printf("test_exec_cuda: passed\n");
  return 0;
}

// Tensor<T, Cuda>: allocation from the caching allocator, copies both ways, views, fill. Skipped (exit 77) where no
// CUDA device exists.
#include <loom/tensor/cuda.hpp>

#include "gpu_skip.hpp"

#include <cstdio>

using namespace loom;

#define EXPECT(c)                                                       \
  do {                                                                  \
    if (!(c)) {                                                         \
      std::fprintf(stderr, "FAILED: %s (line %d)\n", #c, __LINE__);     \
      return 1;                                                         \
    }                                                                   \
  } while (0)

int main() {
  Tensor<float> h({3, 4});
  for (int i = 0; i < 12; ++i) h.data()[i] = static_cast<float>(i);
  const auto in_use = CudaAllocator::instance().stats().in_use;
  {
    auto d = to_device(h);
    EXPECT(CudaAllocator::instance().stats().in_use > in_use);
    auto back = to_host(d);
    for (int i = 0; i < 12; ++i) EXPECT(back.data()[i] == static_cast<float>(i));
    // A strided view of device memory copies to a contiguous host tensor.
    auto col = to_host(d.slice(1, 1, 3).clone());
    EXPECT(col.shape() == (Shape{3, 2}));
    EXPECT(col(2, 1) == 10.0f);
    d.fill(0.0f);
    EXPECT(to_host(d)(1, 1) == 0.0f);
    d.fill(2.5f);
    EXPECT(to_host(d)(2, 3) == 2.5f);
    Tensor<bf16, Cuda> b({5});
    b.fill(bf16(1.5f));
    EXPECT(static_cast<float>(to_host(b)(4)) == 1.5f);
  }
  EXPECT(CudaAllocator::instance().stats().in_use == in_use);
  std::printf("test_tensor_cuda: passed\n");
  return 0;
}

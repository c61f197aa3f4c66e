// For test programs that need a CUDA device; including it decides before main() runs. Without one (no GPU and no
// driver), the program prints "SKIPPED: no CUDA device here" and exits with 77, which ctest (SKIP_RETURN_CODE 77)
// reports as skipped; on a machine whose GPU the runtime cannot use it prints why and exits with 1: a broken GPU
// fails, never skips.
#pragma once

#include <loom/core/cuda_device.hpp>

#include <cstdio>
#include <cstdlib>

namespace loom::test {

//! 0 where a device is ready; otherwise the exit code after printing why.
inline int gpu_unavailable() {
  const auto a = cuda_availability();
  if (a.kind == CudaAvailability::ready) return 0;
  if (a.kind == CudaAvailability::absent) {
    std::printf("SKIPPED: %s\n", a.what.c_str());
    std::fflush(stdout);
    return 77;
  }
  std::fprintf(stderr, "FAILED: %s\n", a.what.c_str());
  return 1;
}

inline const bool gpu_present = [] {
  if (const int code = gpu_unavailable()) std::exit(code);
  return true;
}();

}  // namespace loom::test

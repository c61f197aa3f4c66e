// For Catch2 programs that need a CUDA device: without one, the program prints "SKIPPED: no CUDA device" and exits
// with 77 before Catch2's main runs, which ctest (SKIP_RETURN_CODE 77) reports as skipped rather than failed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

namespace loom::test {

inline const bool gpu_present = [] {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    std::fflush(stdout);
    std::exit(77);
  }
  return true;
}();

}  // namespace loom::test

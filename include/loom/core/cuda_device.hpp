// Whether this machine can run CUDA code: a GPU the runtime can use, none at all (code that needs one is skipped),
// or a GPU or driver that is there but unusable (an error, never a skip). Needs the CUDA runtime: link loom::cuda.
#pragma once

#include <loom/core/error.hpp>

#include <cuda_runtime_api.h>

#include <filesystem>
#include <string>

namespace loom {

struct CudaAvailability {
  enum Kind { ready, absent, broken };
  Kind kind;
  int devices;       //!< what cudaGetDeviceCount reported (0 unless ready)
  std::string what;  //!< why it is absent or broken
};

namespace detail {

//! A GPU of NVIDIA's that the kernel driver shows, whatever the CUDA runtime says about it.
inline bool nvidia_gpu_visible() {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory("/proc/driver/nvidia/gpus", ec) && !fs::is_empty("/proc/driver/nvidia/gpus", ec)) return true;
  for (int i = 0; i < 16; ++i)
    if (fs::exists("/dev/nvidia" + std::to_string(i), ec)) return true;
  return false;
}

}  // namespace detail

//! What the CUDA runtime can use here. `absent` only when it reports no device, or no driver, and the kernel shows no
//! NVIDIA GPU either; a GPU with a driver the runtime cannot use is `broken`, named by its error.
inline CudaAvailability cuda_availability() {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc == cudaSuccess && count > 0) return {CudaAvailability::ready, count, {}};
  const std::string error = rc == cudaSuccess ? std::string("it reports 0 devices")
                                              : detail::cat(cudaGetErrorName(rc), ": ", cudaGetErrorString(rc));
  if (detail::nvidia_gpu_visible())
    return {CudaAvailability::broken, 0,
            "this machine has an NVIDIA GPU, but the CUDA runtime cannot use it (cudaGetDeviceCount: " + error + ")"};
  if (rc == cudaSuccess || rc == cudaErrorNoDevice || rc == cudaErrorInsufficientDriver)
    return {CudaAvailability::absent, 0, "no CUDA device here (cudaGetDeviceCount: " + error + ")"};
  return {CudaAvailability::broken, 0, "the CUDA runtime failed (cudaGetDeviceCount: " + error + ")"};
}

}  // namespace loom

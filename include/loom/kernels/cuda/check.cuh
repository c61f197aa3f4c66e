// CUDA and cuBLAS return codes as loom::BackendError: LOOM_CUDA(call), LOOM_CUBLAS(call), and check_launch(name)
// after a kernel launch. Messages read "loom: <function> failed: <description> (<code name>)".
#pragma once

#if !defined(LOOM_HAS_CUDA)
#error "loom: the CUDA kernels need LOOM_HAS_CUDA: link loom::cuda (configure with -DLOOM_WITH_CUDA=ON)"
#endif

#include <loom/core/error.hpp>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <string_view>

namespace loom::kernels::cuda::detail {

//! The function's name out of a macro's stringified call: "cudaMemcpyAsync(a, b, ...)" -> "cudaMemcpyAsync".
constexpr std::string_view call_name(std::string_view call) { return call.substr(0, call.find('(')); }

inline void cuda_check(cudaError_t rc, std::string_view call) {
  if (rc == cudaSuccess) return;
  throw BackendError(loom::detail::cat("loom: ", call_name(call), " failed: ", cudaGetErrorString(rc), " (",
                                       cudaGetErrorName(rc), ")"));
}

inline void cublas_check(cublasStatus_t rc, std::string_view call) {
  if (rc == CUBLAS_STATUS_SUCCESS) return;
  throw BackendError(loom::detail::cat("loom: ", call_name(call), " failed: ", cublasGetStatusString(rc), " (",
                                       cublasGetStatusName(rc), ")"));
}

//! Whether p is memory the device reads (its own, or managed). A pointer CUDA does not know, or any pointer where
//! there is no device or driver, is host memory; any other failure (a context broken by an earlier kernel's fault)
//! throws, rather than passing device memory off as the host's.
inline bool device_memory(const void* p) {
  if (!p) return false;
  cudaPointerAttributes a{};
  const cudaError_t rc = cudaPointerGetAttributes(&a, p);
  if (rc == cudaErrorInvalidValue || rc == cudaErrorNoDevice || rc == cudaErrorInsufficientDriver ||
      rc == cudaErrorInitializationError) {
    static_cast<void>(cudaGetLastError());
    return false;
  }
  cuda_check(rc, "cudaPointerGetAttributes");
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

//! After a launch: a bad configuration (too much shared memory, a zero grid) shows here, named after the kernel.
inline void check_launch(std::string_view kernel) { cuda_check(cudaGetLastError(), kernel); }

}  // namespace loom::kernels::cuda::detail

// Guarded: <loom/comm/nccl.hpp> defines the same check with the same message.
#ifndef LOOM_CUDA
#define LOOM_CUDA(call) ::loom::kernels::cuda::detail::cuda_check((call), #call)
#endif
#ifndef LOOM_CUBLAS
#define LOOM_CUBLAS(call) ::loom::kernels::cuda::detail::cublas_check((call), #call)
#endif

// <loom/kernels.hpp>: The operations of a GPT on a device, Ops<Device>: Ops<Host> here; Ops<Cuda> in
// <loom/kernels/cuda/device_ops.hpp> (with loom::cuda_kernels; or device_ops.cuh, from a file nvcc compiles).
#pragma once

#include <loom/kernels/shape.hpp>
#include <loom/kernels/ops.hpp>

// Ops<Cuda> for a source that nvcc compiles: <loom/kernels/cuda/device_ops.hpp>, with the kernels' definitions
// where the program does not link loom::cuda_kernels.
#pragma once

#include <loom/kernels/cuda/device_ops.hpp>

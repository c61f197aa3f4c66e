// <loom/tensor.hpp>: Tensors on the host (Tensor<T, Host>, views, memory accounting) and placements over a tensor-parallel group.
// Device tensors: <loom/tensor/cuda.hpp> (loom::cuda).
#pragma once

#include <loom/tensor/tensor.hpp>
#include <loom/tensor/placement.hpp>

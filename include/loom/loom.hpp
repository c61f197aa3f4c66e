// <loom/loom.hpp>: the whole host-side library, one header per area: the layout (config), communicators and
// run_local (comm), tensors, kernels, overlap stages (exec), layers, pipeline schedules, models, optimizers and
// training, and checkpoints where nlohmann-json is available. Device code and the Mpi and Nccl backends have headers
// of their own (<loom/kernels/cuda/device_ops.hpp>, <loom/comm/mpi.hpp>, <loom/comm/nccl.hpp>).
#pragma once

#include <loom/config.hpp>
#include <loom/comm.hpp>
#include <loom/tensor.hpp>
#include <loom/kernels.hpp>
#include <loom/exec.hpp>
#include <loom/layers.hpp>
#include <loom/pipeline.hpp>
#include <loom/models.hpp>
#include <loom/optim.hpp>
#include <loom/train.hpp>
#if __has_include(<nlohmann/json.hpp>)
#include <loom/checkpoint.hpp>
#endif

// <loom/train.hpp>: Training: batches of tokens, the data-parallel and pipeline-parallel trainers, and the optimizers they step.
#pragma once

#include <loom/optim.hpp>
#include <loom/train/data.hpp>
#include <loom/train/data_parallel.hpp>
#include <loom/train/trainer.hpp>

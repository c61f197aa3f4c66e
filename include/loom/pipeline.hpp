// <loom/pipeline.hpp>: Pipeline schedules as constexpr tables with their verifier, and the executor that runs a stage's list.
#pragma once

#include <loom/pipeline/schedule.hpp>
#include <loom/pipeline/executor.hpp>

// <loom/exec.hpp>: Typed overlap stages: resources, Stage<Resource, Op> and Pipeline<Stage...>, and the trace recorder.
#pragma once

#include <loom/core/trace.hpp>
#include <loom/exec/pipeline.hpp>

// <loom/models.hpp>: The GPT: its compile-time shape and rules, on one rank, a tensor-parallel group or a pipeline stage.
#pragma once

#include <loom/models/gpt.hpp>

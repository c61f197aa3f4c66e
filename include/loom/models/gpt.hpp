// <loom/models/gpt.hpp>: the GPT, in headers of one concept each under models/gpt/: its shape, options and rules
// (shape.hpp), its parameter table (param_table.hpp), one block (block.hpp), the activation storage and its bytes
// (activations.hpp), a rank's parameters and gradients (weights.hpp), and the model (model.hpp). What every model
// shares with the trainer is models/part.hpp's; gathering, scattering and the shared gradients of a tensor-parallel
// group models/sharding.hpp's.
#pragma once

#include <loom/models/gpt/model.hpp>

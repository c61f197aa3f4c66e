// <loom/models/gpt.hpp>: the GPT, in headers of one concept each under models/gpt/: its shape, options and rules
// (shape.hpp), its parameter table (param_table.hpp), one block (block.hpp), the activation storage and its bytes
// (activations.hpp), gathering, scattering and the shared gradients of a tensor-parallel group (sharding.hpp), and
// the model (model.hpp).
#pragma once

#include <loom/models/gpt/model.hpp>

// <loom/optim.hpp>: Optimizers over a model's flat parameter buffer (AdamW, SGD), clipping and the learning-rate warmup.
#pragma once

#include <loom/optim/optimizers.hpp>

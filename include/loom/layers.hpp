// <loom/layers.hpp>: Tensor-parallel layers: the parameter table, the conjugate operators of a region, column- and row-parallel
// linear layers, attention split by heads, the MLP, vocabulary-parallel embedding and cross-entropy.
#pragma once

#include <loom/layers/param.hpp>
#include <loom/layers/tp.hpp>
#include <loom/layers/linear.hpp>
#include <loom/layers/attention.hpp>
#include <loom/layers/mlp.hpp>
#include <loom/layers/vocab.hpp>

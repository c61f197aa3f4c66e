// loom/config.hpp: the policy algebra and the mesh: Axis, the axis policies TP, CP, DP, PP, EP, their options, and
// Parallel<...> with its constexpr rank arithmetic and process groups.
#pragma once

#include <loom/config/axis.hpp>
#include <loom/config/layout_of.hpp>
#include <loom/config/options.hpp>
#include <loom/config/parallel.hpp>
#include <loom/config/policies.hpp>

// loom/config/axis.hpp: the axes of a parallel layout (loom::Axis) and their short names (describe_axis).
#pragma once

#include <string_view>

namespace loom {

//! The axes of a parallel layout. tp, cp, dp and pp span the mesh, fastest-varying first in this order; ep and edp
//! (expert-data-parallel) are a second split of the dp x cp ranks, used by expert (MoE) layers.
enum class Axis { tp, cp, dp, pp, ep, edp };

//! The short lower-case name of an axis: "tp", "cp", "dp", "pp", "ep" or "edp".
[[nodiscard]] constexpr std::string_view describe_axis(Axis a) noexcept {
  switch (a) {
    case Axis::tp: return "tp";
    case Axis::cp: return "cp";
    case Axis::dp: return "dp";
    case Axis::pp: return "pp";
    case Axis::ep: return "ep";
    case Axis::edp: return "edp";
  }
  return "?";
}

}  // namespace loom

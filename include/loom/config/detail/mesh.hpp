// loom/config/detail/mesh.hpp (private; include <loom/config.hpp>): mixed-radix arithmetic on a four-slot mesh,
// used twice by Parallel<...>: the dense mesh (tp, cp, dp, pp) and the expert mesh (tp, ep, edp, pp).
#pragma once

#ifndef LOOM_CONFIG_PARALLEL_INCLUDED
#error "loom: config/detail/ is private: include <loom/config.hpp>"
#endif

#include <loom/config/axis.hpp>

namespace loom::detail {

// Slot 0 is fastest-varying. Slots 1 and 2 hold cp and dp in the dense mesh, ep and edp in the expert mesh; both
// meshes number the ranks identically because cp + CP*dp == ep + EP*edp.
struct MeshShape {
  int size[4]{};
  int stride[4]{};

  [[nodiscard]] constexpr int coord(int slot, int rank) const noexcept { return rank / stride[slot] % size[slot]; }

  // The rank whose coordinates on the slots in mask are zero and elsewhere those of rank.
  [[nodiscard]] constexpr int base(unsigned mask, int rank) const noexcept {
    for (int s = 0; s < 4; ++s) {
      if (mask & (1u << s)) rank -= coord(s, rank) * stride[s];
    }
    return rank;
  }

  // The offset from base() of the i-th rank of a mixed-radix count over the slots in mask, slot 0 fastest.
  [[nodiscard]] constexpr int offset(unsigned mask, int i) const noexcept {
    int off = 0;
    for (int s = 0; s < 4; ++s) {
      if (mask & (1u << s)) {
        off += (i % size[s]) * stride[s];
        i /= size[s];
      }
    }
    return off;
  }

  // The mixed-radix index of rank's coordinates on the slots in mask, slot 0 fastest (inverse of offset()).
  [[nodiscard]] constexpr int index(unsigned mask, int rank) const noexcept {
    int idx = 0;
    int radix = 1;
    for (int s = 0; s < 4; ++s) {
      if (mask & (1u << s)) {
        idx += coord(s, rank) * radix;
        radix *= size[s];
      }
    }
    return idx;
  }
};

[[nodiscard]] constexpr MeshShape make_mesh(int s0, int s1, int s2, int s3) noexcept {
  return MeshShape{{s0, s1, s2, s3}, {1, s0, s0 * s1, s0 * s1 * s2}};
}

[[nodiscard]] constexpr int slot_of(Axis a) noexcept {
  switch (a) {
    case Axis::tp: return 0;
    case Axis::cp:
    case Axis::ep: return 1;
    case Axis::dp:
    case Axis::edp: return 2;
    case Axis::pp: return 3;
  }
  return 0;
}

[[nodiscard]] constexpr bool is_expert_axis(Axis a) noexcept { return a == Axis::ep || a == Axis::edp; }

template <Axis... As>
inline constexpr unsigned slot_mask = (0u | ... | (1u << slot_of(As)));

inline constexpr unsigned all_slots = 0xFu;

}  // namespace loom::detail

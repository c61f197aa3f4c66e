// Placements: how a parameter's global tensor lies on the ranks of a tensor-parallel group. A placement is a type
// (Replicate, Shard<dim>); a Layout binds it to a global shape, the group size and a rank, and maps every local
// element to its global one, so that one declaration serves initialisation, gathering, checkpoint shapes and
// gradient reduction.
#pragma once

#include <loom/core/error.hpp>
#include <loom/tensor/tensor.hpp>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace loom {

//! Every rank of the group holds the whole tensor.
struct Replicate {
  static constexpr int dim = -1;
};

//! The tensor is split along dimension Dim; rank r holds its r-th part. The dimension may be a concatenation of
//! segments (a fused q|k|v projection), each split on its own, in units (heads): a segment of n units over t ranks
//! gives each rank n/t units; with fewer units than ranks (n < t, t % n == 0) each unit is held by t/n ranks, a
//! replicated group; with n % t != 0 (a vocabulary) rank r holds units [r·c, r·c + c) of c = ceil(n/t), the last
//! ranks fewer.
template <int Dim>
struct Shard {
  static_assert(Dim >= 0, "loom: Shard<dim> needs a dimension >= 0");
  static constexpr int dim = Dim;
};

template <class P>
concept PlacementType = std::is_same_v<P, Replicate> || std::is_same_v<P, Shard<P::dim>>;

//! A segment of a sharded dimension: `units` units of `unit` elements each.
struct Segment {
  std::int64_t units, unit = 1;
};

//! The units [first, first + count) of n that rank r of t holds, and how many ranks hold each of them.
struct UnitRange {
  std::int64_t first, count;
  int replicas;
};
constexpr UnitRange units_of(std::int64_t n, int t, int r) {
  if (n < t && t % n == 0) return {r / (t / n), 1, static_cast<int>(t / n)};
  const std::int64_t c = (n + t - 1) / t;
  const std::int64_t first = std::min<std::int64_t>(r * c, n);
  return {first, std::min<std::int64_t>(c, n - first), 1};
}

//! A placement bound to a global shape, a group of t ranks and one rank of it: the local shape, and for each
//! contiguous run of the split dimension, where it lies locally and globally.
class Layout {
 public:
  struct Run {
    std::int64_t local, global, length;  //!< along the split dimension
    int replicas;                        //!< ranks holding this run (1: sharded)
    std::int64_t shared;                 //!< with replicas > 1: where it lies in the shared extent
  };

  Layout() = default;
  Layout(Shape global, int dim, std::vector<Segment> segments, int t, int r)
      : global_(std::move(global)), dim_(dim), segments_(segments), t_(t) {
    if (dim < 0) {  // replicated: one run over the whole tensor, seen as [1, numel, 1]
      outer_ = 1, inner_ = 1, extent_ = numel_of(global_);
      runs_.push_back({0, 0, extent_, t, 0});
      shared_extent_ = t > 1 ? extent_ : 0;
      local_ = global_;
      return;
    }
    LOOM_CHECK(dim < static_cast<int>(global_.size()), "Shard<", dim, "> of a tensor of shape ", to_string(global_));
    if (segments.empty()) segments.push_back({global_[dim], 1});
    std::int64_t g = 0, l = 0, total = 0;
    for (const auto& s : segments) total += s.units * s.unit;
    LOOM_CHECK(total == global_[dim], "segments of ", total, " elements for dimension ", dim, " of shape ",
               to_string(global_));
    for (const auto& s : segments) {
      const auto u = units_of(s.units, t, r);
      if (u.count > 0)
        runs_.push_back({l, g + u.first * s.unit, u.count * s.unit, u.replicas, shared_extent_ + u.first * s.unit});
      if (u.replicas > 1) shared_extent_ += s.units * s.unit;
      l += u.count * s.unit;
      g += s.units * s.unit;
    }
    outer_ = 1, inner_ = 1;
    for (int i = 0; i < dim; ++i) outer_ *= global_[i];
    for (std::size_t i = dim + 1; i < global_.size(); ++i) inner_ *= global_[i];
    extent_ = l;
    local_ = global_;
    local_[dim] = l;
  }

  //! The same placement on another rank of the group.
  Layout for_rank(int r) const { return Layout(global_, dim_, segments_, t_, r); }

  const Shape& global_shape() const { return global_; }
  const Shape& local_shape() const { return local_; }
  int dim() const { return dim_; }
  std::int64_t local_numel() const { return outer_ * extent_ * inner_; }
  const std::vector<Run>& runs() const { return runs_; }
  //! The elements held by more than one rank (a replicated tensor, or the replicated segments of a shard), seen as
  //! one tensor of outer x shared_extent() x inner elements that every rank of the group can index alike.
  std::int64_t shared_extent() const { return shared_extent_; }
  std::int64_t shared_numel() const { return outer_ * shared_extent_ * inner_; }

  //! Calls f(local_offset, shared_offset, length) for every contiguous local piece held by more than one rank.
  template <class F>
  void for_each_shared_piece(F&& f) const {
    for (std::int64_t o = 0; o < outer_; ++o)
      for (const auto& run : runs_)
        if (run.replicas > 1) f((o * extent_ + run.local) * inner_, (o * shared_extent_ + run.shared) * inner_,
                                run.length * inner_);
  }

  //! Calls f(local_offset, global_offset, length) for every contiguous piece of the local tensor, or
  //! f(local_offset, global_offset, length, replicas) with the number of ranks that hold the piece.
  template <class F>
  void for_each_piece(F&& f) const {
    const std::int64_t global_extent = dim_ < 0 ? extent_ : global_[dim_];
    for (std::int64_t o = 0; o < outer_; ++o)
      for (const auto& run : runs_) {
        const std::int64_t l = (o * extent_ + run.local) * inner_, g = (o * global_extent + run.global) * inner_;
        if constexpr (std::is_invocable_v<F, std::int64_t, std::int64_t, std::int64_t>) f(l, g, run.length * inner_);
        else f(l, g, run.length * inner_, run.replicas);
      }
  }

  //! Copies this rank's part of a global tensor into local.
  template <class T>
  void scatter(const T* global, T* local) const {
    for_each_piece([&](std::int64_t l, std::int64_t g, std::int64_t n) { std::copy_n(global + g, n, local + l); });
  }
  //! Writes this rank's part into a global tensor (other elements untouched).
  template <class T>
  void place(const T* local, T* global) const {
    for_each_piece([&](std::int64_t l, std::int64_t g, std::int64_t n) { std::copy_n(local + l, n, global + g); });
  }

 private:
  Shape global_, local_;
  int dim_ = -1;
  std::vector<Segment> segments_;
  int t_ = 1;
  std::int64_t outer_ = 1, inner_ = 1, extent_ = 0, shared_extent_ = 0;
  std::vector<Run> runs_;
};

}  // namespace loom

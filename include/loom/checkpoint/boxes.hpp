// Boxes: the pieces of a tensor that a sharded checkpoint stores and reads. A box is a rectangular block of a
// tensor's elements, given by its offsets and sizes along each dimension, stored in row-major order. A rank's part of
// a parameter (a run of its tensor-parallel layout, tensor/placement.hpp) is a box; what data parallelism or ZeRO
// gives it of that part is a window of the box's row-major order, which split_window cuts into boxes again.
#pragma once

#include <loom/core/error.hpp>
#include <loom/tensor/placement.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace loom::checkpoint {

//! Elements [offsets[d], offsets[d] + sizes[d]) along each dimension d of a tensor.
struct Box {
  std::vector<std::int64_t> offsets, sizes;

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : sizes) n *= s;
    return n;
  }
  friend bool operator==(const Box&, const Box&) = default;
};

//! The whole of a tensor of shape `shape`.
inline Box whole_box(const Shape& shape) { return {std::vector<std::int64_t>(shape.size(), 0), shape}; }

//! The elements both boxes hold; none when they do not meet.
inline std::optional<Box> intersect(const Box& a, const Box& b) {
  LOOM_CHECK(a.offsets.size() == b.offsets.size(), "boxes of ", a.offsets.size(), " and ", b.offsets.size(),
             " dimensions");
  Box out;
  for (std::size_t d = 0; d < a.offsets.size(); ++d) {
    const std::int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const std::int64_t hi = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    if (lo >= hi) return std::nullopt;
    out.offsets.push_back(lo);
    out.sizes.push_back(hi - lo);
  }
  return out;
}

//! Where the element at (global) coordinates `at` lies in box b's row-major order.
inline std::int64_t flat_in(const Box& b, const std::vector<std::int64_t>& at) {
  std::int64_t k = 0;
  for (std::size_t d = 0; d < b.sizes.size(); ++d) k = k * b.sizes[d] + (at[d] - b.offsets[d]);
  return k;
}

namespace detail {
template <class F>
void split_window(std::vector<std::int64_t>& off, std::vector<std::int64_t>& size, std::size_t d,
                  const Box& b, std::int64_t lo, std::int64_t hi, F& f) {
  if (lo >= hi) return;
  std::int64_t row = 1;  // elements per index along dimension d
  for (std::size_t e = d + 1; e < b.sizes.size(); ++e) row *= b.sizes[e];
  auto emit = [&](std::int64_t first, std::int64_t count) {  // whole rows [first, first + count) of dimension d
    auto o = off, s = size;
    o[d] = b.offsets[d] + first;
    s[d] = count;
    for (std::size_t e = d + 1; e < b.sizes.size(); ++e) o[e] = b.offsets[e], s[e] = b.sizes[e];
    f(Box{std::move(o), std::move(s)});
  };
  auto partial = [&](std::int64_t r, std::int64_t a, std::int64_t z) {  // elements [a, z) of row r
    auto o = off, s = size;
    o[d] = b.offsets[d] + r;
    s[d] = 1;
    split_window(o, s, d + 1, b, a, z, f);
  };
  std::int64_t r0 = lo / row;
  const std::int64_t r1 = hi / row;
  if (r0 == r1) return partial(r0, lo - r0 * row, hi - r0 * row);
  if (lo % row) partial(r0, lo % row, row), ++r0;
  if (r0 < r1) emit(r0, r1 - r0);
  if (hi % row) partial(r1, 0, hi % row);
}
}  // namespace detail

//! Calls f(Box) for the boxes that together hold elements [lo, hi) of box b's row-major order, in that order; at
//! most 2·dims - 1 of them.
template <class F>
void split_window(const Box& b, std::int64_t lo, std::int64_t hi, F&& f) {
  LOOM_CHECK(0 <= lo && lo <= hi && hi <= b.numel(), "window [", lo, ", ", hi, ") of a box of ", b.numel(),
             " elements");
  if (lo == hi) return;
  if (b.sizes.empty()) return f(b);
  auto off = b.offsets, size = b.sizes;
  detail::split_window(off, size, 0, b, lo, hi, f);
}

//! Calls f(at, length) for each row of box b (a run along its last dimension): `at` holds the row's first element's
//! coordinates. A box of no dimensions is one row of one element.
template <class F>
void for_each_row(const Box& b, F&& f) {
  const std::size_t dims = b.sizes.size();
  std::vector<std::int64_t> at = b.offsets;
  if (dims == 0) return f(at, std::int64_t{1});
  for (;;) {
    f(at, b.sizes.back());
    std::size_t d = dims - 1;
    for (;;) {  // the next row: advance the dimensions before the last like an odometer
      if (d == 0) return;
      --d;
      if (++at[d] < b.offsets[d] + b.sizes[d]) break;
      at[d] = b.offsets[d];
    }
  }
}

//! One run of a parameter's tensor-parallel layout as a box of the whole parameter, and where its elements lie in
//! the rank's part of it: element k of the box (row-major) is element local(k) of the part (row-major).
struct RunBox {
  Box box;
  std::int64_t slab;    //!< elements of the box per index of the dimensions before the split one
  std::int64_t stride;  //!< elements of the part per such index
  std::int64_t start;   //!< where the box's first element lies in the part
  int replicas;         //!< tensor-parallel ranks that hold the run

  std::int64_t local(std::int64_t k) const { return start + k / slab * stride + k % slab; }
  //! The first element of the box, in row-major order, that lies at or after element x of the part (numel() when
  //! none does).
  std::int64_t first_at_or_after(std::int64_t x) const {
    const std::int64_t n = box.numel();
    if (x <= start) return 0;
    const std::int64_t o = (x - start) / stride, r = (x - start) % stride;
    return std::min(n, r < slab ? o * slab + r : (o + 1) * slab);
  }
};

//! The runs of a parameter's layout as boxes (one box for a replicated parameter).
inline std::vector<RunBox> run_boxes(const Layout& l) {
  std::vector<RunBox> out;
  const Shape& g = l.global_shape();
  if (l.dim() < 0) {
    const auto n = numel_of(g);
    out.push_back({whole_box(g), std::max<std::int64_t>(n, 1), std::max<std::int64_t>(n, 1), 0,
                   l.runs().empty() ? 1 : l.runs().front().replicas});
    return out;
  }
  const auto d = static_cast<std::size_t>(l.dim());
  std::int64_t inner = 1;
  for (std::size_t e = d + 1; e < g.size(); ++e) inner *= g[e];
  const std::int64_t extent = l.local_shape()[d];
  for (const auto& run : l.runs()) {
    Box b = whole_box(g);
    b.offsets[d] = run.global;
    b.sizes[d] = run.length;
    out.push_back({std::move(b), run.length * inner, extent * inner, run.local * inner, run.replicas});
  }
  return out;
}

//! Whether tensor-parallel rank `rank` is the first of the ranks that hold this run of the layout (the one that
//! writes it).
inline bool first_holder(const Layout& l, const RunBox& run, int rank) {
  if (run.replicas <= 1) return true;
  for (int r = 0; r < rank; ++r)
    for (const auto& other : run_boxes(l.for_rank(r)))
      if (other.box == run.box) return false;
  return true;
}

}  // namespace loom::checkpoint

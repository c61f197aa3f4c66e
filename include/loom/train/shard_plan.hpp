// Which elements of a model part's flat buffers a data-parallel rank owns under ZeRO (ShardPlan), and how what it
// does not own is offered back to the system while it is not held (offer_pages).
#pragma once

#include <loom/layers/param.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data_parallel.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace loom::train {

//! Which elements of a model part's flat buffer one data-parallel rank owns under ZeRO: chunk `rank` of each bucket.
struct ShardPlan {
  //! One bucket as it is reduce-scattered: elements [lo, hi) of the flat buffer in `ranks` chunks of `chunk`
  //! elements (the last ones padded); this rank's part of it, [own_lo, own_hi), is at `at` in the shard. experts:
  //! the bucket is the experts' and sharded over the expert-data-parallel group.
  struct Piece {
    std::int64_t lo, hi, chunk, own_lo, own_hi, at;
    bool experts = false;
    std::int64_t own() const { return own_hi - own_lo; }
    bool padded(int ranks) const { return chunk * ranks != hi - lo; }
  };
  //! Elements [at, at + n) of the part's flat gradient buffer, weighted in the global norm's sum of squares.
  struct NormRun {
    std::int64_t at, n;
    double weight;
  };

  std::vector<Piece> pieces;           //!< in the order of the buckets (the order backward completes them)
  std::vector<optim::Slice> slices;    //!< what the optimizer updates: the shard, by parameter
  std::vector<NormRun> norm;           //!< the shard's terms of the global norm
  std::int64_t numel = 0;              //!< elements of the shard

  //! Rank `rank` of `ranks`, over a part with parameters `specs` in `buckets`; the parameter at flat offset
  //! `uncounted` (the tied table, where another part counts it) stays out of the norm; -1: none does. The experts'
  //! buckets are sharded as rank expert_rank of expert_ranks (the expert-data-parallel group), when given.
  ShardPlan(const std::vector<Bucket>& buckets, const std::vector<layers::ParamSpec>& specs, int ranks, int rank,
            std::int64_t uncounted = -1, int expert_ranks = 0, int expert_rank = 0) {
    for (const auto& b : buckets) {
      const bool experts = b.expert && expert_ranks > 0;
      const int n = experts ? expert_ranks : ranks, r = experts ? expert_rank : rank;
      const std::int64_t len = b.hi - b.lo, chunk = (len + n - 1) / n;
      const std::int64_t own_lo = std::min(b.hi, b.lo + r * chunk), own_hi = std::min(b.hi, own_lo + chunk);
      pieces.push_back({b.lo, b.hi, chunk, own_lo, own_hi, numel, experts});
      numel += own_hi - own_lo;
    }
    for (const auto& p : pieces)
      for (std::size_t i = 0; i < specs.size(); ++i) {
        const auto& s = specs[i];
        const std::int64_t lo = std::max(p.own_lo, s.offset), hi = std::min(p.own_hi, s.offset + numel_of(s.shape));
        if (lo >= hi) continue;
        const std::int64_t at = p.at + (lo - p.own_lo);
        slices.push_back({lo, at, hi - lo, s.decay});
        if (s.offset == uncounted) continue;
        // Each piece of the parameter's tensor-parallel layout that meets the shard, weighted 1 / its replicas.
        s.layout.for_each_piece([&](std::int64_t l, std::int64_t, std::int64_t n, int replicas) {
          const std::int64_t a = std::max(lo, s.offset + l), z = std::min(hi, s.offset + l + n);
          if (a < z) norm.push_back({a, z - a, 1.0 / replicas});
        });
      }
  }
};

//! Lets the system take back the whole pages of elements [lo, hi) of w when it needs memory (MADV_FREE: until then
//! they stay, and writing them again costs nothing; whoever holds them again writes them before reading).
template <class T>
void offer_pages(T* w, std::int64_t lo, std::int64_t hi) {
#ifdef MADV_FREE
  static const std::uintptr_t page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto a = reinterpret_cast<std::uintptr_t>(w + lo), z = reinterpret_cast<std::uintptr_t>(w + hi);
  const std::uintptr_t first = (a + page - 1) / page * page, last = z / page * page;
  if (first < last) madvise(reinterpret_cast<void*>(first), last - first, MADV_FREE);  // a hint: failure is harmless
#else
  (void)w, (void)lo, (void)hi;
#endif
}

}  // namespace loom::train

// ZeRO-3's parameters: a model part's flat parameter buffer of which a data-parallel rank holds its chunk of every
// unit (ShardPlan's pieces, one per unit: the embedding, each block, the final norm; a block with experts is two,
// its experts' chunks over the expert-data-parallel group) and, for a while, the units it has gathered. A unit is
// gathered (all-gathered from the chunks of its owners) before a forward unit or backward chunk reads it and
// released after the last one that reads it: the ledger is charged for what is held, and on the host the released
// whole pages are offered back to the system (madvise(MADV_FREE)). The buffer is made whole and
// uncounted (UncountedMemoryScope); this class charges the rank's ledger for its chunks and what it gathers (on the
// host: the ledger counts host memory, and a device's tensors are not in it).
#pragma once

#include <loom/comm/communicator.hpp>
#include <loom/core/memory.hpp>
#include <loom/layers/param.hpp>
#include <loom/models/part.hpp>
#include <loom/train/shard_plan.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace loom::train {

template <class Model, class Comm>
class ShardedParameters {
 public:
  using T = typename Model::value_type;
  using Buf = typename std::remove_cvref_t<decltype(std::declval<Model&>().params())>;

  //! The parameters of `model` over the data-parallel group `comm`, sharded as plan's pieces (the part's units, in
  //! the order of unit_of's indices: unit_of[p] is parameter p's piece); the experts' pieces over `experts`, the
  //! expert-data-parallel group, with expert parallelism.
  ShardedParameters(Model& model, Comm& comm, const ShardPlan& plan, const std::vector<std::size_t>& unit_of,
                    Comm* experts = nullptr)
      : model_(model), comm_(comm), experts_(experts), plan_(plan), unit_of_(unit_of), ledger_(rank_memory_ledger()),
        gathered_(plan.pieces.size(), 0), send_(plan.pieces.size()), staged_(plan.pieces.size()) {
    if constexpr (counted) ledger_->debit(MemoryUse::parameters, own_bytes());
    for (std::size_t u = 0; u < plan_.pieces.size(); ++u) release_pages(u);
  }
  ~ShardedParameters() {
    std::size_t held = own_bytes();
    for (std::size_t u = 0; u < gathered_.size(); ++u)
      if (gathered_[u]) held += other_bytes(u);
    if constexpr (counted) ledger_->credit(MemoryUse::parameters, held);
  }
  ShardedParameters(const ShardedParameters&) = delete;
  ShardedParameters& operator=(const ShardedParameters&) = delete;

  std::size_t units() const { return plan_.pieces.size(); }
  bool gathered(std::size_t u) const { return gathered_[u] != 0; }
  //! The units holding parameters [r.first, r.last) and r.also, ascending.
  std::vector<std::size_t> units_of(models::ParamRange r) const {
    std::vector<std::size_t> out;
    auto add = [&](std::size_t p) {
      if (std::find(out.begin(), out.end(), unit_of_[p]) == out.end()) out.push_back(unit_of_[p]);
    };
    for (std::size_t p = r.first; p < r.last; ++p) add(p);
    if (r.also != models::no_param) add(r.also);
    std::sort(out.begin(), out.end());
    return out;
  }

  //! The mark after a prepare()'s copies: an event on a device (what Model's ops().mark() gives).
  using Mark = decltype(std::declval<Model&>().ops().mark());

  //! Starts the all-gather of each of `us` (charged to the ledger from here; beyond the cap, throws), sending this
  //! rank's chunk from a copy; finish(us) completes them once the handles have. prepare(us), then launch(us) once
  //! its mark has passed.
  comm::Handles start(std::span<const std::size_t> us) {
    prepare(us).wait();
    return launch(us);
  }
  //! The first half of start(us), on the thread that queues the model's kernels: the units charged and marked
  //! gathered, what their gathers send and receive into made, and this rank's chunks copied into what is sent, on
  //! the model's stream after the kernels queued so far. The mark it returns follows those copies: once it has
  //! passed, launch(us) may run the gathers on the communicator's stream (the buffers, made before it was recorded,
  //! are no longer read by any kernel queued before). On a device this lets a gather wait for the kernels queued
  //! before it was prepared, not for those the model queues while the gather waits to start.
  Mark prepare(std::span<const std::size_t> us) {
    const auto& ops = model_.ops();
    for (std::size_t u : us) {
      const auto& p = plan_.pieces[u];
      Comm& comm = p.experts && experts_ ? *experts_ : comm_;
      const int n = comm.size();
      LOOM_CHECK(!gathered_[u], "ZeRO-3: unit ", u, " is gathered twice");
      if constexpr (counted) ledger_->debit(MemoryUse::parameters, other_bytes(u));
      gathered_[u] = 1;
      const std::size_t chunk = static_cast<std::size_t>(p.chunk);
      const T* params = model_.params().data();
      MemoryUseScope use(MemoryUse::communication);
      send_[u] = Buf({std::max<std::int64_t>(1, p.chunk)});
      ops.copy(params + p.own_lo, send_[u].data(), static_cast<std::size_t>(p.own()));
      if (p.own() < p.chunk) ops.fill(send_[u].data() + p.own(), chunk - static_cast<std::size_t>(p.own()), T(0));
      if (p.padded(n)) staged_[u] = Buf({p.chunk * n});
    }
    return ops.mark();
  }
  //! The second half of start(us), once prepare(us)'s mark has passed: the gathers, left running.
  comm::Handles launch(std::span<const std::size_t> us) {
    comm::Handles hs;
    for (std::size_t u : us) {
      const auto& p = plan_.pieces[u];
      Comm& comm = p.experts && experts_ ? *experts_ : comm_;
      const int n = comm.size();
      const std::size_t chunk = static_cast<std::size_t>(p.chunk), len = static_cast<std::size_t>(p.hi - p.lo);
      T* params = model_.params().data();
      const std::span<const T> send(send_[u].data(), chunk);
      if (p.padded(n)) {
        hs.all.push_back(comm.all_gather_async(send, std::span<T>(staged_[u].data(), chunk * std::size_t(n))));
      } else {
        hs.all.push_back(comm.all_gather_async(send, std::span<T>(params + p.lo, len)));
      }
    }
    return hs;
  }
  //! After start(us)'s handles completed: puts padded units in place and frees what the gathers used.
  void finish(std::span<const std::size_t> us) {
    for (std::size_t u : us) {
      const auto& p = plan_.pieces[u];
      if (staged_[u].data() != nullptr)
        model_.ops().copy(staged_[u].data(), model_.params().data() + p.lo, static_cast<std::size_t>(p.hi - p.lo));
      send_[u] = Buf();
      staged_[u] = Buf();
    }
  }
  //! Gathers units `us` and waits.
  void gather(std::span<const std::size_t> us) {
    start(us).wait();
    finish(us);
  }
  //! Gathers every unit not held (a collective: the same on every rank, whose units are held alike).
  void gather_all() {
    std::vector<std::size_t> us;
    for (std::size_t u = 0; u < units(); ++u)
      if (!gathered_[u]) us.push_back(u);
    gather(us);
  }
  //! Unit u's parameters but this rank's chunk: no longer held.
  void release(std::size_t u) {
    if (!gathered_[u]) return;
    gathered_[u] = 0;
    if constexpr (counted) ledger_->credit(MemoryUse::parameters, other_bytes(u));
    release_pages(u);
  }
  void release_all() {
    for (std::size_t u = 0; u < units(); ++u) release(u);
  }

 private:
  std::size_t own_bytes() const {
    std::size_t b = 0;
    for (const auto& p : plan_.pieces) b += static_cast<std::size_t>(p.own()) * sizeof(T);
    return b;
  }
  std::size_t other_bytes(std::size_t u) const {
    const auto& p = plan_.pieces[u];
    return static_cast<std::size_t>(p.hi - p.lo - p.own()) * sizeof(T);
  }
  void release_pages(std::size_t u) {
    if constexpr (kernels::is_host_v<typename Buf::device>) {
      const auto& p = plan_.pieces[u];
      T* w = model_.params().data();
      offer_pages(w, p.lo, p.own_lo);
      offer_pages(w, p.own_hi, p.hi);
    }
  }

  Model& model_;
  Comm& comm_;
  Comm* experts_;  //!< with expert parallelism: the experts' pieces' group
  const ShardPlan& plan_;
  const std::vector<std::size_t>& unit_of_;  //!< the owner's, as plan_
  std::shared_ptr<MemoryLedger> ledger_;
  //! Whether the ledger counts the parameters: host memory (a device's tensors are not counted, as Tensor's are not).
  static constexpr bool counted = kernels::is_host_v<typename Buf::device>;
  std::vector<char> gathered_;  //!< per unit: held whole (set by prepare, cleared by release, after it was read)
  std::vector<Buf> send_, staged_;  //!< per unit being gathered: the chunk sent, and a padded unit's whole copy
};

}  // namespace loom::train

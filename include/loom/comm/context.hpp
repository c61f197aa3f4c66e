// A rank's view of the mesh of a Parallel configuration on one backend: its rank and coordinates, and a
// communicator for each group of one or several axes (tp, dp, dp x cp, ...) or the whole world.
#pragma once

#include <loom/comm/types.hpp>
#include <loom/config/axis.hpp>

#include <atomic>
#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace loom {

//! Backend is Local, Mpi or Nccl (namespace loom::comm): it names the communicator type and how one rank makes
//! communicators. The first request for a group's communicator is collective over that group's ranks (Mpi, Nccl).
template <class Cfg, class Backend>
class Context {
 public:
  using config = Cfg;
  using backend = Backend;
  using Comm = typename Backend::Comm;
  static constexpr int world_size = Cfg::world_size;

  explicit Context(typename Backend::Rank r) : r_(std::move(r)) {}
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int rank() const { return r_.rank; }
  template <Axis A>
  int coord() const { return Cfg::template coord<A>(rank()); }

  //! The communicator of this rank's group over the given axes: comm<Axis::tp>(), comm<Axis::dp, Axis::cp>().
  //! After the first call for a list of axes, an index into this rank's table.
  template <Axis... A>
  Comm& comm() {
    static_assert(sizeof...(A) > 0, "loom: comm<...>() needs at least one axis; use world() for all ranks");
    static const std::size_t slot = next_slot();  // one per list of axes, the same in every Context of Cfg
    if (slot < by_axes_.size() && by_axes_[slot]) return *by_axes_[slot];
    const auto members = Cfg::template group<A...>(rank());
    std::string name;
    ((name += (name.empty() ? "" : "."), name += describe_axis(A)), ...);
    Comm& c = get(comm::GroupInfo{name, std::vector<int>(members.begin(), members.end())});
    if (slot >= by_axes_.size()) by_axes_.resize(slot + 1, nullptr);
    by_axes_[slot] = &c;
    return c;
  }

  //! The communicator over every rank.
  Comm& world() {
    std::vector<int> all(world_size);
    for (int i = 0; i < world_size; ++i) all[i] = i;
    return get(comm::GroupInfo{"world", all});
  }

  //! The communicator of a group: an explicit set of global ranks, ascending, including this rank, and its name.
  //! Groups of the same ranks under different names are different communicators (the expert-parallel group may
  //! be the data-parallel group's ranks, and their collectives run at once from different threads).
  Comm& get(const comm::GroupInfo& g) {
    auto& c = comms_[{g.name, g.ranks}];
    if (!c) c = r_.make(g);
    return *c;
  }

  typename Backend::Rank& backend_rank() { return r_; }

 private:
  static std::size_t next_slot() {
    static std::atomic<std::size_t> n{0};
    return n++;
  }

  typename Backend::Rank r_;
  std::map<std::pair<std::string, std::vector<int>>, std::unique_ptr<Comm>> comms_;
  std::vector<Comm*> by_axes_;  // comm<A...>()'s communicators, by the slot of A...
};

}  // namespace loom

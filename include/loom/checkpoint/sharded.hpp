// Sharded checkpoints: every rank writes only what it owns, and any layout reads what it needs.
//
// A checkpoint is a directory ROOT/step-NNNNNNNN holding one safetensors file per writing rank (rank-RRRRR.safetensors)
// and index.json. The index records, for every tensor of the whole model (the parameters by their Hugging Face
// names, each optimizer state as "<state>/<parameter>", e.g. "adamw.exp_avg/h.0.attn.c_attn.weight"), its global
// shape and dtype and the chunks that hold it: boxes of the tensor (offsets and sizes along each dimension), each with
// its file, its byte offset there and a CRC-32 of every block of `block` bytes. With it the step, the optimizer and its
// counter, the layout and model shape it was written on, and whatever the caller records under "run" (the schedule,
// the data position, the random seed).
//
// What a rank writes: its tensor-parallel part of each parameter (a part held by several tensor-parallel ranks is
// written by the first), of its pipeline parts (the tied table by the part with the embedding), restricted to the
// elements it writes over data parallelism (Holding::written: under ZeRO its shard, written once over hybrid
// replicas; otherwise an even share of the replicated buffers). Nothing is written twice.
//
// Writing is atomic: every rank takes its chunks (snapshot_into), writes and fsyncs its file into
// ROOT/.step-NNNNNNNN.tmp (write_snapshot); once every rank has, rank 0 puts the ranks' manifests together into
// index.json, fsyncs it, renames the directory into place, and then points ROOT/latest at it (commit_snapshot). A
// crash leaves the previous checkpoint and `latest` as they were. save_sharded does it all in place; CheckpointWriter
// can write in a background thread while training goes on.
//
// Reading: a rank computes the boxes it holds on its own layout and, for each, the chunks that meet it; it reads the
// checksum blocks that hold those bytes (one block in memory at a time), verifies each, and copies the elements
// straight into its parameters and optimizer state. It never holds more of the model than its own part.
//
// The headers by concern: sharded_format.hpp (the index), sharded_io.hpp (fsynced files, verified reads),
// sharded_writer.hpp (snapshots, their commit, the background writer); this one adapts them to a train::Trainer
// (what a rank writes of it, and loading into it).
#pragma once

#include <loom/checkpoint/sharded_writer.hpp>
#include <loom/checkpoint/training.hpp>
#include <loom/train/trainer.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace loom::checkpoint {

namespace detail {

//! Calls f(k, n) for the runs [k, k + n) of box-order elements [lo, hi) of `run` that are contiguous in the part.
template <class F>
void each_contiguous(const RunBox& run, std::int64_t lo, std::int64_t hi, F&& f) {
  for (std::int64_t k = lo; k < hi;) {
    const std::int64_t n = std::min(hi, (k / run.slab + 1) * run.slab) - k;
    f(k, n);
    k += n;
  }
}

//! The boxes of `run` that hold elements [lo, hi) of the part (a range Holding gives, relative to the parameter),
//! each with where it starts in the run's box order.
inline std::vector<std::pair<Box, std::int64_t>> boxes_in(const RunBox& run, std::int64_t lo, std::int64_t hi) {
  std::vector<std::pair<Box, std::int64_t>> out;
  std::int64_t at = run.first_at_or_after(lo);
  split_window(run.box, at, run.first_at_or_after(hi), [&](Box b) {
    const auto n = b.numel();
    out.emplace_back(std::move(b), at);
    at += n;
  });
  return out;
}

//! [first, last) element ranges of a part's buffer.
using Ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;
//! The ranges of a part's parameters that `held` lists, and of an optimizer state laid out as its shard (at).
inline Ranges param_ranges(const std::vector<train::Holding::Range>& held) {
  Ranges r;
  for (const auto& w : held) r.emplace_back(w.lo, w.hi);
  return r;
}
inline Ranges state_ranges(const std::vector<train::Holding::Range>& held) {
  Ranges r;
  for (const auto& w : held) r.emplace_back(w.at, w.at + (w.hi - w.lo));
  return r;
}

//! A host copy of some ranges of a device buffer of n elements of U (a part's parameters, or an optimizer state),
//! laid out as the buffer: only the ranges are copied, and the rest is left uninitialised, so that the pages of a large
//! buffer (which the allocator maps from the system) that lie outside them are never touched and a rank's host holds
//! what it writes or reads of its part, not the whole part (without ZeRO a data-parallel rank writes a 1/dp share).
//! Charged to the ledger, as checkpoint buffers, for what it copies.
template <class U>
class HostRanges {
 public:
  HostRanges() = default;
  template <class Ops>
  HostRanges(const Ops& ops, const U* device, std::size_t n, Ranges ranges)
      : bytes_(new std::byte[std::max<std::size_t>(n, 1) * sizeof(U)]), ranges_(std::move(ranges)) {
    std::size_t copied = 0;
    for (const auto& [lo, hi] : ranges_) {
      LOOM_CHECK(0 <= lo && lo <= hi && static_cast<std::size_t>(hi) <= n, "a checkpoint range [", lo, ", ", hi,
                 ") lies outside a buffer of ", n, " elements");
      ops.to_host(device + lo, data() + lo, static_cast<std::size_t>(hi - lo));
      copied += static_cast<std::size_t>(hi - lo) * sizeof(U);
    }
    charge_ = ChargedBytes(MemoryUse::checkpoint, copied);
  }
  U* data() const { return reinterpret_cast<U*>(bytes_.get()); }
  //! The ranges, back into the device buffer.
  template <class Ops>
  void back(const Ops& ops, U* device) const {
    for (const auto& [lo, hi] : ranges_) ops.from_host(data() + lo, device + lo, static_cast<std::size_t>(hi - lo));
  }

 private:
  std::unique_ptr<std::byte[]> bytes_;  // default-initialised: the pages outside the ranges stay untouched
  Ranges ranges_;
  ChargedBytes charge_;
};

}  // namespace detail

//! What a sharded checkpoint reads and writes of a trainer, whatever its model (view_of): each part's parameter
//! table and buffers, what the rank holds of them (train::Holding) and its optimizer; the world; the model's
//! configuration (model_config). The writing and loading below are compiled once per element type, device and
//! optimizer over it, not once per model.
template <class T, class Dev, class Optimizer>
struct TrainerView {
  struct Part {
    const std::vector<layers::ParamSpec>* specs;
    Tensor<T, Dev>* params;
    const kernels::Ops<Dev>* ops;
    bool embedding;
    int tp_rank;
    train::Holding held;
    Optimizer* optimizer;
  };
  std::vector<Part> parts;
  int world_rank = 0, world_size = 1;
  std::function<void()> barrier;
  nlohmann::json model;  //!< model_config of the rank's first part
};

//! The view of `trainer` that sharded checkpoints read and write (the trainer must outlive it).
template <class Model, class Optimizer>
TrainerView<typename Model::value_type, typename Model::device, Optimizer> view_of(
    train::TrainerOf<Model, Optimizer>& trainer) {
  static_assert(checkpointable<typename train::TrainerOf<Model, Optimizer>::Part>());
  using T = typename Model::value_type;
  using Dev = typename Model::device;
  TrainerView<T, Dev, Optimizer> v;
  for (std::size_t c = 0; c < trainer.parts().size(); ++c) {
    auto& part = *trainer.parts()[c];
    v.parts.push_back({&part.specs(), const_cast<Tensor<T, Dev>*>(&part.params()), &part.ops(), part.embedding(),
                       part.tp_rank(), trainer.holding(c), &trainer.optimizers()[c]});
  }
  v.world_rank = trainer.world_rank(), v.world_size = trainer.world_size();
  v.barrier = [&trainer] { trainer.barrier(); };
  const auto& front = *trainer.parts().front();
  // (as nlohmann::json, the index's own kind: comparing the two kinds is ambiguous to some compilers)
  v.model = nlohmann::json::parse(model_config(front).dump());
  return v;
}

//! Copies what this rank writes of `trainer` (its chunks of every parameter and optimizer state) to host memory,
//! charged to its ledger as checkpoint buffers, into `snap`, whose buffers it reuses (a writer that saves again and
//! again allocates them once). No communication: training may change the trainer once it returns. With copy = false
//! (on the host) it records where the chunks are instead, and write_snapshot copies each as it writes it: the
//! trainer must not change until then (a save in place holds one chunk at a time).
template <class T, class Dev, class Optimizer>
void snapshot_into(Snapshot& snap, const std::string& root, const TrainerView<T, Dev, Optimizer>& trainer,
                   int next_step, const std::string& layout, const nlohmann::json& run = nullptr,
                   std::int64_t block = checksum_block, bool copy = true) {
  using A = loom::acc_t<T>;
  LOOM_CHECK(block > 0, "the checksum block must be positive, got ", block);
  std::vector<detail::Written> before = std::move(snap.chunks);  // their buffers, to reuse in order
  snap.chunks.clear();
  snap.header = nlohmann::ordered_json();
  snap.block = block;
  snap.root = root, snap.name = detail::step_name(next_step), snap.next_step = next_step;
  snap.rank = trainer.world_rank, snap.world_size = trainer.world_size;
  // This rank's chunks: of each part, each parameter's runs it writes, within the ranges it writes.
  std::vector<detail::Written>& chunks = snap.chunks;
  for (const auto& part : trainer.parts) {
    const train::Holding& held = part.held;
    // On a GPU: host copies of what the rank writes of the part, while its chunks are cut.
    detail::HostRanges<T> host;
    const T* params = part.params->data();
    if constexpr (!kernels::is_host_v<Dev>) {
      host = detail::HostRanges<T>(*part.ops, params, static_cast<std::size_t>(part.params->numel()),
                                   detail::param_ranges(held.written));
      params = host.data();
    }
    const auto states = part.optimizer->state();
    std::vector<detail::HostRanges<A>> state_host(states.size());
    std::vector<const A*> state(states.size());
    for (std::size_t k = 0; k < states.size(); ++k) {
      state[k] = states[k].second.data();
      if constexpr (!kernels::is_host_v<Dev>) {
        state_host[k] = detail::HostRanges<A>(*part.ops, state[k], static_cast<std::size_t>(states[k].second.numel()),
                                              detail::state_ranges(held.written));
        state[k] = state_host[k].data();
      }
    }
    for (const auto& s : *part.specs) {
      if (s.index == 0 && !part.embedding) continue;  // the tied table: written by the part with the embedding
      const std::int64_t n = numel_of(s.shape);
      for (const auto& run : run_boxes(s.layout)) {
        if (!first_holder(s.layout, run, part.tp_rank)) continue;
        for (const auto& w : held.written) {
          const std::int64_t lo = std::max(w.lo, s.offset), hi = std::min(w.hi, s.offset + n);
          if (lo >= hi) continue;
          for (const auto& [box, at] : detail::boxes_in(run, lo - s.offset, hi - s.offset)) {
            const std::int64_t end = at + box.numel();
            // The chunk's bytes from `base` (its element x of the part's flat buffer is base + x).
            auto pack = [&](const std::string& tensor, DType dtype, std::size_t esize, const char* base) {
              detail::Written out{tensor, dtype, s.layout.global_shape(), box,
                                  static_cast<std::size_t>(box.numel()) * esize, {}, {}};
              out.fill = [run, at, end, esize, base, offset = s.offset](char* dst) {
                detail::each_contiguous(run, at, end, [&](std::int64_t k, std::int64_t len) {
                  const auto x = static_cast<std::size_t>(offset + run.local(k));
                  std::memcpy(dst, base + x * esize, static_cast<std::size_t>(len) * esize);
                  dst += len * static_cast<std::int64_t>(esize);
                });
              };
              if (copy || !kernels::is_host_v<Dev>) {  // a GPU's part is in `host` for now
                if (chunks.size() < before.size()) out.data = std::move(before[chunks.size()].data);
                out.data.resize(out.bytes);
                out.fill(out.data.data());
                out.fill = nullptr;
              }
              chunks.push_back(std::move(out));
            };
            pack(s.name, dtype_of<T>, sizeof(T), reinterpret_cast<const char*>(params));
            for (std::size_t k = 0; k < states.size(); ++k)  // the state of range w starts at w.at, element w.lo
              pack(states[k].first + "/" + s.name, dtype_of<A>, sizeof(A),
                   reinterpret_cast<const char*>(state[k] + w.at) - w.lo * static_cast<std::int64_t>(sizeof(A)));
          }
        }
      }
    }
  }
  std::size_t copied = 0;
  for (const auto& w : chunks)
    if (!w.fill) copied += w.data.capacity();
  snap.charge = ChargedBytes();  // released before the new charge: the reused buffers are in both
  before.clear();
  snap.charge = ChargedBytes(MemoryUse::checkpoint, copied);
  if (snap.rank == 0) {
    auto& index = snap.header;
    index["format"] = "loom-sharded";
    index["version"] = sharded_version;
    index["next_step"] = next_step;
    index["optimizer"] = Optimizer::name;
    index["counter"] = trainer.parts.front().optimizer->counter();
    index["layout"] = layout;
    index["world_size"] = trainer.world_size;
    index["block"] = block;
    index["model"] = trainer.model;
    if (!run.is_null()) index["run"] = run;
  }
}

//! The same for a train::TrainerOf (its view_of).
template <class Model, class Optimizer>
void snapshot_into(Snapshot& snap, const std::string& root, train::TrainerOf<Model, Optimizer>& trainer,
                   int next_step, const std::string& layout, const nlohmann::json& run = nullptr,
                   std::int64_t block = checksum_block, bool copy = true) {
  snapshot_into(snap, root, view_of(trainer), next_step, layout, run, block, copy);
}

//! Writes a sharded checkpoint of `trainer` at step `next_step` into ROOT/step-NNNNNNNN and points ROOT/latest at it
//! (one CheckpointWriter's save and finish); `layout` names the layout (recorded), `run` is recorded under "run".
//! A collective over the world: every rank calls it. Returns the checkpoint's directory, in place.
template <class Model, class Optimizer>
std::string save_sharded(const std::string& root, train::TrainerOf<Model, Optimizer>& trainer, int next_step,
                         const std::string& layout, const nlohmann::json& run = nullptr, SaveOptions options = {}) {
  CheckpointWriter writer(root, options);
  writer.save(trainer, next_step, layout, run);
  writer.finish(trainer);
  return writer.last();
}

//! What load_sharded reads: the training state (parameters, optimizer state and counter: --resume) or the
//! parameters alone (a new run from the weights: --init-from).
enum class LoadWhat { training, parameters };

//! Loads a sharded checkpoint (ROOT, whose `latest` names it, or its directory) into `trainer`, whatever layout it
//! was written on: each rank reads its own part of the parameters and of the optimizer state. Returns the next step.
//! Besides what it holds, a rank holds one checksum block of the files at a time (charged to its ledger as
//! checkpoint buffers) and, on a GPU, a host copy of its part. A collective over the world (it ends with a barrier,
//! so that a rank that fails stops the others).
template <class T, class Dev, class Optimizer>
int load_sharded(const std::string& path, const TrainerView<T, Dev, Optimizer>& trainer,
                 LoadWhat what = LoadWhat::training) {
  using A = loom::acc_t<T>;
  const std::string dir = resolve_checkpoint(path);
  const ShardedIndex ix = read_index(dir);
  const nlohmann::json& want = trainer.model;
  for (const auto& [key, value] : want.items())
    if (!ix.model.contains(key) || ix.model[key] != value)
      throw Error("loom: " + dir + " holds a model with " + key + " = " +
                  (ix.model.contains(key) ? ix.model[key].dump() : std::string("(none)")) + ", this run's has " +
                  value.dump() + " (the checkpoint's model: " + ix.model.dump() + ")");
  const bool state_too = what == LoadWhat::training;
  if (state_too && ix.optimizer != Optimizer::name)
    throw Error("loom: " + dir + " was saved with the optimizer " + ix.optimizer + ", not " + Optimizer::name);

  for (const auto& part : trainer.parts) {
    const train::Holding& held = part.held;
    Optimizer& opt = *part.optimizer;
    auto states = opt.state();
    if (!state_too) states.clear();
    // On a GPU: host copies of the ranges the rank holds, read into and copied back (the rest of the part keeps its
    // values, as on the host; a range is copied out first in case the reads leave gaps in it).
    detail::HostRanges<T> host;
    T* params = part.params->data();
    if constexpr (!kernels::is_host_v<Dev>) {
      host = detail::HostRanges<T>(*part.ops, params, static_cast<std::size_t>(part.params->numel()),
                                   detail::param_ranges(held.params));
      params = host.data();
    }
    std::vector<detail::HostRanges<A>> state_host(states.size());
    std::vector<A*> state(states.size());
    for (std::size_t k = 0; k < states.size(); ++k) {
      state[k] = const_cast<A*>(states[k].second.data());
      if constexpr (!kernels::is_host_v<Dev>) {
        state_host[k] = detail::HostRanges<A>(*part.ops, state[k], static_cast<std::size_t>(states[k].second.numel()),
                                              detail::state_ranges(held.state));
        state[k] = state_host[k].data();
      }
    }
    std::vector<detail::Segment> segs;
    // The segments of tensor `name` that fill elements `ranges` of part parameter s, through dst(x, range).
    auto plan = [&](const layers::ParamSpec& s, const std::string& name, DType dtype, std::size_t esize,
                    const std::vector<train::Holding::Range>& ranges, auto&& dst) {
      const auto it = ix.tensors.find(name);
      if (it == ix.tensors.end()) throw Error("loom: " + dir + " holds no tensor '" + name + "'");
      const TensorIndex& t = it->second;
      if (t.dtype != dtype || t.shape != s.layout.global_shape())
        throw Error("loom: " + dir + ": tensor '" + name + "' is " + std::string(name_of(t.dtype)) + " " +
                    to_string(t.shape) + ", this run needs " + std::string(name_of(dtype)) + " " +
                    to_string(s.layout.global_shape()));
      const std::int64_t n = numel_of(s.shape);
      for (const auto& run : run_boxes(s.layout))
        for (const auto& w : ranges) {
          const std::int64_t lo = std::max(w.lo, s.offset), hi = std::min(w.hi, s.offset + n);
          if (lo >= hi) continue;
          for (const auto& [box, at] : detail::boxes_in(run, lo - s.offset, hi - s.offset)) {
            std::int64_t covered = 0;
            for (const Chunk& k : t.chunks) {
              const auto meet = intersect(box, k.box);
              if (!meet) continue;
              covered += meet->numel();
              for_each_row(*meet, [&](const std::vector<std::int64_t>& row, std::int64_t len) {
                const std::int64_t x = s.offset + run.local(at + flat_in(box, row));
                segs.push_back({&k, &it->first, static_cast<std::uint64_t>(flat_in(k.box, row)) * esize,
                                static_cast<std::uint64_t>(len) * esize, reinterpret_cast<char*>(dst(x, w))});
              });
            }
            if (covered != box.numel())
              throw Error(loom::detail::cat("loom: ", dir, ": tensor '", name, "' holds ", covered, " of the ",
                                            box.numel(), " elements at offsets ", to_string(box.offsets), " sizes ",
                                            to_string(box.sizes), " (chunks missing or overlapping)"));
          }
        }
    };
    for (const auto& s : *part.specs) {
      plan(s, s.name, dtype_of<T>, sizeof(T), held.params,
           [&](std::int64_t x, const train::Holding::Range&) { return params + x; });
      for (std::size_t k = 0; k < states.size(); ++k)
        plan(s, states[k].first + "/" + s.name, dtype_of<A>, sizeof(A), held.state,
             [&, k](std::int64_t x, const train::Holding::Range& w) { return state[k] + w.at + (x - w.lo); });
    }
    detail::read_segments(dir, segs, ix.block);
    if constexpr (!kernels::is_host_v<Dev>) {
      host.back(*part.ops, part.params->data());
      for (std::size_t k = 0; k < states.size(); ++k)
        state_host[k].back(*part.ops, const_cast<A*>(states[k].second.data()));
    }
    if (state_too) opt.set_counter(ix.counter);
  }
  trainer.barrier();
  return ix.next_step;
}

//! The same for a train::TrainerOf (its view_of).
template <class Model, class Optimizer>
int load_sharded(const std::string& path, train::TrainerOf<Model, Optimizer>& trainer,
                 LoadWhat what = LoadWhat::training) {
  return load_sharded(path, view_of(trainer), what);
}

}  // namespace loom::checkpoint

// Sharded checkpoints, the writer: a rank's snapshot of what it writes, written into the temporary directory
// (write_snapshot), put in place by rank 0 once every rank has (commit_snapshot), and CheckpointWriter, which does it
// in place or in a background thread while training goes on (checkpoint/sharded.hpp describes the whole).
#pragma once

#include <loom/checkpoint/sharded_io.hpp>
#include <loom/core/memory.hpp>

#include <algorithm>
#include <chrono>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace loom::checkpoint {

namespace detail {

//! A chunk this rank writes: the tensor, its dtype and global shape, the box, and its bytes: copied (data), or
//! copied from the trainer as they are written (fill, which writes `bytes` bytes; a save in place on the host).
struct Written {
  std::string tensor;
  DType dtype;
  Shape shape;
  Box box;
  std::size_t bytes = 0;
  std::string data;
  std::function<void(char*)> fill;
};

//! Adds a rank manifest's chunks to an index's "tensors" (their file named `file`).
inline void merge_manifest(nlohmann::ordered_json& tensors, const nlohmann::json& chunks, const std::string& file) {
  for (const auto& c : chunks) {
    const std::string t = c.at("tensor").get<std::string>();
    if (!tensors.contains(t)) tensors[t] = {{"dtype", c["dtype"]}, {"shape", c["shape"]}, {"chunks", {}}};
    tensors[t]["chunks"].push_back({{"offsets", c["offsets"]}, {"sizes", c["sizes"]}, {"file", file},
                                    {"offset", c["offset"]}, {"bytes", c["bytes"]}, {"crc32", c["crc32"]}});
  }
}

//! The safetensors header of a rank file that holds `chunks` in order (each named TENSOR#INDEX); empty for none.
inline std::string file_prefix(const std::vector<Written>& chunks) {
  if (chunks.empty()) return {};
  std::vector<SafetensorsEntry> entries;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const auto& w = chunks[i];
    entries.push_back({w.tensor + "#" + std::to_string(i), w.dtype, w.box.sizes, w.bytes});
  }
  return safetensors_prefix(entries);
}

//! A chunk's entry in its rank's manifest, at byte `offset` of the rank file (the file and checksums are added by
//! whoever writes it).
inline nlohmann::json chunk_entry(const Written& w, std::uint64_t offset) {
  return {{"tensor", w.tensor},      {"dtype", safetensors_dtype(w.dtype)}, {"shape", w.shape},
          {"offsets", w.box.offsets}, {"sizes", w.box.sizes},                {"offset", offset},
          {"bytes", w.bytes}};
}

}  // namespace detail

//! How checkpoints are saved.
struct SaveOptions {
  bool asynchronous = false;             //!< CheckpointWriter: written by a background thread
  int keep = 0;                          //!< the newest `keep` checkpoints of the root stay (0: all)
  std::int64_t block = checksum_block;   //!< bytes per checksum block: what a reader holds at most at a time
};

//! A rank's part of a checkpoint (snapshot_into): what write_snapshot puts on disk and, on rank 0, what
//! commit_snapshot records in the index.
struct Snapshot {
  std::string root, name;  //!< ROOT and step-NNNNNNNN
  int rank = 0, world_size = 1, next_step = 0;
  std::int64_t block = checksum_block;
  nlohmann::ordered_json header;  //!< rank 0: the index but its files and tensors
  std::vector<detail::Written> chunks;
  ChargedBytes charge;  //!< the chunks' bytes, on the rank's ledger

  std::string temporary_dir() const { return root + "/." + name + ".tmp"; }
  std::string final_dir() const { return root + "/" + name; }
};

//! Where a save stands, for a test that kills the process there (a crash test): `write` (a rank's file is on disk,
//! its manifest not), `index` (index.json is on disk in the temporary directory), `rename` (the checkpoint is in
//! place, `latest` still names the previous one), `snapshot` (an in-memory snapshot's image is written, its manifest
//! not: checkpoint/snapshots.hpp); with the step of the save. The library calls the hook a program
//! installs (train_gpt's: LOOM_CHECKPOINT_FAULT), and nothing without one.
using FaultHook = void (*)(const char* point, int step);
inline FaultHook& fault_hook() {
  static FaultHook hook = nullptr;
  return hook;
}

namespace detail {
inline void fault_point(const char* point, int step) {
  if (FaultHook h = fault_hook()) h(point, step);
}
}  // namespace detail

//! Makes ROOT/.step-NNNNNNNN.tmp empty (rank 0: a crashed save may have left one); every rank calls it, and a
//! barrier must follow before any rank writes there.
inline void prepare_snapshot(const std::string& root, int next_step, int rank) {
  namespace fs = std::filesystem;
  if (rank != 0) return;
  const std::string tmp = root + "/." + detail::step_name(next_step) + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) throw Error("loom: cannot create " + tmp + ": " + ec.message());
}

//! Writes a snapshot's chunks as the rank's file in the temporary directory (safetensors, then its manifest), each
//! fsynced, and frees them, unless keep_buffers (for the next snapshot_into); a chunk not copied yet is copied into
//! a buffer of its size, one at a time. No communication: a background thread may run it.
inline void write_snapshot(Snapshot& snap, bool keep_buffers = false) {
  const std::string tmp = snap.temporary_dir();
  nlohmann::json manifest = nlohmann::json::array();
  if (!snap.chunks.empty()) {
    const std::string file = detail::rank_file(snap.rank, "safetensors");
    std::size_t largest = 0;
    for (const auto& w : snap.chunks)
      if (w.fill) largest = std::max(largest, w.bytes);
    const std::string prefix = detail::file_prefix(snap.chunks);
    std::string buffer;  // the chunks copied as they are written
    buffer.reserve(largest);
    const ChargedBytes charge(MemoryUse::checkpoint, buffer.capacity());
    detail::SyncedFile out(tmp + "/" + file);
    out.write(prefix.data(), prefix.size());
    std::uint64_t offset = prefix.size();
    for (auto& w : snap.chunks) {
      const std::string* bytes = &w.data;
      if (w.fill) {
        buffer.resize(w.bytes);
        w.fill(buffer.data());
        bytes = &buffer;
      }
      out.write(bytes->data(), bytes->size());
      nlohmann::json entry = detail::chunk_entry(w, offset);
      entry["file"] = file;
      entry["crc32"] = detail::block_crcs(bytes->data(), bytes->size(), snap.block);
      manifest.push_back(std::move(entry));
      offset += w.bytes;
      if (!keep_buffers) std::string().swap(w.data);
    }
    out.close();
    detail::fault_point("write", snap.next_step);
    detail::write_synced(tmp + "/" + detail::rank_file(snap.rank, "json"), manifest.dump());
  }
  if (keep_buffers) return;
  snap.chunks.clear();
  snap.chunks.shrink_to_fit();
  snap.charge.release();
}

//! Rank 0, once every rank's write_snapshot has finished: puts the manifests together into index.json, renames the
//! temporary directory into place, points ROOT/latest at it, and, with keep > 0, removes all but the `keep` newest
//! checkpoints of ROOT. Returns the checkpoint's directory.
inline std::string commit_snapshot(const Snapshot& snap, int keep = 0) {
  namespace fs = std::filesystem;
  const std::string tmp = snap.temporary_dir(), final_dir = snap.final_dir(), root = snap.root;
  nlohmann::ordered_json index = snap.header;
  nlohmann::ordered_json files = nlohmann::ordered_json::object(), tensors = nlohmann::ordered_json::object();
  for (int r = 0; r < snap.world_size; ++r) {
    const std::string mf = tmp + "/" + detail::rank_file(r, "json");
    std::ifstream f(mf);
    if (!f) continue;  // the rank wrote nothing
    const auto m = nlohmann::json::parse(f);
    const std::string file = detail::rank_file(r, "safetensors");
    std::error_code ec;
    files[file] = fs::file_size(tmp + "/" + file, ec);
    if (ec) throw Error("loom: " + tmp + "/" + file + " is missing: " + ec.message());
    detail::merge_manifest(tensors, m, file);
    f.close();
    fs::remove(mf, ec);
  }
  index["files"] = files;
  index["tensors"] = tensors;
  detail::write_synced(tmp + "/index.json", index.dump(1));
  detail::sync_directory(tmp);
  detail::fault_point("index", snap.next_step);
  std::error_code ec;
  fs::remove_all(final_dir, ec);
  fs::rename(tmp, final_dir, ec);
  if (ec) throw Error("loom: cannot rename " + tmp + " to " + final_dir + ": " + ec.message());
  detail::sync_directory(root);
  detail::fault_point("rename", snap.next_step);
  detail::write_synced(root + "/latest.tmp", snap.name + "\n");
  fs::rename(root + "/latest.tmp", root + "/latest", ec);
  if (ec) throw Error("loom: cannot rename " + root + "/latest.tmp to " + root + "/latest: " + ec.message());
  detail::sync_directory(root);
  if (keep > 0) {  // the names sort as the steps do (step-NNNNNNNN)
    std::vector<std::string> steps;
    for (const auto& e : fs::directory_iterator(root, ec)) {
      const std::string n = e.path().filename().string();
      if (n.starts_with("step-") && e.is_directory()) steps.push_back(n);
    }
    std::sort(steps.begin(), steps.end());
    for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < steps.size(); ++i)
      if (steps[i] != snap.name) fs::remove_all(root + "/" + steps[i], ec);
  }
  return final_dir;
}

//! Saves a run's checkpoints into ROOT, synchronously or in the background. Each rank owns one; save() and finish()
//! are collectives over the world.
//! - synchronous: save() returns once the checkpoint is in place, holding one chunk at a time as it writes.
//! - asynchronous: save() copies the rank's part to host memory and returns; a background thread writes it while
//!   training goes on. The checkpoint is put in place (index, rename, `latest`) when the next save() begins or at
//!   finish(), once every rank's file is on disk: until then `latest` names the one before. Each save waits for the
//!   previous one's writing. The host copy's buffers stay allocated from one save to the next (checkpoint buffers on
//!   the rank's ledger), so that only the first save allocates them.
class CheckpointWriter {
 public:
  explicit CheckpointWriter(std::string root, SaveOptions options = {}) : root_(std::move(root)), options_(options) {
    LOOM_CHECK(options.keep >= 0, "the number of checkpoints to keep must not be negative, got ", options.keep);
  }
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  //! Waits for the background writer; a snapshot it has not put in place stays a temporary directory.
  ~CheckpointWriter() {
    if (writer_.joinable()) writer_.join();
  }

  //! Saves `trainer` (a train::TrainerOf, whose snapshot_into checkpoint/sharded.hpp gives) at `next_step` (see
  //! the class).
  template <class Trainer>
  void save(Trainer& trainer, int next_step, const std::string& layout, const nlohmann::json& run = nullptr) {
    const auto t0 = std::chrono::steady_clock::now();
    complete([&] { trainer.barrier(); });
    prepare_snapshot(root_, next_step, trainer.world_rank());
    trainer.barrier();
    const bool async = options_.asynchronous;
    snapshot_into(snap_, root_, trainer, next_step, layout, run, options_.block, /*copy=*/async);
    pending_ = true;
    if (async) {
      writer_ = std::thread([this] {
        try {
          write_snapshot(snap_, /*keep_buffers=*/true);
        } catch (...) {
          failure_ = std::current_exception();
        }
      });
    } else {
      write_snapshot(snap_);
      complete([&] { trainer.barrier(); });
    }
    blocked_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++saves_;
  }

  //! Puts the last checkpoint in place (asynchronous: waits for its writing). Every rank calls it at the end.
  template <class Trainer>
  void finish(Trainer& trainer) {
    const auto t0 = std::chrono::steady_clock::now();
    complete([&] { trainer.barrier(); });
    snap_ = Snapshot();  // the host copy's buffers
    finish_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  bool asynchronous() const { return options_.asynchronous; }
  int saves() const { return saves_; }
  //! Seconds save() held its caller, summed over the saves (asynchronous: the host copy and the wait for the
  //! previous save's writing).
  double blocked_seconds() const { return blocked_; }
  //! Seconds finish() waited.
  double finish_seconds() const { return finish_; }
  //! The directory of the last checkpoint put in place (empty before the first).
  const std::string& last() const { return last_; }

 private:
  //! Waits for the pending snapshot's writing, then (after a barrier: every rank's file is on disk) rank 0 puts it
  //! in place; a barrier ends it.
  template <class Barrier>
  void complete(Barrier&& barrier) {
    if (writer_.joinable()) writer_.join();
    if (!pending_) return;
    pending_ = false;
    if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
    barrier();
    if (snap_.rank == 0) commit_snapshot(snap_, options_.keep);
    last_ = snap_.final_dir();
    barrier();
  }

  std::string root_;
  SaveOptions options_;
  Snapshot snap_;  // the pending one, and then its buffers for the next
  bool pending_ = false;
  std::thread writer_;
  std::exception_ptr failure_;
  double blocked_ = 0, finish_ = 0;
  int saves_ = 0;
  std::string last_;
};

}  // namespace loom::checkpoint

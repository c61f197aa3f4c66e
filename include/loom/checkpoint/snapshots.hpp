// In-memory snapshots of the training state, kept outside the training processes and copied to a peer in another
// failure domain, so that a restart loses a step or two of work instead of everything since the last checkpoint on
// disk (the design of Gemini, SOSP'23, on host memory).
//
// Every few steps each rank takes its part of the state exactly as a sharded checkpoint writes it (snapshot_into:
// what it owns of every parameter and optimizer state, the index's header with the step, the optimizer's counter,
// the layout and the run), as one image of its file and its manifest. It sends the image to its peer, a rank in
// another failure domain: another node where the job spans several, another process otherwise (ranks that are
// threads of one process share a domain; their peer is the next rank, whose copy guards against a damaged file but
// not against losing the process's host). Then a background thread checksums and writes both, its own image and the
// copies it received, into the store: a folder in host memory (tmpfs, /dev/shm), one sub-folder per domain, which
// outlives the processes, so that a restarted job finds it:
//   STORE/domain-HOST[-PID]/step-NNNNNNNN/rank-RRRRR.safetensors, rank-RRRRR.json          (the rank's own image)
//   STORE/domain-HOST[-PID]/step-NNNNNNNN/rank-RRRRR.copy.safetensors, rank-RRRRR.copy.json (a peer's, received)
// A manifest is written after its image, under a temporary name that is then renamed: an image without one is a
// write that did not finish. A snapshot is complete when every rank's image, own or copy, is whole; the next
// snapshot begins with a barrier after which the one before is complete everywhere, and the first rank of each host
// then removes its host's older ones: the store holds at most the newest two (and the one being written), each twice.
//
// A restart (find_snapshot) takes the newest step for which every rank's image is found whole (its size, and every
// checksum block against its manifest), preferring the own copy, and makes a checkpoint directory of it (index.json
// put together from the manifests, and links to the images) that load_sharded reads like any other, on any layout. A
// damaged or missing copy is reported and the other used; a step whose rank lost both is reported and an older one
// tried; where none is whole, the caller falls back to its checkpoint on disk.
#pragma once

#include <loom/checkpoint/sharded.hpp>
#include <loom/core/memory.hpp>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace loom::checkpoint {

//! Where a rank runs: its host and its process. Ranks of one process share a failure domain; with several hosts,
//! ranks of one host do.
struct Place {
  std::string host;
  long pid = 0;
};

//! The failure domains of a world and each rank's peer (snapshot copies go from a rank to its peer).
struct SnapshotPeers {
  std::vector<std::string> domain;  //!< each rank's domain folder name: domain-HOST, or domain-HOST-PID on one host
  std::vector<int> peer;            //!< each rank's peer (-1: none, a world of one)
  bool separate = false;            //!< whether every peer is in another domain than its rank
  //! The ranks whose peer is `rank`.
  std::vector<int> senders(int rank) const {
    std::vector<int> out;
    for (std::size_t q = 0; q < peer.size(); ++q)
      if (peer[q] == rank) out.push_back(static_cast<int>(q));
    return out;
  }
};

//! Domains and peers from every rank's place: one domain per host where there are several, per process otherwise.
//! Domains are ordered by their first rank; the i-th rank of a domain sends to the i-th (modulo its size) of the next
//! domain. In a single domain each rank sends to the next one.
inline SnapshotPeers snapshot_peers(const std::vector<Place>& places) {
  const int n = static_cast<int>(places.size());
  bool hosts = false;
  for (const auto& p : places) hosts = hosts || p.host != places.front().host;
  SnapshotPeers out;
  std::vector<std::string> keys;                 // domain names in order of their first rank
  std::map<std::string, std::vector<int>> ranks;  // domain -> its ranks, ascending
  for (int r = 0; r < n; ++r) {
    const auto& p = places[std::size_t(r)];
    const std::string key = "domain-" + p.host + (hosts ? std::string() : "-" + std::to_string(p.pid));
    if (!ranks.count(key)) keys.push_back(key);
    ranks[key].push_back(r);
    out.domain.push_back(key);
  }
  out.peer.assign(std::size_t(n), -1);
  out.separate = keys.size() > 1;
  for (std::size_t d = 0; d < keys.size(); ++d) {
    const auto& mine = ranks[keys[d]];
    const auto& next = ranks[keys[(d + 1) % keys.size()]];
    for (std::size_t i = 0; i < mine.size(); ++i)
      out.peer[std::size_t(mine[i])] = keys.size() > 1 ? next[i % next.size()] : mine[(i + 1) % mine.size()];
  }
  if (n == 1) out.peer[0] = -1;
  return out;
}

namespace detail {

//! The host's name as failure domains go by it: LOOM_HOST_NAME where it is set (hosts whose names are alike, a test
//! that makes one host many), else gethostname.
inline std::string host_name() {
  char b[256] = {};
  if (const char* v = std::getenv("LOOM_HOST_NAME"); v && *v) std::snprintf(b, sizeof b, "%s", v);
  else if (::gethostname(b, sizeof b - 1) != 0 || !b[0]) return "host";
  std::string s = b;
  for (char& c : s)
    if (c == '/' || c == ' ') c = '_';
  return s;
}

//! A rank's file image (the safetensors bytes a sharded checkpoint's rank file holds) and its manifest, each packed
//! into 8-byte words for the communicator.
struct SnapshotImage {
  std::vector<std::int64_t> file, manifest;
  std::uint64_t file_bytes = 0, manifest_bytes = 0;
  void resize(std::uint64_t f, std::uint64_t m) {
    file_bytes = f, manifest_bytes = m;
    file.resize(static_cast<std::size_t>((f + 7) / 8));
    manifest.resize(static_cast<std::size_t>((m + 7) / 8));
  }
  //! Holds the bytes of a file and of its manifest.
  void assign(const std::string& f, const std::string& m) {
    resize(f.size(), m.size());
    std::memcpy(file.data(), f.data(), f.size());
    std::memcpy(manifest.data(), m.data(), m.size());
  }
  char* file_data() { return reinterpret_cast<char*>(file.data()); }
  const char* file_data() const { return reinterpret_cast<const char*>(file.data()); }
  const char* manifest_data() const { return reinterpret_cast<const char*>(manifest.data()); }
};

//! Sends each image of `out` to its rank and receives an image from the rank of each entry of `in` (sizes first,
//! then the bytes): a snapshot's copy to its peer, or a restart's images to the hosts that lack them. Images between
//! two ranks are matched in the order both list them.
template <class Comm>
void exchange_images(Comm& world, const std::vector<std::pair<int, const SnapshotImage*>>& out,
                     std::vector<std::pair<int, SnapshotImage>>& in) {
  std::vector<std::array<std::int64_t, 2>> sizes_out(out.size()), sizes_in(in.size());
  std::vector<comm::P2P> ops;
  for (std::size_t k = 0; k < out.size(); ++k) {
    sizes_out[k] = {std::int64_t(out[k].second->file_bytes), std::int64_t(out[k].second->manifest_bytes)};
    ops.push_back(comm::send_op(sizes_out[k], out[k].first));
  }
  for (std::size_t k = 0; k < in.size(); ++k) ops.push_back(comm::recv_op(sizes_in[k], in[k].first));
  if (!ops.empty()) world.exchange(std::span<const comm::P2P>(ops));
  ops.clear();
  for (const auto& [to, image] : out)
    ops.push_back(comm::send_op(image->file, to)), ops.push_back(comm::send_op(image->manifest, to));
  for (std::size_t k = 0; k < in.size(); ++k) {
    auto& [from, image] = in[k];
    image.resize(std::uint64_t(sizes_in[k][0]), std::uint64_t(sizes_in[k][1]));
    ops.push_back(comm::recv_op(image.file, from)), ops.push_back(comm::recv_op(image.manifest, from));
  }
  if (!ops.empty()) world.exchange(std::span<const comm::P2P>(ops));
}

//! The name of rank q's image in a step's folder, without its extension: rank-RRRRR, or rank-RRRRR.copy.
inline std::string image_name(int q, bool copy) {
  char b[40];
  std::snprintf(b, sizeof b, copy ? "rank-%05d.copy" : "rank-%05d", q);
  return b;
}

//! The bytes of a file (empty where it cannot be read).
inline std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

//! Writes `n` bytes to `path` (no fsync: the store is host memory, lost with its host anyway).
inline void write_file(const std::string& path, const char* p, std::size_t n) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(p, static_cast<std::streamsize>(n));
  f.close();
  if (!f) throw Error("loom: cannot write the snapshot file " + path);
}

//! The steps of the folders step-NNNNNNNN in `dir`.
inline std::vector<int> steps_in(const std::filesystem::path& dir) {
  std::vector<int> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() == 13 && n.starts_with("step-") && e.is_directory()) out.push_back(std::stoi(n.substr(5)));
  }
  return out;
}

}  // namespace detail

//! A store's path with every "%h" replaced by the host's name (detail::host_name): a folder per host on a shared
//! file system, or per simulated host.
inline std::string store_for_host(std::string path) {
  for (std::size_t at; (at = path.find("%h")) != std::string::npos;) path.replace(at, 2, detail::host_name());
  return path;
}

//! Every rank's place (a collective over the world): its host name (up to 64 bytes) and its pid.
template <class Comm>
std::vector<Place> places_of(Comm& world) {
  const std::string host = detail::host_name();
  constexpr std::size_t words = 9;
  std::vector<std::int64_t> mine(words, 0), all(words * std::size_t(world.size()));
  std::memcpy(mine.data(), host.data(), std::min<std::size_t>(host.size(), 64));
  mine[8] = static_cast<std::int64_t>(::getpid());
  world.all_gather(mine, all);
  std::vector<Place> places;
  for (int r = 0; r < world.size(); ++r) {
    const char* h = reinterpret_cast<const char*>(all.data() + std::size_t(r) * words);
    places.push_back({std::string(h, strnlen(h, 64)), static_cast<long>(all[std::size_t(r) * words + 8])});
  }
  return places;
}

//! Whether `rank` is the first rank of its host in `places` (process: of its process).
inline bool first_of(const std::vector<Place>& places, int rank, bool process) {
  for (int r = 0; r < rank; ++r)
    if (places[std::size_t(r)].host == places[std::size_t(rank)].host &&
        (!process || places[std::size_t(r)].pid == places[std::size_t(rank)].pid))
      return false;
  return true;
}

//! Takes a rank's in-memory snapshots into STORE (see the file's comment). A collective over the world: every rank
//! makes one and calls take() at the same steps. Comm is the world's communicator.
class SnapshotKeeper {
 public:
  //! `keep_step`: a snapshot of this step already in the store (the one a restart loaded) stays until a newer one is
  //! complete; every other step there is removed (a run that starts anew does not find a stale one).
  template <class Comm>
  SnapshotKeeper(std::string store, Comm& world, int keep_step = -1) : store_(std::move(store)) {
    rank_ = world.rank(), size_ = world.size();
    const std::vector<Place> places = places_of(world);
    peers_ = snapshot_peers(places);
    sweeper_ = first_of(places, rank_, /*process=*/false);  // the first rank of each host keeps its store tidy
    if (sweeper_) sweep([keep_step](int s) { return s != keep_step; });
    std::error_code ec;
    std::filesystem::create_directories(dir(rank_), ec);
    if (ec) throw Error("loom: cannot create the snapshot store " + dir(rank_) + ": " + ec.message());
    world.barrier();
  }
  SnapshotKeeper(const SnapshotKeeper&) = delete;
  SnapshotKeeper& operator=(const SnapshotKeeper&) = delete;
  ~SnapshotKeeper() {
    if (writer_.joinable()) writer_.join();
  }

  //! Snapshots `trainer` (a train::TrainerOf) at `next_step`: the host copy and the exchange with the peers now, the
  //! checksums and the writing in the background. Waits for the previous snapshot's writing first; after a barrier
  //! it is complete.
  template <class Trainer, class Comm>
  void take(Trainer& trainer, Comm& world, int next_step, const std::string& layout, const nlohmann::json& run) {
    using Clock = std::chrono::steady_clock;
    auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
    const auto t0 = Clock::now();
    wait(world);
    if (sweeper_ && complete_ >= 0) sweep([c = complete_](int s) { return s < c; });  // older than the complete one
    const auto t1 = Clock::now();
    waited_ += since(t0);
    // The image: snapshot_into's chunks (on the host, read straight from the trainer) packed as the rank file.
    snapshot_into(snap_, store_, trainer, next_step, layout, run, checksum_block, /*copy=*/false);
    const std::string prefix = detail::file_prefix(snap_.chunks);
    std::uint64_t file_bytes = prefix.size();
    for (const auto& w : snap_.chunks) file_bytes += w.bytes;
    own_.resize(file_bytes, 0);
    char* image = own_.file_data();
    std::memcpy(image, prefix.data(), prefix.size());
    nlohmann::json chunks = nlohmann::json::array();
    std::uint64_t offset = prefix.size();
    for (auto& w : snap_.chunks) {
      char* at = image + offset;
      if (w.fill) w.fill(at);
      else std::memcpy(at, w.data.data(), w.bytes);
      chunks.push_back(detail::chunk_entry(w, offset));  // (its checksums: the writer's, in the background)
      offset += w.bytes;
    }
    snap_.chunks.clear();
    snap_.charge = ChargedBytes();  // a device's chunks were host copies, now in the image: no longer held twice
    const std::string m = nlohmann::json{{"rank", rank_},       {"world_size", size_},     {"next_step", next_step},
                                         {"bytes", file_bytes}, {"block", snap_.block},    {"header", snap_.header},
                                         {"chunks", chunks}}.dump();
    own_.resize(file_bytes, m.size());
    std::memcpy(own_.manifest.data(), m.data(), m.size());
    copied_ += since(t1);
    const auto t2 = Clock::now();
    // To the peer, from the ranks whose peer this is.
    const int to = peers_.peer[std::size_t(rank_)];
    std::vector<std::pair<int, const detail::SnapshotImage*>> out;
    if (to >= 0) out.emplace_back(to, &own_);
    const auto from = peers_.senders(rank_);
    copies_.resize(from.size());
    for (std::size_t k = 0; k < from.size(); ++k) copies_[k].first = from[k];
    detail::exchange_images(world, out, copies_);
    exchanged_ += since(t2);
    std::size_t held = (own_.file.capacity() + own_.manifest.capacity()) * 8;
    for (const auto& c : copies_) held += (c.second.file.capacity() + c.second.manifest.capacity()) * 8;
    charge_ = ChargedBytes();
    charge_ = ChargedBytes(MemoryUse::checkpoint, held);
    pending_ = next_step;
    writer_ = std::thread([this, next_step] {
      try {
        write(own_, rank_, next_step, false);
        for (const auto& [q, image] : copies_) write(image, q, next_step, true);
      } catch (...) {
        failure_ = std::current_exception();
      }
    });
    blocked_ += since(t0);
    ++taken_;
  }

  //! Waits for the snapshot being written; after the barrier every rank's is complete.
  template <class Comm>
  void wait(Comm& world) {
    if (writer_.joinable()) writer_.join();
    if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
    world.barrier();
    if (pending_ >= 0) complete_ = std::exchange(pending_, -1);
  }

  //! Removes the whole store (a run that ended with its state on disk); a collective.
  template <class Comm>
  void remove(Comm& world) {
    wait(world);
    if (sweeper_) {
      std::error_code ec;
      std::filesystem::remove_all(store_, ec);
    }
    world.barrier();
  }

  //! The newest snapshot complete on every rank (-1: none yet).
  int complete() const { return complete_; }
  int taken() const { return taken_; }
  //! Seconds take() held its caller, summed: in all, and of them the wait for the previous snapshot's writing (and
  //! the barrier after it), the host copy, the exchange with the peers.
  double blocked_seconds() const { return blocked_; }
  double waited_seconds() const { return waited_; }
  double copied_seconds() const { return copied_; }
  double exchanged_seconds() const { return exchanged_; }
  const SnapshotPeers& peers() const { return peers_; }

 private:
  std::string dir(int rank) const { return store_ + "/" + peers_.domain[std::size_t(rank)]; }

  //! Writes an image (rank q's; a copy received from it when `copy`) into this rank's domain, then its manifest with
  //! the checksums of its chunks as written.
  void write(const detail::SnapshotImage& image, int q, int step, bool copy) const {
    const std::string at = dir(rank_) + "/" + detail::step_name(step);
    std::error_code ec;
    std::filesystem::create_directories(at, ec);
    if (ec) throw Error("loom: cannot create " + at + ": " + ec.message());
    nlohmann::json manifest = nlohmann::json::parse(image.manifest_data(),
                                                    image.manifest_data() + image.manifest_bytes);
    const std::int64_t block = manifest.at("block").get<std::int64_t>();
    for (auto& c : manifest.at("chunks"))
      c["crc32"] = detail::block_crcs(image.file_data() + c.at("offset").get<std::uint64_t>(),
                                      c.at("bytes").get<std::uint64_t>(), block);
    const std::string base = at + "/" + detail::image_name(q, copy);
    detail::write_file(base + ".safetensors", image.file_data(), image.file_bytes);
    if (!copy) detail::fault_point("snapshot", step);  // (a crash test's: the image is written, its manifest not)
    const std::string text = manifest.dump();
    detail::write_file(base + ".json.tmp", text.data(), text.size());
    std::filesystem::rename(base + ".json.tmp", base + ".json", ec);
    if (ec) throw Error("loom: cannot rename " + base + ".json.tmp: " + ec.message());
  }

  //! Removes from this host's store the steps `drop` says, domain folders left empty, and the checkpoint
  //! directories restarts made (find_snapshot; loaded by now).
  template <class Drop>
  void sweep(Drop&& drop) const {
    namespace fs = std::filesystem;
    std::error_code ec;
    for (const auto& d : fs::directory_iterator(store_, ec)) {
      const std::string name = d.path().filename().string();
      if (name.starts_with(".restore-")) fs::remove_all(d.path(), ec);
      if (!d.is_directory() || !name.starts_with("domain-")) continue;
      for (int s : detail::steps_in(d.path()))
        if (drop(s)) fs::remove_all(d.path() / detail::step_name(s), ec);
      if (fs::is_empty(d.path(), ec)) fs::remove(d.path(), ec);
    }
  }

  std::string store_;
  int rank_ = 0, size_ = 1;
  SnapshotPeers peers_;
  bool sweeper_ = false;
  int pending_ = -1, complete_ = -1, taken_ = 0;
  Snapshot snap_;
  detail::SnapshotImage own_;
  std::vector<std::pair<int, detail::SnapshotImage>> copies_;
  ChargedBytes charge_;
  std::thread writer_;
  std::exception_ptr failure_;
  double blocked_ = 0, waited_ = 0, copied_ = 0, exchanged_ = 0;
};

//! A snapshot a restart can load: its step, the checkpoint directory made of it, and what was found damaged or lost
//! on the way (one line each).
struct FoundSnapshot {
  int step = -1;
  std::string dir;
  std::vector<std::string> notes;
};

namespace detail {

//! Whether the image at `base` (.safetensors and .json) is whole: its manifest, for `step`, and the file's size and
//! every checksum block. Returns the manifest, or why not.
inline std::optional<nlohmann::json> whole_image(const std::string& base, int step, std::string& why,
                                                bool checksums = true) {
  std::ifstream mf(base + ".json");
  if (!mf) {
    why = "missing";
    return std::nullopt;
  }
  nlohmann::json m = nlohmann::json::parse(mf, nullptr, false);
  if (m.is_discarded() || !m.is_object() || m.value("next_step", -1) != step) {
    why = "its manifest is unreadable";
    return std::nullopt;
  }
  std::error_code ec;
  const auto size = std::filesystem::file_size(base + ".safetensors", ec);
  if (ec || size != m.value("bytes", std::uint64_t{0})) {
    why = loom::detail::cat("it holds ", ec ? 0 : size, " bytes of ", m.value("bytes", std::uint64_t{0}));
    return std::nullopt;
  }
  if (!checksums) return m;
  const std::string bytes = read_all(base + ".safetensors");
  const std::int64_t block = m.value("block", checksum_block);
  for (const auto& c : m.at("chunks")) {
    const auto at = c.at("offset").get<std::uint64_t>(), n = c.at("bytes").get<std::uint64_t>();
    if (block_crcs(bytes.data() + at, n, block) != c.at("crc32").get<std::vector<std::uint32_t>>()) {
      why = loom::detail::cat("corrupt: tensor '", c.at("tensor").get<std::string>(), "' at bytes [", at, ", ", at + n,
                              ") does not match its checksums");
      return std::nullopt;
    }
  }
  return m;
}

}  // namespace detail

//! The newest snapshot in STORE whose every rank's image is found whole (see the file's comment), made into the
//! checkpoint directory STORE/.restore-PID (index.json and links to the images) for load_sharded; step -1 where
//! there is none (only_step: that step or none). The notes name each damaged or missing copy and each step given up,
//! with the rank. `verified`: the images known whole (the others are passed over), whose checksums are not read
//! again.
inline FoundSnapshot find_snapshot(const std::string& store, int only_step = -1,
                                   const std::set<std::string>* verified = nullptr) {
  namespace fs = std::filesystem;
  FoundSnapshot found;
  std::vector<fs::path> domains;
  std::error_code ec;
  for (const auto& d : fs::directory_iterator(store, ec))
    if (d.is_directory() && d.path().filename().string().starts_with("domain-")) domains.push_back(d.path());
  std::sort(domains.begin(), domains.end());
  std::vector<int> steps;
  for (const auto& d : domains)
    for (int s : detail::steps_in(d)) steps.push_back(s);
  std::sort(steps.begin(), steps.end(), std::greater<>());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  for (int step : steps) {
    if (only_step >= 0 && step != only_step) continue;
    // Every image of this step, own copies first.
    std::map<int, std::vector<std::string>> images;
    int world = -1;
    for (int pass = 0; pass < 2; ++pass)
      for (const auto& d : domains)
        for (const auto& e : fs::directory_iterator(d / detail::step_name(step), ec)) {
          const std::string n = e.path().filename().string();
          const bool copy = n.ends_with(".copy.json");
          if (!n.starts_with("rank-") || !n.ends_with(".json") || copy != (pass == 1)) continue;
          const std::string base = e.path().string().substr(0, e.path().string().size() - 5);
          images[std::stoi(n.substr(5, 5))].push_back(base);
          if (world < 0) {
            std::ifstream mf(e.path());
            const auto m = nlohmann::json::parse(mf, nullptr, false);
            if (!m.is_discarded() && m.is_object()) world = m.value("world_size", -1);
          }
        }
    if (world <= 0) {
      found.notes.push_back(loom::detail::cat("snapshot step ", step, ": no image of it was finished"));
      continue;
    }
    nlohmann::ordered_json index, files = nlohmann::ordered_json::object(),
                                  tensors = nlohmann::ordered_json::object();
    std::vector<std::pair<std::string, std::string>> links;  // name in the checkpoint -> image
    bool whole = true;
    for (int q = 0; q < world && whole; ++q) {
      std::optional<nlohmann::json> m;
      for (const auto& base : images[q]) {
        std::string why;
        // Verified already (gather_snapshot's list, or received from a host that verified it): its size alone.
        const bool known = verified && (verified->count(base) || base.find("-recovered/") != std::string::npos);
        if (verified && !known) continue;  // not on the list: found damaged there
        m = detail::whole_image(base, step, why, !known);
        if (m) {
          links.emplace_back(detail::rank_file(q, "safetensors"), base + ".safetensors");
          if (base.ends_with(".copy"))
            found.notes.push_back(loom::detail::cat("snapshot step ", step, ": rank ", q, "'s state is taken from its "
                                                    "peer's copy ", base + ".safetensors"));
          break;
        }
        found.notes.push_back(loom::detail::cat("snapshot step ", step, ": rank ", q, "'s image ",
                                                base + ".safetensors", " is ", why));
      }
      if (!m) {
        found.notes.push_back(loom::detail::cat("snapshot step ", step, ": rank ", q, "'s state is lost (",
                                                images[q].empty() ? "no copy was written" : "no copy is whole", ")"));
        whole = false;
        break;
      }
      if (q == 0) index = m->at("header");
      files[detail::rank_file(q, "safetensors")] = m->at("bytes");
      detail::merge_manifest(tensors, m->at("chunks"), detail::rank_file(q, "safetensors"));
    }
    if (!whole) continue;
    // Ranks that wrote nothing have an image of no bytes: the index lists the files that hold chunks.
    for (auto it = links.begin(); it != links.end();) {
      if (files[it->first].get<std::uint64_t>() == 0) files.erase(it->first), it = links.erase(it);
      else ++it;
    }
    index["files"] = files;
    index["tensors"] = tensors;
    const std::string dir = store + "/.restore-" + std::to_string(::getpid());
    fs::remove_all(dir, ec);
    fs::create_directories(dir, ec);
    if (ec) throw Error("loom: cannot create " + dir + ": " + ec.message());
    for (const auto& [name, image] : links) {
      fs::create_symlink(fs::absolute(image), dir + "/" + name, ec);
      if (ec) throw Error("loom: cannot link " + dir + "/" + name + ": " + ec.message());
    }
    const std::string text = index.dump(1);
    detail::write_file(dir + "/index.json", text.data(), text.size());
    found.step = step, found.dir = dir;
    return found;
  }
  return found;
}

namespace detail {

//! A string's bytes as 8-byte words for the communicator, and back.
inline std::vector<std::int64_t> to_words(const std::string& s) {
  std::vector<std::int64_t> w((s.size() + 7) / 8, 0);
  if (!s.empty()) std::memcpy(w.data(), s.data(), s.size());
  return w;
}

}  // namespace detail

//! find_snapshot for a job whose hosts keep stores of their own (each its /dev/shm, or --snapshot-dir naming a folder
//! per host): a collective over the world, after which every rank has the newest snapshot that is whole over all the
//! hosts' stores together and newer than `newer_than` (its checkpoint's step on disk), made into a checkpoint
//! directory in its own host's store. The first rank of each host lists the images whole in its store (verified); the
//! lists are gathered; each host that lacks an image of the chosen step receives it from a host that holds it, and
//! keeps it in STORE/domain-HOST-recovered; then the first rank of each process makes the directory. The notes are the
//! host's. On one host with one store, this is find_snapshot with a collective around it.
template <class Comm>
FoundSnapshot gather_snapshot(const std::string& store, Comm& world, int newer_than) {
  namespace fs = std::filesystem;
  const int me = world.rank();
  const std::vector<Place> places = places_of(world);
  const bool host_first = first_of(places, me, false), process_first = first_of(places, me, true);
  FoundSnapshot found;
  // This host's whole images: step, rank, world size, and where.
  nlohmann::json mine = nlohmann::json::array();
  std::vector<std::pair<int, std::string>> damaged;  // (step, what)
  std::error_code ec;
  if (host_first)
    for (const auto& d : fs::directory_iterator(store, ec)) {
      if (!d.is_directory() || !d.path().filename().string().starts_with("domain-")) continue;
      for (int step : detail::steps_in(d.path())) {
        if (step <= newer_than) continue;
        for (const auto& e : fs::directory_iterator(d.path() / detail::step_name(step), ec)) {
          const std::string n = e.path().filename().string(), path = e.path().string();
          if (!n.starts_with("rank-") || !n.ends_with(".json")) continue;
          const std::string base = path.substr(0, path.size() - 5);
          std::string why;
          if (const auto m = detail::whole_image(base, step, why))
            mine.push_back({{"step", step}, {"rank", m->value("rank", -1)}, {"world", m->value("world_size", -1)},
                            {"base", base}});
          else
            damaged.emplace_back(step, loom::detail::cat("snapshot step ", step, ": rank ", std::stoi(n.substr(5, 5)),
                                                         "'s image ", base, ".safetensors is ", why));
        }
      }
    }
  // Every host's list, on every rank.
  const std::string text = mine.dump();
  std::vector<std::int64_t> size{static_cast<std::int64_t>(text.size())}, sizes(std::size_t(world.size()));
  world.all_gather(size, sizes);
  std::int64_t longest = 0;
  for (auto n : sizes) longest = std::max(longest, n);
  std::vector<std::int64_t> words = detail::to_words(text), all;
  words.resize(std::size_t((longest + 7) / 8), 0);
  all.resize(words.size() * std::size_t(world.size()));
  world.all_gather(words, all);
  std::vector<nlohmann::json> lists;  // by rank: the images its host holds (empty but for hosts' first ranks)
  for (int r = 0; r < world.size(); ++r) {
    const char* at = reinterpret_cast<const char*>(all.data() + std::size_t(r) * words.size());
    const auto l = nlohmann::json::parse(at, at + sizes[std::size_t(r)], nullptr, false);
    lists.push_back(l.is_array() ? l : nlohmann::json::array());
  }
  // The newest step whose every rank's image some host holds: every rank decides the same.
  std::map<int, int> worlds;                      // step -> its world size
  std::map<int, std::map<int, std::vector<std::pair<int, std::string>>>> held;  // step -> rank -> (host rank, base)
  for (int r = 0; r < world.size(); ++r)
    for (const auto& e : lists[std::size_t(r)]) {
      const int step = e.at("step").get<int>(), q = e.at("rank").get<int>();
      worlds[step] = e.at("world").get<int>();
      held[step][q].emplace_back(r, e.at("base").get<std::string>());
    }
  int chosen = -1;
  for (auto it = worlds.rbegin(); it != worlds.rend() && chosen < 0; ++it) {
    std::string lost;  // the ranks whose image no host holds whole
    for (int q = 0; q < it->second; ++q)
      if (!held[it->first].count(q)) lost += (lost.empty() ? "" : ", ") + std::to_string(q);
    if (it->second > 0 && lost.empty()) chosen = it->first;
    else
      found.notes.push_back(loom::detail::cat("snapshot step ", it->first, ": the state of rank",
                                              lost.find(',') != std::string::npos ? "s " : " ", lost,
                                              " is lost (no host holds a whole copy)"));
  }
  for (const auto& [step, note] : damaged) found.notes.push_back(note);
  if (chosen < 0) {
    world.barrier();
    return found;
  }
  // Each host without an image of rank q gets one from the first host that has it.
  struct Move {
    int from, to, q;
    std::string base;
  };
  std::vector<Move> moves;
  for (int h = 0; h < world.size(); ++h) {
    if (!first_of(places, h, false)) continue;
    for (int q = 0; q < worlds[chosen]; ++q) {
      const auto& holders = held[chosen][q];
      if (std::none_of(holders.begin(), holders.end(), [&](const auto& x) { return x.first == h; }))
        moves.push_back({holders.front().first, h, q, holders.front().second});
    }
  }
  std::vector<detail::SnapshotImage> sending;
  sending.reserve(moves.size());
  std::vector<std::pair<int, const detail::SnapshotImage*>> out;
  std::vector<std::pair<int, detail::SnapshotImage>> in;
  std::vector<const Move*> received;
  for (const auto& m : moves) {
    if (m.from == me) {
      sending.emplace_back().assign(detail::read_all(m.base + ".safetensors"), detail::read_all(m.base + ".json"));
      out.emplace_back(m.to, &sending.back());
    }
    if (m.to == me) in.emplace_back(m.from, detail::SnapshotImage()), received.push_back(&m);
  }
  detail::exchange_images(world, out, in);
  // What this host received: into STORE/domain-HOST-recovered, each image before its manifest.
  const std::string at = store + "/domain-" + places[std::size_t(me)].host + "-recovered/" + detail::step_name(chosen);
  for (std::size_t j = 0; j < received.size(); ++j) {
    fs::create_directories(at, ec);
    if (ec) throw Error("loom: cannot create " + at + ": " + ec.message());
    const std::string base = at + "/" + detail::image_name(received[j]->q, true);
    const detail::SnapshotImage& image = in[j].second;
    detail::write_file(base + ".safetensors", image.file_data(), image.file_bytes);
    detail::write_file(base + ".json", image.manifest_data(), image.manifest_bytes);
    found.notes.push_back(loom::detail::cat("snapshot step ", chosen, ": rank ", received[j]->q, "'s image came from ",
                                            "host ", places[std::size_t(received[j]->from)].host));
  }
  world.barrier();  // every host holds the step whole
  if (process_first) {
    std::set<std::string> verified;  // what my host's first rank found whole
    for (int r = 0; r < world.size(); ++r)
      if (places[std::size_t(r)].host == places[std::size_t(me)].host)
        for (const auto& e : lists[std::size_t(r)])
          if (e.at("step").get<int>() == chosen) verified.insert(e.at("base").get<std::string>());
    FoundSnapshot local = find_snapshot(store, chosen, &verified);
    for (auto& n : local.notes) found.notes.push_back(std::move(n));
    if (local.step != chosen)
      throw Error(loom::detail::cat("loom: rank ", me, " cannot put the snapshot of step ", chosen, " together from ",
                                    store, " after the exchange"));
  }
  world.barrier();  // every process's directory made
  found.step = chosen;
  found.dir = store + "/.restore-" + std::to_string(::getpid());
  return found;
}

}  // namespace loom::checkpoint

// The trace recorder: spans of stage executions, collectives and kernels, per rank and resource, written as Chrome /
// Perfetto trace events (open the file in ui.perfetto.dev). Enabled by LOOM_TRACE=file.json (written at exit) or
// trace::start(file) (written by trace::stop()); while disabled, recording costs one relaxed atomic load. A process
// that a launcher started among others (mpirun: its ranks are processes) writes LOOM_TRACE's file with its rank
// before the extension, file.rank-00003.json, so that each keeps its own.
#pragma once

#include <loom/core/error.hpp>
#include <loom/core/launch.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace loom::trace {

struct Span {
  std::string name, resource;
  int rank;
  double begin_us, end_us;
};

namespace detail {

struct Recorder {
  std::atomic<bool> on{false};
  std::mutex m;
  std::vector<Span> spans;
  std::string file;  // where the recording in progress goes when it ends; empty: nowhere
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();

  Recorder() {
    if (const char* f = std::getenv("LOOM_TRACE"); f && *f) {
      file = per_process(f, loom::launch());
      on = true;
    }
  }
  // A recording still in progress at exit was asked for (LOOM_TRACE, or start() without stop()): write it.
  ~Recorder() {
    if (file.empty()) return;
    try {
      write(file);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
  }
  void write(const std::string& path);

  //! LOOM_TRACE's file for this process: as given, or with ".rank-NNNNN" before its extension in a process that is
  //! one of several.
  static std::string per_process(const std::string& file, const Launch& l) {
    if (!l.several()) return file;
    char tag[32];
    std::snprintf(tag, sizeof tag, ".rank-%05ld", l.rank);
    const std::filesystem::path p(file);
    return (p.parent_path() / (p.stem().string() + tag + p.extension().string())).string();
  }
};

inline Recorder& recorder() {
  static Recorder r;
  return r;
}

inline int& current_rank() {
  thread_local int rank = 0;
  return rank;
}

}  // namespace detail

//! True while spans are being recorded.
inline bool enabled() { return detail::recorder().on.load(std::memory_order_relaxed); }

//! Starts recording. stop() writes the trace to `file` (or, without stop(), the end of the program does); with no
//! file, nothing is written but what write() is asked for.
inline void start(const std::string& file = {}) {
  auto& r = detail::recorder();
  std::lock_guard lk(r.m);
  r.file = file;
  r.on = true;
}
//! Ends the recording: writes it to the file start() (or LOOM_TRACE) named, if any, and forgets that file, so
//! that nothing more is written at exit. The spans are kept for spans() and write() until clear().
inline void stop() {
  auto& r = detail::recorder();
  std::string file;
  {
    std::lock_guard lk(r.m);
    r.on = false;
    file.swap(r.file);
  }
  if (!file.empty()) r.write(file);
}
//! The file the recording in progress will be written to ("" when none).
inline std::string destination() {
  auto& r = detail::recorder();
  std::lock_guard lk(r.m);
  return r.file;
}

//! The rank this thread's spans belong to (run_local and run_mpi set it).
inline void set_rank(int rank) { detail::current_rank() = rank; }
inline int rank() { return detail::current_rank(); }

inline double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - detail::recorder().t0).count();
}

inline void record(std::string name, std::string resource, double begin_us, double end_us) {
  auto& r = detail::recorder();
  if (!r.on.load(std::memory_order_relaxed)) return;
  std::lock_guard lk(r.m);
  r.spans.push_back({std::move(name), std::move(resource), detail::current_rank(), begin_us, end_us});
}

//! A copy of the spans recorded so far.
inline std::vector<Span> spans() {
  auto& r = detail::recorder();
  std::lock_guard lk(r.m);
  return r.spans;
}
inline void clear() {
  auto& r = detail::recorder();
  std::lock_guard lk(r.m);
  r.spans.clear();
}

//! Records the span from construction to destruction.
class Scope {
 public:
  Scope(const char* name, const char* resource) : on_(enabled()), name_(name), resource_(resource) {
    if (on_) begin_ = now_us();
  }
  ~Scope() {
    if (on_) record(name_, resource_, begin_, now_us());
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  bool on_;
  const char* name_;
  const char* resource_;
  double begin_ = 0;
};

//! Writes the spans as Chrome trace events: one process per rank, one thread per resource. Written to a temporary
//! name beside `path`, then renamed over it; a `path` that exists and is not a regular file (a device, a pipe, a
//! directory) is refused.
inline void write(const std::string& path) { detail::recorder().write(path); }

inline void detail::Recorder::write(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto st = fs::symlink_status(path, ec);
  if (fs::exists(st) && !fs::is_regular_file(st))
    throw Error("loom: the trace file '" + path + "' exists and is not a regular file; the trace is not written");
  std::vector<Span> copy;
  {
    std::lock_guard lk(m);
    copy = spans;
  }
  std::map<std::pair<int, std::string>, int> tids;
  for (const auto& s : copy) tids.emplace(std::make_pair(s.rank, s.resource), 0);
  int next = 0;
  for (auto& [k, v] : tids) v = next++;
  auto quoted = [](const std::string& s) {
    std::string q = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') q += '\\';
      q += c;
    }
    return q + "\"";
  };
  const std::string tmp = path + ".tmp";
  if (const auto t = fs::symlink_status(tmp, ec); fs::exists(t) && !fs::is_regular_file(t))
    throw Error("loom: the temporary trace file '" + tmp + "' exists and is not a regular file; the trace is not "
                "written");
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) throw Error("loom: cannot write the trace file '" + tmp + "'");
    f << "{\"traceEvents\": [\n";
    bool first = true;
    auto sep = [&] {
      if (!first) f << ",\n";
      first = false;
    };
    for (const auto& [k, tid] : tids) {
      sep();
      f << "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": " << k.first << ", \"args\": {\"name\": \"rank "
        << k.first << "\"}},\n";
      f << "{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": " << k.first << ", \"tid\": " << tid
        << ", \"args\": {\"name\": " << quoted(k.second) << "}}";
    }
    char buf[64];
    for (const auto& s : copy) {
      sep();
      f << "{\"ph\": \"X\", \"name\": " << quoted(s.name) << ", \"cat\": " << quoted(s.resource)
        << ", \"pid\": " << s.rank << ", \"tid\": " << tids[{s.rank, s.resource}];
      std::snprintf(buf, sizeof buf, ", \"ts\": %.3f, \"dur\": %.3f}", s.begin_us, s.end_us - s.begin_us);
      f << buf;
    }
    f << "\n]}\n";
    if (!f) {
      f.close();
      fs::remove(tmp, ec);
      throw Error("loom: writing the trace file '" + tmp + "' failed");
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();
    fs::remove(tmp, ec);
    throw Error("loom: cannot rename '" + tmp + "' to '" + path + "': " + why);
  }
}

}  // namespace loom::trace

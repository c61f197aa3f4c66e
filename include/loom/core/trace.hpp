// The trace recorder: spans of stage executions, collectives and kernels, per rank and resource, written as Chrome /
// Perfetto trace events (open the file in ui.perfetto.dev). Enabled by LOOM_TRACE=file.json or trace::start(file);
// while disabled, recording costs one relaxed atomic load.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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
  std::string file;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();

  Recorder() {
    if (const char* f = std::getenv("LOOM_TRACE"); f && *f) {
      file = f;
      on = true;
    }
  }
  ~Recorder() {
    if (!file.empty()) write(file);
  }
  void write(const std::string& path);
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

//! Starts recording; the trace is written to `file` by write() or at the end of the program.
inline void start(const std::string& file) {
  auto& r = detail::recorder();
  std::lock_guard lk(r.m);
  r.file = file;
  r.on = true;
}
//! Stops recording (the spans are kept until written).
inline void stop() { detail::recorder().on = false; }

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
//! name, then renamed.
inline void write(const std::string& path) { detail::recorder().write(path); }

inline void detail::Recorder::write(const std::string& path) {
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
  {
    std::ofstream f(tmp, std::ios::trunc);
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
  }
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace loom::trace

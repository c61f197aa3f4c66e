// A process's heartbeat for a supervisor (loom-run): where LOOM_HEARTBEAT_DIR is set, a thread writes the file
// DIR/beat-<pid> every LOOM_HEARTBEAT_INTERVAL_S seconds (default 1), holding "<pid> <step> <saved> <unix ms> <ranks>":
// the step the process is at (-1 while it starts), the step of the newest complete state, a checkpoint or a snapshot
// (-1: none), and the world ranks it runs ("3", "0-3"; "-" before it knows them). Each write goes to a
// temporary name and is renamed, so a reader sees a whole line. A process that is frozen (stopped by a signal, or
// swapped out for good) stops beating; one that hangs in a collective is stopped by the communicators' timeout. Where
// the variable is not set, nothing runs and the calls cost an atomic store. A process that ends normally removes
// its file (a supervisor takes a file whose process is gone for a process that died).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>

#include <unistd.h>

namespace loom {

class Heartbeat {
 public:
  //! The process's heartbeat, started on first use where LOOM_HEARTBEAT_DIR is set.
  static Heartbeat& process() {
    static Heartbeat h;
    return h;
  }
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  ~Heartbeat() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    std::error_code ec;
    std::filesystem::remove(file_, ec);  // a process that ends normally is not missed
  }

  //! The process has reached step `s` (the next it runs): a beat goes out at once.
  void step(int s) {
    step_.store(s, std::memory_order_relaxed);
    if (thread_.joinable()) {
      {
        std::lock_guard lock(mu_);
        now_ = true;
      }
      cv_.notify_all();
    }
  }
  //! The newest complete state (a checkpoint, or a snapshot on every rank) is of step `s`.
  void saved(int s) { saved_.store(s, std::memory_order_relaxed); }
  //! World rank `r` runs in this process (every rank of it says so).
  void rank(int r) {
    for (int lo = first_.load(); (lo < 0 || r < lo) && !first_.compare_exchange_weak(lo, r);) {
    }
    for (int hi = last_.load(); r > hi && !last_.compare_exchange_weak(hi, r);) {
    }
  }
  //! Whether a supervisor is listening.
  bool active() const { return thread_.joinable(); }

 private:
  Heartbeat() {
    const char* dir = std::getenv("LOOM_HEARTBEAT_DIR");
    if (!dir || !*dir) return;
    double interval = 1.0;
    if (const char* v = std::getenv("LOOM_HEARTBEAT_INTERVAL_S"); v && std::atof(v) > 0) interval = std::atof(v);
    file_ = std::string(dir) + "/beat-" + std::to_string(::getpid());
    period_ = std::chrono::duration<double>(interval);
    beat();  // at once: the supervisor knows the process from its start
    thread_ = std::thread([this] {
      std::unique_lock lock(mu_);
      for (;;) {  // every period, and at once after each step
        cv_.wait_for(lock, period_, [this] { return stop_ || now_; });
        if (stop_) break;
        now_ = false;
        lock.unlock();  // the file is written without the lock: a step does not wait for it
        beat();
        lock.lock();
      }
    });
  }

  void beat() const {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
    const std::string tmp = file_ + ".tmp";
    const int lo = first_.load(), hi = last_.load();
    char ranks[32] = "-";
    if (lo >= 0) std::snprintf(ranks, sizeof ranks, lo == hi ? "%d" : "%d-%d", lo, hi);
    if (std::FILE* f = std::fopen(tmp.c_str(), "w")) {
      std::fprintf(f, "%d %d %d %lld %s\n", static_cast<int>(::getpid()), step_.load(std::memory_order_relaxed),
                   saved_.load(std::memory_order_relaxed), static_cast<long long>(ms), ranks);
      std::fclose(f);
      std::error_code ec;
      std::filesystem::rename(tmp, file_, ec);  // a supervisor that removed the folder has stopped listening
    }
  }

  std::string file_;
  std::chrono::duration<double> period_{1.0};
  std::atomic<int> step_{-1}, saved_{-1}, first_{-1}, last_{-1};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, now_ = false;
  std::thread thread_;
};

}  // namespace loom

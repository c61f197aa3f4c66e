// A thread that runs the jobs posted to it, one after another in the order posted: the worker behind a
// communicator's asynchronous operations and behind each resource of a rank's task graph.
#pragma once

#include <loom/core/memory.hpp>
#include <loom/core/trace.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace loom {

//! The device a thread was given (-1: none chosen, the runtime's default), which the workers it starts inherit, so
//! that a process with a GPU of its own (the Nccl backend's pick_device) launches every rank's kernels there.
inline int& chosen_device() {
  thread_local int d = -1;
  return d;
}
//! How a worker makes its starter's chosen device its own: installed by a device's code (cudaSetDevice,
//! <loom/kernels/cuda/device_ops.hpp>). Null on the host.
struct ThreadDevice {
  void (*make_current)(int) = nullptr;
};
inline std::atomic<const ThreadDevice*>& thread_device() {
  static std::atomic<const ThreadDevice*> d{nullptr};
  return d;
}

//! Starts its thread with the first job, working for the rank of the thread that posts it (its memory ledger, and its
//! chosen device, ThreadDevice); its destructor runs the jobs still queued, then joins. Jobs must not throw.
class Worker {
 public:
  Worker() = default;
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  //! True once a job was posted.
  bool started() const { return thread_.joinable(); }

  void post(std::function<void()> job) {
    if (!thread_.joinable()) {  // it works (memory, trace, device) for the rank of the thread that starts it
      const ThreadDevice* dev = thread_device().load(std::memory_order_acquire);
      thread_ = std::thread([this, ledger = rank_memory_ledger(), rank = trace::rank(), dev, device = chosen_device()] {
        bind_rank_memory(ledger);
        trace::set_rank(rank);
        if (dev && device >= 0) {
          dev->make_current(device);
          chosen_device() = device;
        }
        loop();
      });
    }
    {
      std::lock_guard lk(m_);
      queue_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace loom

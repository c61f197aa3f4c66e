// A thread that runs one communicator's asynchronous operations in the order they were issued. Private: include a
// backend header instead.
#pragma once

#ifndef LOOM_COMM_BACKEND_INCLUDED
#error "loom: comm/detail/ is private: include <loom/comm/local.hpp>, <loom/comm/mpi.hpp> or <loom/comm/nccl.hpp>"
#endif

#include <loom/comm/types.hpp>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace loom::comm::detail {

class SerialWorker {
 public:
  SerialWorker() = default;
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;
  ~SerialWorker() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  //! True once an asynchronous operation was issued: later blocking ones must queue behind it to keep the order.
  bool started() const { return thread_.joinable(); }

  //! Runs job on the worker thread after every job issued before it; the handle rethrows what job throws.
  Handle submit(std::function<void()> job) {
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    auto task = std::make_shared<std::packaged_task<void()>>(std::move(job));
    Handle h(task->get_future().share());
    {
      std::lock_guard lk(m_);
      queue_.push_back([task] { (*task)(); });
    }
    cv_.notify_one();
    return h;
  }

  //! Runs job here when nothing is queued and the caller waits; otherwise on the worker, in order.
  Handle run(std::function<void()> job, bool async) {
    if (async || started()) return submit(std::move(job));
    try {
      job();
    } catch (...) {
      return Handle::ready(std::current_exception());
    }
    return Handle::ready();
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

}  // namespace loom::comm::detail

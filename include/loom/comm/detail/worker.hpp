// A thread that runs one communicator's asynchronous operations in the order they were issued. Private: include a
// backend header instead.
#pragma once

#ifndef LOOM_COMM_BACKEND_INCLUDED
#error "loom: comm/detail/ is private: include <loom/comm/local.hpp>, <loom/comm/mpi.hpp> or <loom/comm/nccl.hpp>"
#endif

#include <loom/comm/types.hpp>
#include <loom/core/worker.hpp>

#include <functional>
#include <future>
#include <memory>

namespace loom::comm::detail {

class SerialWorker {
 public:
  //! True once an asynchronous operation was issued: later blocking ones must queue behind it to keep the order.
  bool started() const { return worker_.started(); }

  //! Runs job on the worker thread after every job issued before it; the handle rethrows what job throws.
  Handle submit(std::function<void()> job) {
    auto task = std::make_shared<std::packaged_task<void()>>(std::move(job));
    Handle h(task->get_future().share());
    worker_.post([task] { (*task)(); });
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
  Worker worker_;
};

}  // namespace loom::comm::detail

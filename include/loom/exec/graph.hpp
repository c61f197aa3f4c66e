// A rank's dependency graph of tasks on its resources: the one asynchronous model that typed stages
// (exec::Pipeline), the pipeline executor and data parallelism run on. A task runs on a resource type (Compute,
// Comm, P2p, ...), each a worker thread of the rank that persists across runs; tasks of one resource run in the
// order they were added, and a task starts once every task it depends on has run and the work those tasks left
// running (a Completion they returned: a communicator's Handle, a device's mark) has finished. A dependency is on
// data (this task reads what those produce), not on a stage: a task may depend on any earlier task of any resource.
// Dependencies only on earlier tasks make every graph deadlock-free.
#pragma once

#include <loom/core/error.hpp>
#include <loom/core/threads.hpp>
#include <loom/core/trace.hpp>
#include <loom/core/worker.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::exec {

//! The rank's computation (on CUDA: its compute stream).
struct Compute {
  static constexpr const char* name = "compute";
};
//! Collectives (on CUDA: a communication stream).
struct Comm {
  static constexpr const char* name = "comm";
};
//! Point-to-point transfers, beside Comm (pipeline send/recv, ring attention).
struct P2p {
  static constexpr const char* name = "p2p";
};

template <class R>
concept Resource = requires {
  { R::name } -> std::convertible_to<const char*>;
};

//! Work that finishes after the call that started it: a communicator's Handle, a device's mark (kernels::Ops::mark),
//! a Pending value. wait() blocks until it is done and rethrows its failure.
template <class C>
concept Completion = requires(C& c) { c.wait(); };

//! A value that may be used once `done` has completed: what a task returns when its work is still running.
template <class V, Completion C>
struct Pending {
  V value;
  C done;
  void wait() { done.wait(); }
};

namespace detail {

//! A number for each resource type, from 0, the same in every translation unit.
inline int next_resource_id() {
  static std::atomic<int> next{0};
  return next++;
}
template <class R>
int resource_id() {
  static const int id = next_resource_id();
  return id;
}

//! A rank's workers, one per resource type, each started the first time a graph uses it. The rank is the thread
//! that runs graphs (a run_local rank thread, an MPI process's main thread): its workers end when it does.
class Workers {
 public:
  static Workers& of_this_thread() {
    thread_local Workers w;
    return w;
  }
  Worker& of(int resource) {
    const auto id = static_cast<std::size_t>(resource);
    if (id >= workers_.size()) workers_.resize(id + 1);
    if (!workers_[id]) workers_[id] = std::make_unique<Worker>();
    return *workers_[id];
  }
  //! Workers started so far.
  std::size_t started() const {
    return static_cast<std::size_t>(std::count_if(workers_.begin(), workers_.end(), [](auto& w) { return !!w; }));
  }

 private:
  std::vector<std::unique_ptr<Worker>> workers_;
};

//! What a task left running, waited for once by whoever needs it first; later waits return at once (or rethrow the
//! same failure).
class Left {
 public:
  explicit Left(std::function<void()> wait) : wait_(std::move(wait)) {}
  void wait() {
    std::lock_guard lk(m_);
    if (!done_) {
      done_ = true;
      try {
        wait_();
      } catch (...) {
        failure_ = std::current_exception();
      }
      wait_ = nullptr;
    }
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  std::mutex m_;
  std::function<void()> wait_;
  bool done_ = false;
  std::exception_ptr failure_;
};

}  // namespace detail

//! A dependency graph of tasks, built then run once on the calling rank's workers.
class Graph {
 public:
  using Id = std::size_t;

  //! Adds task fn on resource R, to start once the tasks `after` (earlier ones) have run and their completions
  //! finished. fn() returns nothing or a Completion, which the task's dependents and run() wait for; `name` labels
  //! the task in the trace.
  template <Resource R, class F>
  Id add(const char* name, F&& fn, std::vector<Id> after = {}) {
    const Id id = tasks_.size();
    for (Id d : after)
      LOOM_CHECK(d < id, "a task may depend only on tasks added before it: task ", id, " on task ", d);
    Task t{detail::resource_id<R>(), R::name, name, {}, std::move(after)};
    using Out = std::invoke_result_t<F&>;
    if constexpr (std::is_void_v<Out>) {
      t.fn = [f = std::forward<F>(fn)]() mutable -> std::function<void()> {
        f();
        return {};
      };
    } else {
      static_assert(Completion<Out>, "loom: a graph task returns nothing or a Completion (something with wait())");
      t.fn = [f = std::forward<F>(fn)]() mutable -> std::function<void()> {
        auto left = std::make_shared<Out>(f());
        return [left] { left->wait(); };
      };
    }
    tasks_.push_back(std::move(t));
    return id;
  }
  std::size_t size() const { return tasks_.size(); }

  //! Runs every task on the calling rank's workers and returns when all have run and every completion they
  //! returned has finished; rethrows the first failure, once no task is running.
  void run() {
    const std::size_t n = tasks_.size();
    done_.assign(n, 0);
    left_.assign(n, nullptr);
    failure_ = nullptr;
    if (n == 0) return;
    auto& workers = detail::Workers::of_this_thread();
    const int rank = trace::rank(), threads = threads_in_use();  // the tasks act for the calling rank
    std::vector<int> resources;
    for (const auto& t : tasks_)
      if (std::find(resources.begin(), resources.end(), t.resource) == resources.end()) resources.push_back(t.resource);
    running_ = static_cast<int>(resources.size());
    for (int r : resources)
      workers.of(r).post([this, r, rank, threads] {
        trace::set_rank(rank);
        use_threads(threads);
        work(r);
        std::lock_guard lk(m_);
        --running_;
        cv_.notify_all();
      });
    {
      std::unique_lock lk(m_);
      cv_.wait(lk, [&] { return running_ == 0; });
    }
    for (auto& l : left_)  // what the tasks left running: none is running once run() returns
      if (l) try {
          l->wait();
        } catch (...) {
          if (!failure_) failure_ = std::current_exception();
        }
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  struct Task {
    int resource;
    const char* resource_name;
    const char* name;
    std::function<std::function<void()>()> fn;
    std::vector<Id> after;
  };

  //! Resource r's tasks, in the order they were added.
  void work(int r) {
    for (Id i = 0; i < tasks_.size(); ++i) {
      Task& t = tasks_[i];
      if (t.resource != r) continue;
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] {
          return failure_ || std::all_of(t.after.begin(), t.after.end(), [&](Id d) { return done_[d] != 0; });
        });
        if (failure_) return;
      }
      try {
        bool waited = false;
        const double w0 = trace::enabled() ? trace::now_us() : 0;
        for (Id d : t.after)
          if (left_[d]) left_[d]->wait(), waited = true;
        if (waited && trace::enabled()) trace::record("wait", t.resource_name, w0, trace::now_us());
        const double t0 = trace::enabled() ? trace::now_us() : 0;
        auto left = t.fn();
        if (trace::enabled()) trace::record(t.name, t.resource_name, t0, trace::now_us());
        std::lock_guard lk(m_);
        if (left) left_[i] = std::make_shared<detail::Left>(std::move(left));
        done_[i] = 1;
        cv_.notify_all();
      } catch (...) {
        std::lock_guard lk(m_);
        if (!failure_) failure_ = std::current_exception();
        cv_.notify_all();
        return;
      }
    }
  }

  std::vector<Task> tasks_;
  std::vector<char> done_;
  std::vector<std::shared_ptr<detail::Left>> left_;
  std::exception_ptr failure_;
  int running_ = 0;
  std::mutex m_;
  std::condition_variable cv_;
};

}  // namespace loom::exec

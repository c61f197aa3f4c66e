// Overlap of communication and computation as typed stages. A resource (Compute, Comm, P2p) is a type; Stage<R, Op>
// binds an operation to one; Pipeline<Stage...> runs chunks 0..n-1 through the stages so that stage k of chunk i
// runs while stage k+1 of chunk i-1 runs on another resource. Dependencies are per (stage, chunk), never a barrier.
// On the CPU each resource is a worker thread of the rank, started on first use and kept until the rank's thread
// ends. Stage 0's operation receives the chunk index; stage k+1's receives what stage k returned (or the chunk
// index when stage k returns nothing). What a stage returns may be a Completion (a communicator's Handle, a
// device's mark, a Pending value): stage k+1 of that chunk starts only once it has completed, and run() returns
// only once the last stage's have. A stage that cannot take its predecessor's output does not compile.
#pragma once

#include <loom/core/error.hpp>
#include <loom/core/threads.hpp>
#include <loom/core/trace.hpp>


#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <cstddef>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
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

//! A value that may be used once `done` has completed: what a stage returns when its work is still running.
template <class V, Completion C>
struct Pending {
  V value;
  C done;
  void wait() { done.wait(); }
};

//! Operation Op_ on resource Resource_.
template <class Resource_, class Op_>
struct Stage {
  static_assert(Resource<Resource_>, "loom: the first argument of Stage is a resource type (Compute, Comm, P2p)");
  using resource = Resource_;
  using op = Op_;
};

namespace detail {

//! A thread that runs the jobs posted to it, in order, until it is destroyed. Jobs must not throw.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void post(std::function<void()> job) {
    {
      std::lock_guard lk(m_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the rest exists
};

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

//! A rank's workers, one per resource type, each started the first time a pipeline uses it. The rank is the thread
//! that runs pipelines (a run_local rank thread, an MPI process's main thread): its workers end when it does.
class Workers {
 public:
  static Workers& of_this_thread() {
    thread_local Workers w;
    return w;
  }
  template <class R>
  Worker& of() {
    const auto id = static_cast<std::size_t>(resource_id<R>());
    if (id >= workers_.size()) workers_.resize(id + 1);
    if (!workers_[id]) workers_[id] = std::make_unique<Worker>();
    return *workers_[id];
  }
  //! Workers started so far (for tests).
  std::size_t started() const {
    return static_cast<std::size_t>(std::count_if(workers_.begin(), workers_.end(), [](auto& w) { return !!w; }));
  }

 private:
  std::vector<std::unique_ptr<Worker>> workers_;
};

template <class T>
using stored_t = std::conditional_t<std::is_void_v<T>, std::size_t, T>;

//! The type stage K receives, and the type it returns, for the stages S... whose operations are called as
//! op(input, extra...): no extra arguments on the CPU, the stream on CUDA.
template <std::size_t K, class Extra, class... S>
struct StageTypes;
template <class... Extra, class... S>
struct StageTypes<0, std::tuple<Extra...>, S...> {
  using first = std::tuple_element_t<0, std::tuple<S...>>;
  using input = std::size_t;
  static_assert(std::is_invocable_v<typename first::op&, input, Extra...>,
                "loom: stage 0's operation must be callable with the chunk index (std::size_t)");
  using output = std::invoke_result_t<typename first::op&, input, Extra...>;
};
template <std::size_t K, class... Extra, class... S>
struct StageTypes<K, std::tuple<Extra...>, S...> {
  using stage = std::tuple_element_t<K, std::tuple<S...>>;
  using input = stored_t<typename StageTypes<K - 1, std::tuple<Extra...>, S...>::output>;
  static constexpr bool accepts = std::is_invocable_v<typename stage::op&, input&, Extra...>;
  static_assert(accepts, "loom: a stage's operation cannot take what the stage before it produces");
  using output = std::conditional_t<accepts, std::invoke_result_t<typename stage::op&, input&, Extra...>, void>;
};

//! What each stage returned for each chunk in a pipeline's last run.
template <class... Out>
class StageResults {
 public:
  //! What stage k returned for chunk i in the last run().
  template <std::size_t k>
  const auto& result(std::size_t i) const {
    return *std::get<k>(this->results_)[i];
  }

 protected:
  void reset_results(std::size_t n) {
    std::apply([n](auto&... v) { ((v.clear(), v.resize(n)), ...); }, results_);
  }
  std::tuple<std::vector<std::optional<Out>>...> results_;
};

//! The (stage, chunk) tasks in the order that cannot deadlock: by diagonal stage + chunk, then by stage. Every
//! task depends only on tasks of a smaller diagonal.
inline void diagonal_order(std::vector<std::pair<std::size_t, std::size_t>>& tasks) {
  std::sort(tasks.begin(), tasks.end(), [](auto a, auto b) {
    return a.first + a.second != b.first + b.second ? a.first + a.second < b.first + b.second : a.first < b.first;
  });
}

template <class Extra, class Seq, class... S>
struct ResultsOf;
template <class Extra, std::size_t... I, class... S>
struct ResultsOf<Extra, std::index_sequence<I...>, S...> {
  using type = StageResults<stored_t<typename StageTypes<I, Extra, S...>::output>...>;
};
//! The StageResults base of a pipeline whose operations take the extra arguments Extra.
template <class Extra, class... S>
using results_base_t = typename ResultsOf<Extra, std::make_index_sequence<sizeof...(S)>, S...>::type;

template <class Op>
const char* op_name(std::size_t k, std::string& buf) {
  if constexpr (requires { Op::name; }) {
    return Op::name;
  } else {
    buf = "stage " + std::to_string(k);
    return buf.c_str();
  }
}

}  // namespace detail

template <class... S>
class Pipeline : public detail::results_base_t<std::tuple<>, S...> {
  static_assert(sizeof...(S) >= 1, "loom: a Pipeline needs at least one stage");
  static constexpr std::size_t K = sizeof...(S);
  template <std::size_t k>
  using types = detail::StageTypes<k, std::tuple<>, S...>;
  template <std::size_t k>
  using stage_t = std::tuple_element_t<k, std::tuple<S...>>;
  template <std::size_t k>
  using out_t = detail::stored_t<typename types<k>::output>;
  //! Whether stage k is the first on its resource: one job per resource.
  template <std::size_t k>
  static constexpr bool first_on_resource = [] {
    bool first = true;
    [&]<std::size_t... J>(std::index_sequence<J...>) {
      ((first = first && !std::is_same_v<typename stage_t<J>::resource, typename stage_t<k>::resource>), ...);
    }(std::make_index_sequence<k>{});
    return first;
  }();

 public:
  explicit Pipeline(typename S::op... ops) : ops_(std::move(ops)...) {}

  //! Runs chunks 0..n-1 through every stage on the rank's workers and returns when all are done, the last stage's
  //! completions included; rethrows the first failure, once every task has stopped.
  void run(std::size_t chunks) {
    n_ = chunks;
    done_.assign(K * chunks, 0);
    failure_ = nullptr;
    this->reset_results(chunks);
    if (chunks == 0) return;
    auto& workers = detail::Workers::of_this_thread();
    // The workers act for the calling rank: its trace rank and its OpenMP threads.
    const Caller caller{trace::rank(), threads_in_use()};
    running_ = 0;
    post_all(workers, caller, std::make_index_sequence<K>{});
    {
      std::unique_lock lk(m_);
      cv_.wait(lk, [&] { return running_ == 0; });
    }
    if (failure_) std::rethrow_exception(failure_);
    if constexpr (Completion<out_t<K - 1>>)
      for (auto& r : std::get<K - 1>(this->results_)) r->wait();
  }

 private:
  struct Caller {
    int rank, threads;
  };
  template <std::size_t... I>
  void post_all(detail::Workers& workers, Caller caller, std::index_sequence<I...>) {
    (post_resource<I>(workers, caller), ...);
  }
  template <std::size_t k>
  void post_resource(detail::Workers& workers, Caller caller) {
    if constexpr (first_on_resource<k>) {
      using R = typename stage_t<k>::resource;
      {
        std::lock_guard lk(m_);
        ++running_;
      }
      workers.template of<R>().post([this, caller] {
        trace::set_rank(caller.rank);
        use_threads(caller.threads);
        work<R>();
        std::lock_guard lk(m_);
        --running_;
        cv_.notify_all();
      });
    }
  }

  //! The tasks of resource R, in the order that cannot deadlock: by diagonal i + k, then by stage.
  template <class R>
  void work() {
    std::vector<std::pair<std::size_t, std::size_t>> tasks;  // (stage, chunk)
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((std::is_same_v<typename stage_t<I>::resource, R> ? add_tasks(tasks, I) : void()), ...);
    }(std::make_index_sequence<K>{});
    detail::diagonal_order(tasks);
    for (auto [stage, chunk] : tasks) {
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] { return failure_ || stage == 0 || done_[(stage - 1) * n_ + chunk]; });
        if (failure_) return;
      }
      try {
        run_task(stage, chunk, std::make_index_sequence<K>{});
      } catch (...) {
        std::lock_guard lk(m_);
        if (!failure_) failure_ = std::current_exception();
        cv_.notify_all();
        return;
      }
      std::lock_guard lk(m_);
      done_[stage * n_ + chunk] = 1;
      cv_.notify_all();
    }
  }
  void add_tasks(std::vector<std::pair<std::size_t, std::size_t>>& tasks, std::size_t stage) const {
    for (std::size_t i = 0; i < n_; ++i) tasks.emplace_back(stage, i);
  }

  template <std::size_t... I>
  void run_task(std::size_t stage, std::size_t chunk, std::index_sequence<I...>) {
    ((stage == I ? run_stage<I>(chunk) : void()), ...);
  }
  template <std::size_t k>
  void run_stage(std::size_t chunk) {
    auto& op = std::get<k>(ops_);
    const double t0 = trace::enabled() ? trace::now_us() : 0;
    auto call = [&](auto&& input) {
      if constexpr (std::is_void_v<typename types<k>::output>) {
        op(input);
        std::get<k>(this->results_)[chunk] = chunk;
      } else {
        std::get<k>(this->results_)[chunk].emplace(op(input));
      }
    };
    if constexpr (k == 0) {
      call(chunk);
    } else {
      auto& in = *std::get<k - 1>(this->results_)[chunk];
      if constexpr (Completion<out_t<k - 1>>) in.wait();  // the work stage k-1 started has finished
      call(in);
    }
    if (trace::enabled()) {
      std::string buf;
      trace::record(detail::op_name<typename stage_t<k>::op>(k, buf), stage_t<k>::resource::name, t0,
                    trace::now_us());
    }
  }

  std::tuple<typename S::op...> ops_;
  std::size_t n_ = 0;
  std::vector<char> done_;
  std::exception_ptr failure_;
  int running_ = 0;  // resource jobs not yet finished
  std::mutex m_;
  std::condition_variable cv_;
};

}  // namespace loom::exec

// Overlap of communication and computation as typed stages. A resource (Compute, Comm, P2p) is a type; Stage<R, Op>
// binds an operation to one; Pipeline<Stage...> runs chunks 0..n-1 through the stages so that stage k of chunk i
// runs while stage k+1 of chunk i-1 runs on another resource. Dependencies are per (stage, chunk), never a barrier.
// On the CPU each resource is a worker thread that lives for one run(). Stage 0's operation receives the chunk index;
// stage k+1's receives what stage k returned (or the chunk index when stage k returns nothing). A stage that cannot
// take its predecessor's output does not compile.
#pragma once

#include <loom/core/error.hpp>
#include <loom/core/threads.hpp>
#include <loom/core/trace.hpp>


#include <algorithm>
#include <condition_variable>
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

//! Operation Op_ on resource Resource_.
template <class Resource_, class Op_>
struct Stage {
  static_assert(Resource<Resource_>, "loom: the first argument of Stage is a resource type (Compute, Comm, P2p)");
  using resource = Resource_;
  using op = Op_;
};

namespace detail {

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
  static constexpr bool accepts = std::is_invocable_v<typename stage::op&, input, Extra...>;
  static_assert(accepts, "loom: a stage's operation cannot take what the stage before it produces");
  using output = std::conditional_t<accepts, std::invoke_result_t<typename stage::op&, input, Extra...>, void>;
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
    std::apply([n](auto&... v) { (v.assign(n, std::nullopt), ...); }, results_);
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
 public:
  explicit Pipeline(typename S::op... ops) : ops_(std::move(ops)...) {}

  //! Runs chunks 0..n-1 through every stage and returns when all are done; rethrows the first failure, after every
  //! worker has stopped. No thread outlives the call.
  void run(std::size_t chunks) {
    n_ = chunks;
    done_.assign(K * chunks, 0);
    failure_ = nullptr;
    this->reset_results(chunks);
    if (chunks == 0) return;
    // One worker per distinct resource.
    std::vector<const char*> resources;
    (add_resource<typename S::resource>(resources), ...);
    // Workers belong to the calling rank: they inherit its trace rank and its OpenMP thread count.
    const int rank = trace::rank();
    const int threads = threads_in_use();
    std::vector<std::thread> workers;
    workers.reserve(resources.size());
    for (const char* r : resources)
      workers.emplace_back([this, r, rank, threads] {
        trace::set_rank(rank);
        use_threads(threads);
        work(r);
      });
    for (auto& w : workers) w.join();
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  template <class R>
  static void add_resource(std::vector<const char*>& v) {
    if (std::find(v.begin(), v.end(), R::name) == v.end()) v.push_back(R::name);
  }

  //! The tasks of resource r, in the order that cannot deadlock: by diagonal i + k, then by stage.
  void work(const char* r) {
    std::vector<std::pair<std::size_t, std::size_t>> tasks;  // (stage, chunk)
    std::size_t k = 0;
    ((std::string_view(S::resource::name) == r ? add_tasks(tasks, k++) : void(++k)), ...);
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
    using stage = std::tuple_element_t<k, std::tuple<S...>>;
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
      call(*std::get<k - 1>(this->results_)[chunk]);
    }
    if (trace::enabled()) {
      std::string buf;
      trace::record(detail::op_name<typename stage::op>(k, buf), stage::resource::name, t0, trace::now_us());
    }
  }

  std::tuple<typename S::op...> ops_;
  std::size_t n_ = 0;
  std::vector<char> done_;
  std::exception_ptr failure_;
  std::mutex m_;
  std::condition_variable cv_;
};

}  // namespace loom::exec

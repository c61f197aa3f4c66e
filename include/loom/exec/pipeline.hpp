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
#include <loom/core/trace.hpp>
#include <loom/exec/graph.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::exec {

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

//! The name of stage k's operation in the trace: its `name`, or "stage k".
template <class Op>
std::string op_name(std::size_t k) {
  if constexpr (requires { Op::name; }) return Op::name;
  else return "stage " + std::to_string(k);
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

 public:
  explicit Pipeline(typename S::op... ops) : ops_(std::move(ops)...) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((names_[I] = detail::op_name<typename stage_t<I>::op>(I)), ...);
    }(std::make_index_sequence<K>{});
  }

  //! Runs chunks 0..n-1 through every stage, as one exec::Graph on the rank's workers, and returns when all are
  //! done, the last stage's completions included; rethrows the first failure, once no task is running.
  void run(std::size_t chunks) {
    this->reset_results(chunks);
    if (chunks == 0) return;
    std::vector<std::pair<std::size_t, std::size_t>> tasks;  // (stage, chunk), added by diagonal: deadlock-free
    for (std::size_t k = 0; k < K; ++k)
      for (std::size_t i = 0; i < chunks; ++i) tasks.emplace_back(k, i);
    detail::diagonal_order(tasks);
    Graph g;
    std::vector<Graph::Id> id(K * chunks);
    for (auto [k, i] : tasks) {
      std::vector<Graph::Id> after;
      if (k > 0) after.push_back(id[(k - 1) * chunks + i]);
      id[k * chunks + i] = add_task(g, k, i, std::move(after), std::make_index_sequence<K>{});
    }
    g.run();
  }

 private:
  template <std::size_t... I>
  Graph::Id add_task(Graph& g, std::size_t stage, std::size_t chunk, std::vector<Graph::Id> after,
                     std::index_sequence<I...>) {
    Graph::Id id = 0;
    ((stage == I ? void(id = add_stage<I>(g, chunk, std::move(after))) : void()), ...);
    return id;
  }
  //! What stage k left running for chunk i, for the graph to wait on.
  template <std::size_t k>
  struct Left {
    out_t<k>* result;
    void wait() { result->wait(); }
  };
  template <std::size_t k>
  Graph::Id add_stage(Graph& g, std::size_t chunk, std::vector<Graph::Id> after) {
    using R = typename stage_t<k>::resource;
    const char* name = names_[k].c_str();
    if constexpr (Completion<out_t<k>>)
      return g.add<R>(name, [this, chunk] { return Left<k>{run_stage<k>(chunk)}; }, std::move(after));
    else
      return g.add<R>(name, [this, chunk] { run_stage<k>(chunk); }, std::move(after));
  }
  //! Stage k on chunk i; returns where its result is kept.
  template <std::size_t k>
  out_t<k>* run_stage(std::size_t chunk) {
    auto& op = std::get<k>(ops_);
    auto& out = std::get<k>(this->results_)[chunk];
    auto call = [&](auto& input) {
      if constexpr (std::is_void_v<typename types<k>::output>) {
        op(input);
        out = chunk;
      } else {
        out.emplace(op(input));
      }
    };
    if constexpr (k == 0) {
      std::size_t i = chunk;
      call(i);
    } else {
      call(*std::get<k - 1>(this->results_)[chunk]);  // its completion, if any, has finished: the graph waited
    }
    return &*out;
  }

  std::tuple<typename S::op...> ops_;
  std::array<std::string, K> names_;
};

}  // namespace loom::exec

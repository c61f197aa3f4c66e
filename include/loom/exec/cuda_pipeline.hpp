// Typed stages on CUDA: the same Stage<Resource, Op> types as exec::Pipeline, where each resource is a CUDA stream
// and the dependencies between stages are events, never a host synchronisation. Operations are called on the
// calling thread, in an order that cannot deadlock (by diagonal chunk + stage), as op(input, stream): they enqueue
// their work on `stream` and return at once. run() returns after enqueuing everything; wait() blocks until the last
// stage of every chunk has finished on the device. Needs the CUDA runtime: link loom::cuda.
#pragma once

#include <loom/exec/pipeline.hpp>

#include <cuda_runtime_api.h>

#include <type_traits>

namespace loom::exec {

//! The stream of each resource.
struct Streams {
  cudaStream_t compute = nullptr, comm = nullptr, p2p = nullptr;

  template <class R>
  cudaStream_t of() const {
    static_assert(std::is_same_v<R, Compute> || std::is_same_v<R, Comm> || std::is_same_v<R, P2p>,
                  "loom: a CUDA stream pipeline's resources are Compute, Comm and P2p");
    if constexpr (std::is_same_v<R, Compute>) return compute;
    else if constexpr (std::is_same_v<R, Comm>) return comm;
    else return p2p;
  }
};

namespace detail {
inline void cuda_pipeline_check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw BackendError(loom::detail::cat("loom: ", what, " failed: ", cudaGetErrorString(rc), " (",
                                         cudaGetErrorName(rc), ")"));
}

}  // namespace detail

template <class... S>
class StreamPipeline : public detail::results_base_t<std::tuple<cudaStream_t>, S...> {
  static constexpr std::size_t K = sizeof...(S);

 public:
  StreamPipeline(Streams streams, typename S::op... ops) : streams_(streams), ops_(std::move(ops)...) {}
  StreamPipeline(const StreamPipeline&) = delete;
  StreamPipeline& operator=(const StreamPipeline&) = delete;
  //! Waits for what is still running on the device: its stages may read the results this frees.
  ~StreamPipeline() {
    drain();
    release();
  }

  //! Enqueues chunks 0..n-1 through every stage; stage k of chunk i starts on its stream once stage k-1 of chunk i
  //! has finished on its own.
  void run(std::size_t chunks) {
    drain();  // the last run's stages are done with its results before they go
    release();
    n_ = chunks;
    events_.assign(K * chunks, nullptr);
    for (auto& e : events_) detail::cuda_pipeline_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                                                        "cudaEventCreateWithFlags");
    this->reset_results(chunks);
    std::vector<std::pair<std::size_t, std::size_t>> tasks;
    for (std::size_t k = 0; k < K; ++k)
      for (std::size_t i = 0; i < chunks; ++i) tasks.emplace_back(k, i);
    detail::diagonal_order(tasks);
    try {
      for (auto [k, i] : tasks) run_task(k, i, std::make_index_sequence<K>{});
    } catch (...) {
      drain();  // what was enqueued is done before the results it reads can go
      throw;
    }
  }

  //! Blocks until every chunk's last stage has finished.
  void wait() {
    for (std::size_t i = 0; i < n_; ++i)
      detail::cuda_pipeline_check(cudaEventSynchronize(events_[(K - 1) * n_ + i]), "cudaEventSynchronize");
  }

 private:
  template <std::size_t... I>
  void run_task(std::size_t stage, std::size_t chunk, std::index_sequence<I...>) {
    ((stage == I ? run_stage<I>(chunk) : void()), ...);
  }
  template <std::size_t k>
  void run_stage(std::size_t chunk) {
    using stage = std::tuple_element_t<k, std::tuple<S...>>;
    const cudaStream_t s = streams_.template of<typename stage::resource>();
    if constexpr (k > 0) {
      using prev = std::tuple_element_t<k - 1, std::tuple<S...>>;
      if (streams_.template of<typename prev::resource>() != s)
        detail::cuda_pipeline_check(cudaStreamWaitEvent(s, events_[(k - 1) * n_ + chunk], 0), "cudaStreamWaitEvent");
    }
    auto& op = std::get<k>(ops_);
    auto call = [&](auto&& input) {
      if constexpr (std::is_void_v<typename detail::StageTypes<k, std::tuple<cudaStream_t>, S...>::output>) {
        op(input, s);
        std::get<k>(this->results_)[chunk] = chunk;
      } else {
        std::get<k>(this->results_)[chunk].emplace(op(input, s));
      }
    };
    if constexpr (k == 0) call(chunk);
    else call(*std::get<k - 1>(this->results_)[chunk]);
    detail::cuda_pipeline_check(cudaEventRecord(events_[k * n_ + chunk], s), "cudaEventRecord");
  }
  //! Waits for every event recorded (one never recorded is complete).
  void drain() noexcept {
    for (auto e : events_)
      if (e) static_cast<void>(cudaEventSynchronize(e));
  }
  void release() noexcept {
    for (auto& e : events_)
      if (e) cudaEventDestroy(e);
    events_.clear();
  }

  Streams streams_;
  std::tuple<typename S::op...> ops_;
  std::size_t n_ = 0;
  std::vector<cudaEvent_t> events_;
};

}  // namespace loom::exec

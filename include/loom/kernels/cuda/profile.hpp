// Where the device's time goes, operation by operation. While a Profile is open on a thread, every operation that
// thread issues through Ops<Cuda> is bracketed by two events on its stream; rows() waits for them and adds up the
// time between each pair by operation (a product by its shape, M x N x K and its transposes), with the FLOPs of the
// products and of attention, so that each row reads against the device's peak. Nothing is recorded, and nothing
// costs more than a thread-local read, while no profile is open.
//
//   kernels::cuda::Profile profile;           // this thread's operations, from here
//   model.forward(...); model.backward(...);
//   for (const auto& r : profile.rows()) ...  // op, calls, ms, flops; the largest first
#pragma once

#include <loom/kernels/cuda/check.cuh>
#include <loom/kernels/shape.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace loom::kernels::cuda {

//! Attention's forward FLOPs: QK^T and PV over the pairs a query sees (causal: t + 1 keys for query t); backward's
//! useful FLOPs are 2.5 times these (five products of the same size).
inline double attention_flops(const AttentionShape& s) {
  const double pairs = s.causal ? 0.5 * s.T * (s.T + 1.0) : double(s.T) * s.keys();
  return 4.0 * s.B * s.Hq * s.D * pairs;
}

class Profile {
 public:
  //! One operation's total over the calls recorded.
  struct Row {
    std::string op;
    long calls = 0;
    double ms = 0;     //!< device time between each call's two events, summed
    double flops = 0;  //!< the useful FLOPs of the calls (products and attention; 0 for the others)
    double tflops() const { return ms > 0 ? flops / (ms * 1e9) : 0; }
  };

  //! Opens the profile on the calling thread (until it is destroyed; a profile opened inside it takes over, and
  //! gives back on its end).
  Profile() : previous_(std::exchange(current(), this)) {}
  Profile(const Profile&) = delete;
  Profile& operator=(const Profile&) = delete;
  ~Profile() {
    current() = previous_;
    for (const Span& s : spans_) {
      cudaEventDestroy(s.start);
      cudaEventDestroy(s.stop);
    }
  }

  //! The operations recorded so far, summed by name, the most time first (waits for the device to reach them).
  std::vector<Row> rows() const {
    std::map<std::string, Row> by_name;
    for (const Span& s : spans_) {
      LOOM_CUDA(cudaEventSynchronize(s.stop));
      float ms = 0;
      LOOM_CUDA(cudaEventElapsedTime(&ms, s.start, s.stop));
      Row& r = by_name[s.op];
      r.op = s.op;
      ++r.calls;
      r.ms += ms;
      r.flops += s.flops;
    }
    std::vector<Row> out;
    for (auto& [name, r] : by_name) out.push_back(std::move(r));
    std::sort(out.begin(), out.end(), [](const Row& a, const Row& b) { return a.ms > b.ms; });
    return out;
  }

  //! The profile open on this thread, or null.
  static Profile*& current() {
    thread_local Profile* open = nullptr;
    return open;
  }

  //! Records the start of an operation on stream s; stop(i, s) its end. Operations issued inside another's span (an
  //! operation built of others) are counted in the outer one alone.
  std::size_t start(std::string op, double flops, cudaStream_t s) {
    Span span{std::move(op), flops, nullptr, nullptr};
    LOOM_CUDA(cudaEventCreate(&span.start));
    LOOM_CUDA(cudaEventCreate(&span.stop));
    LOOM_CUDA(cudaEventRecord(span.start, s));
    spans_.push_back(std::move(span));
    ++depth_;
    return spans_.size() - 1;
  }
  //! Does not throw (a scope's destructor calls it): an event that failed to record fails rows() instead.
  void stop(std::size_t i, cudaStream_t s) noexcept {
    --depth_;
    (void)cudaEventRecord(spans_[i].stop, s);
  }
  bool inside() const { return depth_ > 0; }

 private:
  struct Span {
    std::string op;
    double flops;
    cudaEvent_t start, stop;
  };
  std::vector<Span> spans_;
  int depth_ = 0;
  Profile* previous_;
};

//! The span of one operation in the thread's open profile, if there is one: Ops<Cuda> opens one per call.
class ProfileScope {
 public:
  ProfileScope(const char* op, cudaStream_t s, double flops = 0)
      : ProfileScope(s, [op] { return std::string(op); }, flops) {}
  //! name() builds the row's name, and is called only while a profile is open.
  template <class Name>
  ProfileScope(cudaStream_t s, Name&& name, double flops) {
    Profile* p = Profile::current();
    if (!p || p->inside()) return;
    profile_ = p, stream_ = s;
    index_ = p->start(name(), flops, s);
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;
  ~ProfileScope() {
    if (profile_) profile_->stop(index_, stream_);
  }

 private:
  Profile* profile_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::size_t index_ = 0;
};

}  // namespace loom::kernels::cuda

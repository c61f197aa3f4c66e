// For tests and benchmarks of pipeline schedules: a stand-in for a model part that only takes time. F, B and W sleep
// for given costs and are logged, so that a schedule run by the executor can be timed against the table's
// simulation (its bubble, its makespan) without the noise of real compute. Not part of the training library.
#pragma once

#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/part.hpp>
#include <loom/pipeline/executor.hpp>
#include <loom/tensor/tensor.hpp>

#include <algorithm>
#include <memory>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace loom::testing {

class CostedModel {
 public:
  using Clock = std::chrono::steady_clock;
  using MicroBatch = models::MicroBatch;
  //! One compute action as it ran.
  struct Span {
    Clock::time_point start, end;
  };

  //! Costs in seconds; head: this part computes the loss (forward returns 1).
  CostedModel(double f, double b, double w, bool head = false) : f_(f), b_(b), w_(w), head_(head) {}

  static constexpr std::size_t io_elements(int, int) { return 1; }
  double forward(int slot, const MicroBatch&, const float*) {
    run(f_);
    out_.at(static_cast<std::size_t>(slot)) = 0;
    return head_ ? 1.0 : 0.0;
  }
  void backward(int, double, const float*) { run(b_ + w_); }
  void backward_inputs(int, double, const float*) { run(b_); }
  void backward_weights(int) { run(w_); }
  const float* output(int slot) const { return &out_.at(static_cast<std::size_t>(slot)); }
  const float* input_grad(int) const { return &dx_; }
  int slots() const { return static_cast<int>(out_.size()); }
  void set_slots(int n) { out_.assign(static_cast<std::size_t>(n), 0.0f); }
  const Tensor<float>& grads() const { return grads_; }

  const std::vector<Span>& spans() const { return spans_; }
  void clear() { spans_.clear(); }

 private:
  void run(double seconds) {
    const auto start = Clock::now();
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)));
    spans_.push_back({start, Clock::now()});
  }

  double f_, b_, w_;
  bool head_;
  std::vector<float> out_;
  float dx_ = 0;
  Tensor<float> grads_;
  std::vector<Span> spans_;
};

//! A table as the executor ran it with costed stand-ins.
struct MeasuredStep {
  double makespan = 0;    //!< in units of `unit`
  double bubble = 0;      //!< idle share of the step: 1 - busy / (P x step)
  std::vector<int> peak;  //!< per stage: the most (micro-batch, chunk) activations held at once
};

//! Runs `table` on P ranks (threads) whose chunks sleep c.f, c.b and c.w units of `unit` seconds for F, B and W,
//! and measures the step.
template <int P, pipeline::ScheduleTable Table>
MeasuredStep time_schedule(const Table& table, double unit, pipeline::Costs c = {}) {
  const int V = pipeline::chunks_per_stage(table.schedule, table.chunks);
  std::vector<std::vector<CostedModel::Span>> spans(P);
  std::vector<int> peak(P);
  run_local<Parallel<PP<P>>>([&](auto& ctx) {
    const int stage = ctx.rank();
    std::vector<std::unique_ptr<CostedModel>> parts;
    std::vector<CostedModel*> raw;
    for (int k = 0; k < V; ++k) {
      const bool head = pipeline::virtual_stage(table.schedule, P, stage, k) == P * V - 1;
      parts.push_back(std::make_unique<CostedModel>(c.f * unit, c.b * unit, c.w * unit, head));
      raw.push_back(parts.back().get());
    }
    auto& pp = ctx.template comm<Axis::pp>();
    pipeline::Executor<CostedModel, std::remove_reference_t<decltype(pp)>> exec(raw, pp, table.schedule);
    pp.barrier();
    exec.run(table, [](int) { return CostedModel::MicroBatch{nullptr, nullptr, 1, 1}; });
    for (auto& p : parts) spans[stage].insert(spans[stage].end(), p->spans().begin(), p->spans().end());
    peak[stage] = exec.peak_activations();
  });
  auto first = spans[0].front().start, last = spans[0].front().end;
  double busy = 0;
  for (const auto& s : spans)
    for (const auto& x : s) {
      first = std::min(first, x.start), last = std::max(last, x.end);
      busy += std::chrono::duration<double>(x.end - x.start).count();
    }
  const double makespan = std::chrono::duration<double>(last - first).count();
  return {makespan / unit, 1 - busy / (P * makespan), peak};
}

}  // namespace loom::testing

// Optimizers over a model's flat parameter buffer: AdamW and SGD with momentum, as torch.optim defines them (with
// fp32 master weights for bf16 parameters), with weight decay on matrices and embeddings only; global-norm gradient
// clipping; a linear-warmup learning rate. On
// the model's device: Dev = Host, or Cuda with <loom/kernels/cuda/device_ops.hpp> (state and buffers there).
#pragma once

#include <loom/kernels/ops.hpp>
#include <loom/layers/param.hpp>
#include <loom/optim/schedule.hpp>
#include <loom/tensor/tensor.hpp>

#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::optim {

//! A run of elements an optimizer updates alike: parameters [param, param + n) of the model's flat buffer, with their
//! gradients at the same place of the gradient buffer, and their state at [at, at + n) of the optimizer's: the same
//! place without sharding; a rank's shard under ZeRO (train::ShardPlan). Weight decay where `decay`.
using Slice = kernels::UpdateRun;

//! The slices of an unsharded optimizer: one per parameter, gradients and state where the parameter is.
inline std::vector<Slice> slices_of(const std::vector<layers::ParamSpec>& specs) {
  std::vector<Slice> out;
  for (const auto& s : specs) out.push_back({s.offset, s.offset, numel_of(s.shape), s.decay});
  return out;
}

//! The slices a device updates: runs of slices contiguous in the parameters and in the state, alike in decay, merged
//! (an element's update depends on it alone, so the results are the same; GPT-2's 148 parameters make 98 runs), which
//! AdamW updates in one launch and SGD in one launch each. The host keeps one call per slice, whose vectorised loops
//! would split the elements differently between packets and scalars.
inline std::vector<Slice> coalesced(const std::vector<Slice>& slices) {
  std::vector<Slice> out;
  for (const Slice& s : slices) {
    if (!out.empty()) {
      Slice& run = out.back();
      if (run.decay == s.decay && run.param + run.n == s.param && run.at + run.n == s.at) {
        run.n += s.n;
        continue;
      }
    }
    out.push_back(s);
  }
  return out;
}

namespace detail {
//! The slices an optimizer on Dev walks: coalesced on a device.
template <class Dev>
std::vector<Slice> launch_slices(std::vector<Slice> slices) {
  if constexpr (std::is_same_v<Dev, Host>) return slices;
  else return coalesced(slices);
}
//! n zeros of an optimizer's state, counted as such in the rank's memory ledger (`use`).
template <class A, class Dev>
Tensor<A, Dev> state(std::int64_t n, MemoryUse use = MemoryUse::optimizer_state) {
  MemoryUseScope scope(use);
  return Tensor<A, Dev>::zeros({n});
}
//! fp32 master weights for parameters of a narrower type T (bf16, fp16): n elements laid out as the optimizer's
//! state, which its steps update and round into the parameters; none (empty) when T is its own accumulation type.
template <class T, class Dev>
Tensor<acc_t<T>, Dev> master_weights(std::int64_t n) {
  if constexpr (std::is_same_v<T, acc_t<T>>) return {};
  else return state<acc_t<T>, Dev>(n, MemoryUse::master_weights);
}
}  // namespace detail

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  //!< torch.optim.AdamW's defaults
  double weight_decay = 0.01;
};

//! AdamW over the parameters described by specs (decay where ParamSpec::decay), or by slices, with n elements of
//! state, its moments on Dev. For bf16 (or fp16) parameters it keeps fp32 master weights beside the moments (laid out
//! and sharded as they are): each step updates them and rounds them into the parameters, so that updates smaller
//! than the parameters' precision accumulate. They are taken from the parameters on the first step.
template <class T, class Dev = Host>
class AdamW {
 public:
  using acc = loom::acc_t<T>;
  using device = Dev;
  AdamW(std::vector<Slice> slices, std::int64_t n, AdamWConfig cfg = {}, kernels::Ops<Dev> ops = {})
      : slices_(detail::launch_slices<Dev>(std::move(slices))), cfg_(cfg), ops_(ops),
        m_(detail::state<acc, Dev>(n)), v_(detail::state<acc, Dev>(n)), w_(detail::master_weights<T, Dev>(n)) {}
  AdamW(const std::vector<layers::ParamSpec>& specs, std::int64_t n, AdamWConfig cfg = {}, kernels::Ops<Dev> ops = {})
      : AdamW(slices_of(specs), n, cfg, ops) {}

  //! One step of the parameters from their gradients (grads laid out as the parameters: see Slice): every slice in
  //! one call (on a device one launch).
  void step(const Tensor<T, Dev>& params, const Tensor<T, Dev>& grads, double lr) {
    ++t_;
    ops_.adamw_runs(params.data(), grads.data(), m_.data(), v_.data(), has_master ? w_.data() : nullptr,
                    slices_.data(), slices_.size(), lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, t_);
  }
  //! Whether it keeps fp32 master weights (bf16 or fp16 parameters).
  static constexpr bool has_master = !std::is_same_v<T, acc>;
  int steps() const { return t_; }
  const Tensor<acc, Dev>& first_moment() const { return m_; }
  const Tensor<acc, Dev>& second_moment() const { return v_; }
  //! Named state for checkpoints: the moments (and the master weights), and the step count.
  std::vector<std::pair<std::string, Tensor<acc, Dev>>> state() const {
    if constexpr (has_master) return {{"adamw.exp_avg", m_}, {"adamw.exp_avg_sq", v_}, {"adamw.master", w_}};
    else return {{"adamw.exp_avg", m_}, {"adamw.exp_avg_sq", v_}};
  }
  int counter() const { return t_; }
  void set_counter(int t) { t_ = t; }
  static constexpr const char* name = "adamw";

 private:
  std::vector<Slice> slices_;
  AdamWConfig cfg_;
  kernels::Ops<Dev> ops_;
  Tensor<acc, Dev> m_, v_;
  Tensor<acc, Dev> w_;  //!< fp32 master weights, for bf16/fp16 parameters
  int t_ = 0;
};

struct SgdConfig {
  double momentum = 0.9;
  double weight_decay = 0.0;
};

//! SGD with momentum (torch.optim.SGD, dampening 0, no Nesterov) over specs or slices, with n elements of state,
//! its buffer on Dev.
template <class T, class Dev = Host>
class Sgd {
 public:
  using acc = loom::acc_t<T>;
  using device = Dev;
  Sgd(std::vector<Slice> slices, std::int64_t n, SgdConfig cfg = {}, kernels::Ops<Dev> ops = {})
      : slices_(detail::launch_slices<Dev>(std::move(slices))), cfg_(cfg), ops_(ops),
        buf_(detail::state<acc, Dev>(n)), w_(detail::master_weights<T, Dev>(n)) {}
  Sgd(const std::vector<layers::ParamSpec>& specs, std::int64_t n, SgdConfig cfg = {}, kernels::Ops<Dev> ops = {})
      : Sgd(slices_of(specs), n, cfg, ops) {}

  //! One step of the parameters from their gradients (grads laid out as the parameters: see Slice).
  void step(const Tensor<T, Dev>& params, const Tensor<T, Dev>& grads, double lr) {
    for (const auto& s : slices_)
      ops_.sgd_step(params.data() + s.param, grads.data() + s.param, buf_.data() + s.at, static_cast<std::size_t>(s.n),
                    lr, cfg_.momentum, s.decay ? cfg_.weight_decay : 0.0, first_,
                    has_master ? w_.data() + s.at : nullptr);
    first_ = false;
  }
  //! Whether it keeps fp32 master weights (bf16 or fp16 parameters), as AdamW does.
  static constexpr bool has_master = !std::is_same_v<T, acc>;

 private:
  std::vector<Slice> slices_;
  SgdConfig cfg_;
  kernels::Ops<Dev> ops_;
  Tensor<acc, Dev> buf_;
  Tensor<acc, Dev> w_;  //!< fp32 master weights, for bf16/fp16 parameters
  bool first_ = true;

 public:
  //! Named state for checkpoints: the momentum buffer (and the master weights), and whether a step was taken.
  std::vector<std::pair<std::string, Tensor<acc, Dev>>> state() const {
    if constexpr (has_master) return {{"sgd.momentum_buffer", buf_}, {"sgd.master", w_}};
    else return {{"sgd.momentum_buffer", buf_}};
  }
  int counter() const { return first_ ? 0 : 1; }
  void set_counter(int t) { first_ = t == 0; }
  static constexpr const char* name = "sgd";
};

//! The L2 norm of all gradients (a contiguous buffer).
template <class T, class Dev>
double grad_norm(const Tensor<T, Dev>& grads, const kernels::Ops<Dev>& ops = {}) {
  return std::sqrt(ops.sum_squares(grads.data(), static_cast<std::size_t>(grads.numel())));
}

//! What gradients whose global norm is `norm` are scaled by so that it becomes at most max_norm (0: no clipping):
//! 1 when it is already.
inline double clip_scale(double norm, double max_norm) {
  return max_norm <= 0 || !(norm > max_norm) ? 1.0 : max_norm / (norm + 1e-6);
}

//! Scales the gradients, whose global norm is `norm`, so that it becomes at most max_norm (0: no clipping).
template <class T, class Dev>
void clip_to(const Tensor<T, Dev>& grads, double norm, double max_norm, const kernels::Ops<Dev>& ops = {}) {
  const double s = clip_scale(norm, max_norm);
  if (s == 1.0) return;
  ops.scale(grads.data(), static_cast<std::size_t>(grads.numel()), static_cast<loom::acc_t<T>>(s));
}

//! Scales the gradients so that their global norm is at most max_norm (torch.nn.utils.clip_grad_norm_); returns
//! the norm before clipping.
template <class T, class Dev>
double clip_grad_norm(const Tensor<T, Dev>& grads, double max_norm, const kernels::Ops<Dev>& ops = {}) {
  const double norm = grad_norm(grads, ops);
  clip_to(grads, norm, max_norm, ops);
  return norm;
}

//! Linear warmup over `warmup` steps to lr, then constant (step is 0-based): the constant LrSchedule.
inline double warmup_lr(double lr, int step, int warmup) {
  return LrSchedule{LrShape::constant, lr, 0, warmup}(step);
}

}  // namespace loom::optim

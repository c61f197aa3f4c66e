// Optimizers over a model's flat parameter buffer: AdamW and SGD with momentum, as torch.optim defines them, with
// weight decay on matrices and embeddings only; global-norm gradient clipping; a linear-warmup learning rate.
#pragma once

#include <loom/kernels/cpu/ops.hpp>
#include <loom/models/gpt.hpp>
#include <loom/tensor/tensor.hpp>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace loom::optim {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  //!< torch.optim.AdamW's defaults
  double weight_decay = 0.01;
};

//! AdamW over the parameters described by specs (decay where ParamSpec::decay).
template <class T>
class AdamW {
 public:
  using acc = kernels::cpu::acc_t<T>;
  AdamW(std::vector<models::ParamSpec> specs, std::int64_t n, AdamWConfig cfg = {})
      : specs_(std::move(specs)), cfg_(cfg), m_(Tensor<acc>::zeros({n})), v_(Tensor<acc>::zeros({n})) {}

  void step(const Tensor<T>& params, const Tensor<T>& grads, double lr) {
    ++t_;
    for (const auto& s : specs_) {
      const auto n = static_cast<std::size_t>(numel_of(s.shape));
      kernels::cpu::adamw_step(params.data() + s.offset, grads.data() + s.offset, m_.data() + s.offset,
                               v_.data() + s.offset, n, lr, cfg_.beta1, cfg_.beta2, cfg_.eps,
                               s.decay ? cfg_.weight_decay : 0.0, t_);
    }
  }
  int steps() const { return t_; }
  const Tensor<acc>& first_moment() const { return m_; }
  const Tensor<acc>& second_moment() const { return v_; }
  //! Named state for checkpoints: the moments, and the step count.
  std::vector<std::pair<std::string, Tensor<acc>>> state() const { return {{"adamw.exp_avg", m_}, {"adamw.exp_avg_sq", v_}}; }
  int counter() const { return t_; }
  void set_counter(int t) { t_ = t; }
  static constexpr const char* name = "adamw";

 private:
  std::vector<models::ParamSpec> specs_;
  AdamWConfig cfg_;
  Tensor<acc> m_, v_;
  int t_ = 0;
};

struct SgdConfig {
  double momentum = 0.9;
  double weight_decay = 0.0;
};

//! SGD with momentum (torch.optim.SGD, dampening 0, no Nesterov).
template <class T>
class Sgd {
 public:
  using acc = kernels::cpu::acc_t<T>;
  Sgd(std::vector<models::ParamSpec> specs, std::int64_t n, SgdConfig cfg = {})
      : specs_(std::move(specs)), cfg_(cfg), buf_(Tensor<acc>::zeros({n})) {}

  void step(const Tensor<T>& params, const Tensor<T>& grads, double lr) {
    for (const auto& s : specs_)
      kernels::cpu::sgd_step(params.data() + s.offset, grads.data() + s.offset, buf_.data() + s.offset,
                             static_cast<std::size_t>(numel_of(s.shape)), lr, cfg_.momentum,
                             s.decay ? cfg_.weight_decay : 0.0, first_);
    first_ = false;
  }

 private:
  std::vector<models::ParamSpec> specs_;
  SgdConfig cfg_;
  Tensor<acc> buf_;
  bool first_ = true;

 public:
  //! Named state for checkpoints: the momentum buffer, and whether a step was taken.
  std::vector<std::pair<std::string, Tensor<acc>>> state() const { return {{"sgd.momentum_buffer", buf_}}; }
  int counter() const { return first_ ? 0 : 1; }
  void set_counter(int t) { first_ = t == 0; }
  static constexpr const char* name = "sgd";
};

//! The L2 norm of all gradients.
template <class T>
double grad_norm(const Tensor<T>& grads) {
  double s = 0;
  const T* g = grads.data();
  for (std::int64_t i = 0; i < grads.numel(); ++i) s += static_cast<double>(g[i]) * static_cast<double>(g[i]);
  return std::sqrt(s);
}

//! Scales the gradients, whose global norm is `norm`, so that it becomes at most max_norm (0: no clipping).
template <class T>
void clip_to(const Tensor<T>& grads, double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return;
  const auto scale = static_cast<kernels::cpu::acc_t<T>>(max_norm / (norm + 1e-6));
  T* g = grads.data();
  for (std::int64_t i = 0; i < grads.numel(); ++i)
    g[i] = static_cast<T>(static_cast<kernels::cpu::acc_t<T>>(g[i]) * scale);
}

//! Scales the gradients so that their global norm is at most max_norm (torch.nn.utils.clip_grad_norm_); returns
//! the norm before clipping.
template <class T>
double clip_grad_norm(const Tensor<T>& grads, double max_norm) {
  const double norm = grad_norm(grads);
  clip_to(grads, norm, max_norm);
  return norm;
}

//! Linear warmup over `warmup` steps to lr, then constant (step is 0-based).
inline double warmup_lr(double lr, int step, int warmup) {
  return warmup > 0 && step < warmup ? lr * (step + 1) / warmup : lr;
}

}  // namespace loom::optim

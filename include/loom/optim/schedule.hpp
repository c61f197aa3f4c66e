// Learning-rate schedules: a linear warm-up, then constant, cosine, linear or warmup-stable-decay (WSD) down to a
// floor. A schedule is a function of the optimizer step alone, so that a run resumed from a checkpoint at step s
// continues where the uninterrupted run would be.
#pragma once

#include <loom/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <optional>
#include <string>
#include <string_view>

namespace loom::optim {

//! What the learning rate does after the warm-up.
enum class LrShape {
  constant,  //!< stays at the peak
  cosine,    //!< half a cosine from the peak to min_lr over the decay
  linear,    //!< a straight line from the peak to min_lr over the decay
  wsd,       //!< warmup-stable-decay: the peak until the last `decay_fraction` of the decay, then linear to min_lr
};

//! "constant", "cosine", "linear", "wsd".
constexpr std::string_view describe(LrShape s) {
  return s == LrShape::constant ? "constant" : s == LrShape::cosine ? "cosine" : s == LrShape::linear ? "linear" : "wsd";
}
//! The shape describe() names `name`, or none.
inline std::optional<LrShape> lr_shape_named(std::string_view name) {
  for (LrShape s : {LrShape::constant, LrShape::cosine, LrShape::linear, LrShape::wsd})
    if (describe(s) == name) return s;
  return std::nullopt;
}

//! The learning rate of 0-based step s: (s + 1) / warmup of the peak during the first `warmup` steps; then, for the
//! steps up to `decay_steps` (the step at which the decay ends, counted from 0 like s), the shape's curve from the
//! peak to min_lr; min_lr after it. With p = (s - warmup) / (decay_steps - warmup), the fraction of the decay done:
//! cosine min_lr + (lr - min_lr)(1 + cos πp)/2, linear min_lr + (lr - min_lr)(1 - p); wsd holds the peak until
//! p = 1 - decay_fraction and then falls linearly to min_lr at p = 1.
struct LrSchedule {
  LrShape shape = LrShape::constant;
  double lr = 3e-3;             //!< the peak
  double min_lr = 0;            //!< the floor the decay ends at
  int warmup = 0;               //!< steps of linear warm-up
  int decay_steps = 0;          //!< where the decay ends (cosine, linear, wsd); at least warmup + 1
  double decay_fraction = 0.2;  //!< wsd: the share of the steps after warm-up that decay

  //! Refuses a schedule that cannot be followed, naming the values.
  void check() const {
    LOOM_CHECK(lr > 0, "the learning rate must be positive, got ", lr);
    LOOM_CHECK(min_lr >= 0 && min_lr <= lr, "the minimum learning rate must be in [0, lr = ", lr, "], got ", min_lr);
    LOOM_CHECK(warmup >= 0, "the warm-up must not be negative, got ", warmup);
    LOOM_CHECK(shape == LrShape::constant || decay_steps > warmup, "a ", describe(shape), " schedule decays until "
               "step ", decay_steps, ", which must come after the ", warmup, " warm-up steps");
    LOOM_CHECK(decay_fraction > 0 && decay_fraction <= 1, "the WSD decay fraction must be in (0, 1], got ",
               decay_fraction);
  }

  double operator()(int step) const {
    if (warmup > 0 && step < warmup) return lr * (step + 1) / warmup;
    if (shape == LrShape::constant) return lr;
    if (step >= decay_steps) return min_lr;
    const double p = double(step - warmup) / double(decay_steps - warmup);
    switch (shape) {
      case LrShape::cosine: return min_lr + (lr - min_lr) * 0.5 * (1 + std::cos(std::numbers::pi * p));
      case LrShape::linear: return min_lr + (lr - min_lr) * (1 - p);
      default: {
        const double start = 1 - decay_fraction;
        return p <= start ? lr : min_lr + (lr - min_lr) * (1 - (p - start) / decay_fraction);
      }
    }
  }
};

}  // namespace loom::optim

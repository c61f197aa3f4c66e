// AdamW and SGD with momentum, element for element as torch.optim computes them (the single-tensor path): the
// bias corrections and step size in double, the element-wise arithmetic in acc_t<T> and in torch's order.
// Include <loom/kernels/cpu/ops.hpp> instead.
#pragma once

#include <loom/kernels/cpu/detail/common.hpp>

#include <cmath>

namespace loom::kernels::cpu::detail {

//! Calls f(param, grad, offset, count) on chunks, with param and grad as acc_t<T> arrays (bf16/fp16 converted in
//! and param rounded back out).
inline constexpr std::size_t optimizer_chunk = 512;

//! With master (fp32 master weights of bf16/fp16 parameters) the update acts on master, which it reads from param on
//! the first step (`init`), and param is master rounded.
template <class T, class F>
void optimizer_chunks(T* param, const T* grad, std::size_t n, acc_t<T>* master, bool init, F&& f) {
  using A = acc_t<T>;
  constexpr std::size_t chunk = optimizer_chunk;
  if constexpr (!std::is_same_v<T, A>) {
    if (master != nullptr) {
      A gbuf[chunk];
      for (std::size_t i0 = 0; i0 < n; i0 += chunk) {
        const std::size_t m = std::min(chunk, n - i0);
        if (init)
          for (std::size_t i = 0; i < m; ++i) master[i0 + i] = static_cast<A>(param[i0 + i]);
        for (std::size_t i = 0; i < m; ++i) gbuf[i] = static_cast<A>(grad[i0 + i]);
        f(arr(master + i0, m), arr(static_cast<const A*>(gbuf), m), i0, m);
        for (std::size_t i = 0; i < m; ++i) param[i0 + i] = static_cast<T>(master[i0 + i]);
      }
      return;
    }
  }
  if constexpr (std::is_same_v<T, A>) {
    for (std::size_t i0 = 0; i0 < n; i0 += chunk) {
      const std::size_t m = std::min(chunk, n - i0);
      f(arr(param + i0, m), arr(grad + i0, m), i0, m);
    }
  } else {
    A pbuf[chunk], gbuf[chunk];
    for (std::size_t i0 = 0; i0 < n; i0 += chunk) {
      const std::size_t m = std::min(chunk, n - i0);
      for (std::size_t i = 0; i < m; ++i) pbuf[i] = static_cast<A>(param[i0 + i]);
      for (std::size_t i = 0; i < m; ++i) gbuf[i] = static_cast<A>(grad[i0 + i]);
      f(arr(pbuf, m), arr(static_cast<const A*>(gbuf), m), i0, m);
      for (std::size_t i = 0; i < m; ++i) param[i0 + i] = static_cast<T>(pbuf[i]);
    }
  }
}

}  // namespace loom::kernels::cpu::detail

namespace loom::kernels::cpu {

template <class T>
void adamw_step(T* param, const T* grad, acc_t<T>* m, acc_t<T>* v, std::size_t n, double lr, double beta1,
                double beta2, double eps, double weight_decay, int t, acc_t<T>* master) {
  detail::check_type<T>();
  using A = acc_t<T>;
  // torch: param.mul_(1 - lr wd); exp_avg.mul_(b1).add_(g, alpha=1 - b1); exp_avg_sq.mul_(b2).addcmul_(g, g,
  // value=1 - b2); denom = (exp_avg_sq.sqrt() / sqrt(1 - b2^t)).add_(eps); param.addcdiv_(exp_avg, denom,
  // value=-lr / (1 - b1^t)). Python's scalars are doubles, cast to the tensor's type by each operation.
  const A decay = A(1.0 - lr * weight_decay);
  const A b1 = A(beta1), one_minus_b1 = A(1.0 - beta1), b2 = A(beta2), one_minus_b2 = A(1.0 - beta2);
  const A bc2_sqrt = A(std::sqrt(1.0 - std::pow(beta2, t)));
  const A step = A(-lr / (1.0 - std::pow(beta1, t)));
  const A e = A(eps);
  detail::optimizer_chunks(param, grad, n, master, t == 1, [&](auto P, const auto& G, std::size_t i0, std::size_t c) {
    auto M = detail::arr(m + i0, c);
    auto V = detail::arr(v + i0, c);
    P *= decay;
    M = M * b1 + G * one_minus_b1;
    V = V * b2 + one_minus_b2 * G * G;
    P += step * M / (V.sqrt() / bc2_sqrt + e);
  });
}

template <class T>
void sgd_step(T* param, const T* grad, acc_t<T>* buf, std::size_t n, double lr, double momentum, double weight_decay,
              bool first, acc_t<T>* master) {
  detail::check_type<T>();
  using A = acc_t<T>;
  const A wd = A(weight_decay), mom = A(momentum), step = A(-lr);
  // torch: grad = grad.add(param, alpha=wd); buf.mul_(momentum).add_(grad) (or buf = grad on the first step);
  // param.add_(buf, alpha=-lr). With momentum 0 torch keeps no buffer; buf (may be null then) is set to g.
  detail::optimizer_chunks(param, grad, n, master, first, [&](auto P, const auto& G, std::size_t i0, std::size_t c) {
    A gbuf[detail::optimizer_chunk];
    auto g = detail::arr(gbuf, c);
    if (weight_decay != 0.0) g = G + wd * P;
    else g = G;
    if (momentum != 0.0) {
      auto Bf = detail::arr(buf + i0, c);
      if (!first) g = Bf * mom + g;
      Bf = g;
    } else if (buf != nullptr) {
      detail::arr(buf + i0, c) = g;
    }
    P += step * g;
  });
}

}  // namespace loom::kernels::cpu

// Cross-entropy over a slice of the vocabulary through per-row (max, sum of exp) partials, which compose across
// slices exactly as one softmax. Include <loom/kernels/cpu/ops.hpp> instead.
#pragma once

#include <loom/kernels/cpu/detail/common.hpp>

#include <cmath>
#include <limits>

namespace loom::kernels::cpu {

template <class T>
void ce_partials(const T* logits, acc_t<T>* row_max, acc_t<T>* row_sumexp, int R, int V_local, std::ptrdiff_t ld) {
  detail::check_type<T>();
  using A = acc_t<T>;
  const std::size_t n = std::size_t(V_local);
  if (ld == 0) ld = V_local;
  std::vector<A> buf;
  for (int r = 0; r < R; ++r) {
    if (n == 0) {  // an empty slice: the neutral partials
      row_max[r] = -std::numeric_limits<A>::infinity();
      row_sumexp[r] = A(0);
      continue;
    }
    const auto L = detail::arr(detail::load(logits + std::ptrdiff_t(r) * ld, n, buf), n);
    const A mx = L.maxCoeff();
    row_max[r] = mx;
    row_sumexp[r] = (L - mx).exp().sum();
  }
}

template <class T>
void ce_rescale(const acc_t<T>* local_max, const acc_t<T>* global_max, acc_t<T>* sumexp, int R) {
  detail::check_type<T>();
  for (int r = 0; r < R; ++r)  // an empty slice (sum 0, max -inf) stays 0 rather than 0 * exp(nan)
    if (sumexp[r] != acc_t<T>(0)) sumexp[r] *= std::exp(local_max[r] - global_max[r]);
}

template <class T>
void ce_target_logit(const T* logits, const std::int32_t* targets, acc_t<T>* target_logit, int R, int V_local,
                     int v0, std::ptrdiff_t ld) {
  detail::check_type<T>();
  if (ld == 0) ld = V_local;
  for (int r = 0; r < R; ++r) {
    const std::int64_t v = std::int64_t(targets[r]) - v0;
    target_logit[r] = (v >= 0 && v < V_local) ? static_cast<acc_t<T>>(logits[std::ptrdiff_t(r) * ld + v])
                                               : acc_t<T>(0);
  }
}

template <class T>
void ce_losses(const acc_t<T>* row_max, const acc_t<T>* row_sumexp, const acc_t<T>* target_logit, T* losses, int R) {
  detail::check_type<T>();
  for (int r = 0; r < R; ++r) losses[r] = static_cast<T>(std::log(row_sumexp[r]) + row_max[r] - target_logit[r]);
}

template <class T>
void ce_backward(const T* logits, const std::int32_t* targets, const acc_t<T>* row_max, const acc_t<T>* row_sumexp,
                 const T* dloss, T* dlogits, int R, int V_local, int v0, std::ptrdiff_t ld) {
  detail::check_type<T>();
  using A = acc_t<T>;
  const std::size_t n = std::size_t(V_local);
  if (ld == 0) ld = V_local;
  std::vector<A> lbuf, obuf;
  for (int r = 0; r < R; ++r) {
    const std::ptrdiff_t o = std::ptrdiff_t(r) * ld;
    const A dl = static_cast<A>(dloss[r]);
    const auto L = detail::arr(detail::load(logits + o, n, lbuf), n);
    A* d = detail::result(dlogits + o, n, obuf);
    detail::arr(d, n) = (L - row_max[r]).exp() * (dl / row_sumexp[r]);
    const std::int64_t v = std::int64_t(targets[r]) - v0;
    if (v >= 0 && v < V_local) d[v] -= dl;
    detail::store(dlogits + o, n, obuf);
  }
}

template <class T>
void cross_entropy_forward(const T* logits, const std::int32_t* targets, T* losses, acc_t<T>* row_max,
                           acc_t<T>* row_sumexp, int R, int V) {
  detail::check_type<T>();
  std::vector<acc_t<T>> target(std::size_t(std::max(R, 0)));
  ce_partials(logits, row_max, row_sumexp, R, V, 0);
  ce_target_logit(logits, targets, target.data(), R, V, 0, 0);
  ce_losses<T>(row_max, row_sumexp, target.data(), losses, R);
}

}  // namespace loom::kernels::cpu

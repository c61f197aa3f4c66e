// RMS norm over the last dimension (Llama's): forward and the two halves of backward; the reciprocal root mean
// square in acc_t<T>, kept for backward. Include <loom/kernels/cpu/ops.hpp> instead.
#pragma once

#include <loom/kernels/cpu/detail/common.hpp>

#include <cmath>

namespace loom::kernels::cpu {

template <class T>
void rmsnorm_forward(const T* x, const T* w, T* out, acc_t<T>* rstd, int R, int C, double eps) {
  detail::check_type<T>();
  using A = acc_t<T>;
  const std::size_t n = std::size_t(C);
  std::vector<A> wbuf, xbuf, obuf;
  const auto W = detail::arr(detail::load(w, n, wbuf), n);
  for (int r = 0; r < R; ++r) {
    const std::ptrdiff_t o = std::ptrdiff_t(r) * C;
    const auto X = detail::arr(detail::load(x + o, n, xbuf), n);
    const A rs = A(1) / std::sqrt(X.square().sum() / A(C) + A(eps));
    detail::arr(detail::result(out + o, n, obuf), n) = X * rs * W;
    detail::store(out + o, n, obuf);
    rstd[r] = rs;
  }
}

// y = x rs w with rs = (mean(x^2) + eps)^-1/2: dx = rs (g - x rs^2 mean(g x)), g = dout w.
template <class T>
void rmsnorm_backward_input(const T* dout, const T* x, const T* w, const acc_t<T>* rstd, T* dx, int R, int C,
                            const T* dres) {
  detail::check_type<T>();
  using A = acc_t<T>;
  const std::size_t n = std::size_t(C);
  std::vector<A> wbuf, xbuf, dbuf, obuf;
  std::vector<T> own(dres ? n : 0);  // with a residual: the norm's part of a row, then added to it
  const auto W = detail::arr(detail::load(w, n, wbuf), n);
  for (int r = 0; r < R; ++r) {
    const std::ptrdiff_t o = std::ptrdiff_t(r) * C;
    const auto X = detail::arr(detail::load(x + o, n, xbuf), n);
    const auto G = detail::arr(detail::load(dout + o, n, dbuf), n) * W;
    const A rs = rstd[r];
    const A gx_mean = (G * X).sum() / A(C);
    T* part = dres ? own.data() : dx + o;
    detail::arr(detail::result(part, n, obuf), n) = rs * (G - X * (rs * rs * gx_mean));
    detail::store(part, n, obuf);
    if (dres) add<T>(part, dres + o, dx + o, n);
  }
}

template <class T>
void rmsnorm_backward_weight(const T* dout, const T* x, const acc_t<T>* rstd, T* dw, int R, int C) {
  detail::check_type<T>();
  using A = acc_t<T>;
  const std::size_t n = std::size_t(C);
  std::vector<A> xbuf, dbuf, dw_sum(n, A(0));
  auto DW = detail::arr(dw_sum.data(), n);
  for (int r = 0; r < R; ++r) {
    const std::ptrdiff_t o = std::ptrdiff_t(r) * C;
    const auto X = detail::arr(detail::load(x + o, n, xbuf), n);
    const auto D = detail::arr(detail::load(dout + o, n, dbuf), n);
    DW += D * (X * rstd[r]);
  }
  for (std::size_t c = 0; c < n; ++c) dw[c] = static_cast<T>(static_cast<A>(dw[c]) + dw_sum[c]);
}

}  // namespace loom::kernels::cpu

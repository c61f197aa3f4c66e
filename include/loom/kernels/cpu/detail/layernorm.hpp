// Layer norm over the last dimension, forward and the two halves of backward; statistics in acc_t<T>, two-pass
// variance (biased, as torch). Include <loom/kernels/cpu/ops.hpp> instead.
#pragma once

#include <loom/kernels/cpu/detail/common.hpp>

#include <cmath>

namespace loom::kernels::cpu {

template <class T>
void layernorm_forward(const T* x, const T* w, const T* b, T* out, acc_t<T>* mean, acc_t<T>* rstd, int R, int C,
                       double eps) {
  detail::check_type<T>();
  using A = acc_t<T>;
  const std::size_t n = std::size_t(C);
  std::vector<A> wbuf, bbuf, xbuf, obuf;
  const auto W = detail::arr(detail::load(w, n, wbuf), n);
  const auto Bv = detail::arr(detail::load(b, n, bbuf), n);
  for (int r = 0; r < R; ++r) {
    const std::ptrdiff_t o = std::ptrdiff_t(r) * C;
    const auto X = detail::arr(detail::load(x + o, n, xbuf), n);
    const A mu = X.sum() / A(C);
    const A var = (X - mu).square().sum() / A(C);
    const A rs = A(1) / std::sqrt(var + A(eps));
    detail::arr(detail::result(out + o, n, obuf), n) = (X - mu) * rs * W + Bv;
    detail::store(out + o, n, obuf);
    mean[r] = mu;
    rstd[r] = rs;
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dout w.
template <class T>
void layernorm_backward_input(const T* dout, const T* x, const T* w, const acc_t<T>* mean, const acc_t<T>* rstd,
                              T* dx, int R, int C, const T* dres) {
  detail::check_type<T>();
  using A = acc_t<T>;
  const std::size_t n = std::size_t(C);
  std::vector<A> wbuf, xbuf, dbuf, obuf;
  std::vector<T> own(dres ? n : 0);  // with a residual: the norm's part of a row, then added to it
  const auto W = detail::arr(detail::load(w, n, wbuf), n);
  for (int r = 0; r < R; ++r) {
    const std::ptrdiff_t o = std::ptrdiff_t(r) * C;
    const auto X = detail::arr(detail::load(x + o, n, xbuf), n);
    const auto G = detail::arr(detail::load(dout + o, n, dbuf), n) * W;  // an expression, recomputed per pass
    const A mu = mean[r], rs = rstd[r];
    const A g_mean = G.sum() / A(C);
    const A gx_mean = (G * (X - mu)).sum() * rs / A(C);
    T* part = dres ? own.data() : dx + o;
    detail::arr(detail::result(part, n, obuf), n) = rs * (G - g_mean - (X - mu) * (rs * gx_mean));
    detail::store(part, n, obuf);
    if (dres) add<T>(part, dres + o, dx + o, n);
  }
}

template <class T>
void layernorm_backward_weight(const T* dout, const T* x, const acc_t<T>* mean, const acc_t<T>* rstd, T* dw, T* db,
                               int R, int C) {
  detail::check_type<T>();
  using A = acc_t<T>;
  const std::size_t n = std::size_t(C);
  std::vector<A> xbuf, dbuf, dw_sum(n, A(0)), db_sum(n, A(0));
  auto DW = detail::arr(dw_sum.data(), n);
  auto DB = detail::arr(db_sum.data(), n);
  for (int r = 0; r < R; ++r) {
    const std::ptrdiff_t o = std::ptrdiff_t(r) * C;
    const auto X = detail::arr(detail::load(x + o, n, xbuf), n);
    const auto D = detail::arr(detail::load(dout + o, n, dbuf), n);
    DW += D * ((X - mean[r]) * rstd[r]);
    DB += D;
  }
  for (std::size_t c = 0; c < n; ++c) {
    dw[c] = static_cast<T>(static_cast<A>(dw[c]) + dw_sum[c]);
    db[c] = static_cast<T>(static_cast<A>(db[c]) + db_sum[c]);
  }
}

}  // namespace loom::kernels::cpu

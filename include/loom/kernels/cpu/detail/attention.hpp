// Attention in 64 x 64 tiles with an online softmax (FlashAttention-2 on the CPU): only tiles and per-head T x D
// copies are held, never T x T. Causal self-attention, or a block of ring attention (keys of their own count, all
// visible, or the causal diagonal). Backward recomputes each tile's probabilities from q, k and the kept log-sum-exp.
// Include <loom/kernels/cpu/ops.hpp> instead.
#pragma once

#include <loom/core/error.hpp>
#include <loom/kernels/cpu/detail/common.hpp>

#include <cmath>
#include <limits>

namespace loom::kernels::cpu::detail {

// Tiles of 64 queries x 64 keys: their products are large enough for Eigen's GEMM, their rows small enough to
// stay in cache (larger or unequal tiles measured no faster).
inline constexpr int attention_q_tile = 64;
inline constexpr int attention_k_tile = 64;

//! T rows of D elements, ld apart in src, into a contiguous T x D buffer (times scale).
template <class T, class A>
void gather_rows(const T* src, std::ptrdiff_t ld, int T_, int D, A* dst, A scale = A(1)) {
  for (int t = 0; t < T_; ++t)
    for (int d = 0; d < D; ++d) dst[std::ptrdiff_t(t) * D + d] = static_cast<A>(src[t * ld + d]) * scale;
}

template <class T, class A>
void scatter_rows(const A* src, T* dst, std::ptrdiff_t ld, int T_, int D, A scale = A(1)) {
  for (int t = 0; t < T_; ++t)
    for (int d = 0; d < D; ++d) dst[t * ld + d] = static_cast<T>(src[std::ptrdiff_t(t) * D + d] * scale);
}

//! Sets entries of the tile rows [i0, i0 + br) x keys [j0, j0 + bc) with key > query to value.
template <class Tile, class A>
void mask_future(Tile& tile, int i0, int br, int j0, int bc, A value) {
  if (j0 + bc - 1 <= i0) return;  // the whole tile is at or below the diagonal
  for (int r = 0; r < br; ++r)
    for (int c = std::max(0, i0 + r + 1 - j0); c < bc; ++c) tile(r, c) = value;
}

}  // namespace loom::kernels::cpu::detail

namespace loom::kernels::cpu {

template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, acc_t<T>* lse, const AttentionShape& s) {
  detail::check_type<T>();
  kernels::check_shape(s);
  using A = acc_t<T>;
  using Mat = detail::RowMat<A>;
  using Vec = Eigen::Matrix<A, Eigen::Dynamic, 1>;
  constexpr int qt = detail::attention_q_tile, kt = detail::attention_k_tile;
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  const int T_ = s.T, Tk = s.keys(), D = s.D, group = s.Hq / s.Hkv;
  const bool causal = s.causal;
  const int rows = std::min(qt, std::max(T_, 1)), cols = std::min(kt, std::max(Tk, 1));
  // The (sequence, kv head) pairs share the rank's threads; each tile's products run on one (a team per 64 x 64
  // product costs more than it saves: on 2 cores one sequence of 8192 tokens took 1.8 times as long).
  const int pairs = s.B * s.Hkv;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic) if (pairs > 1)
#endif
  for (int bk = 0; bk < pairs; ++bk) {
    Mat K(Tk, D), V(Tk, D), Q(T_, D), O(rows, D), S(rows, cols);
    Vec m(rows), l(rows), m_new(rows), corr(rows);
    const int b = bk / s.Hkv;
    {
      const int kh = bk % s.Hkv;
      detail::gather_rows(k + std::ptrdiff_t(b) * Tk * s.ldkv + kh * D, s.ldkv, Tk, D, K.data());
      detail::gather_rows(v + std::ptrdiff_t(b) * Tk * s.ldkv + kh * D, s.ldkv, Tk, D, V.data());
      for (int h = kh * group; h < (kh + 1) * group; ++h) {
        // The scale is folded into q: S = (scale q) k^T.
        detail::gather_rows(q + b * T_ * s.ldq + h * D, s.ldq, T_, D, Q.data(), A(s.scale));
        A* lse_bh = lse + (std::ptrdiff_t(b) * s.Hq + h) * T_;
        for (int i0 = 0; i0 < T_; i0 += qt) {
          const int br = std::min(qt, T_ - i0);
          auto o = O.topRows(br);
          o.setZero();
          m.head(br).setConstant(neg_inf);
          l.head(br).setZero();
          const int key_end = causal ? i0 + br : Tk;  // causal: keys up to the tile's last query
          for (int j0 = 0; j0 < key_end; j0 += kt) {
            const int bc = std::min(kt, key_end - j0);
            auto sc = S.topLeftCorner(br, bc);
            sc.noalias() = Q.middleRows(i0, br) * K.middleRows(j0, bc).transpose();
            if (causal) detail::mask_future(sc, i0, br, j0, bc, neg_inf);
            m_new.head(br) = m.head(br).cwiseMax(sc.rowwise().maxCoeff());
            // Every row sees key 0 in the first tile, so m_new is finite and exp(m - m_new) is 0 or real.
            corr.head(br) = (m.head(br) - m_new.head(br)).array().exp();
            sc = (sc.array().colwise() - m_new.head(br).array()).exp();
            if (causal) detail::mask_future(sc, i0, br, j0, bc, A(0));  // exactly 0, not exp's clamp of -inf
            l.head(br) = l.head(br).cwiseProduct(corr.head(br)) + sc.rowwise().sum();
            o.array().colwise() *= corr.head(br).array();
            o.noalias() += sc * V.middleRows(j0, bc);
            m.head(br) = m_new.head(br);
          }
          for (int r = 0; r < br; ++r) {
            const A inv = A(1) / l(r);
            T* dst = out + (std::ptrdiff_t(b) * T_ + i0 + r) * s.ldo + std::ptrdiff_t(h) * D;
            for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(o(r, d) * inv);
            lse_bh[i0 + r] = m(r) + std::log(l(r));
          }
        }
      }
    }
  }
}

// For each query tile i and key tile j <= i: P = exp(S - lse), dV_j += P^T dO_i, dP = dO_i V_j^T,
// dS = P (dP - D_i) with D_i = rowsum(dO_i O_i), dQ_i += scale dS K_j, dK_j += scale dS^T Q_i. A kv head's dK and
// dV sum over its query heads.
template <class T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const acc_t<T>* lse, T* dq,
                        T* dk, T* dv, const AttentionShape& s) {
  detail::check_type<T>();
  kernels::check_shape(s);
  using A = acc_t<T>;
  using Mat = detail::RowMat<A>;
  using Vec = Eigen::Matrix<A, Eigen::Dynamic, 1>;
  constexpr int qt = detail::attention_q_tile, kt = detail::attention_k_tile;
  const int T_ = s.T, Tk = s.keys(), D = s.D, group = s.Hq / s.Hkv;
  const bool causal = s.causal;
  const A scale = A(s.scale);
  const int rows = std::min(qt, std::max(T_, 1)), cols = std::min(kt, std::max(Tk, 1));
  const int pairs = s.B * s.Hkv;  // shared by the rank's threads, as in forward
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic) if (pairs > 1)
#endif
  for (int bk = 0; bk < pairs; ++bk) {
    Mat K(Tk, D), V(Tk, D), dK(Tk, D), dV(Tk, D), Q(T_, D), dO(T_, D), dQ(T_, D), P(rows, cols), dP(rows, cols);
    Vec Di(T_);
    const int b = bk / s.Hkv;
    {
      const int kh = bk % s.Hkv;
      detail::gather_rows(k + std::ptrdiff_t(b) * Tk * s.ldkv + kh * D, s.ldkv, Tk, D, K.data());
      detail::gather_rows(v + std::ptrdiff_t(b) * Tk * s.ldkv + kh * D, s.ldkv, Tk, D, V.data());
      dK.setZero();
      dV.setZero();
      for (int h = kh * group; h < (kh + 1) * group; ++h) {
        detail::gather_rows(q + b * T_ * s.ldq + h * D, s.ldq, T_, D, Q.data(), scale);
        detail::gather_rows(dout + b * T_ * s.ldo + h * D, s.ldo, T_, D, dO.data());
        for (int t = 0; t < T_; ++t) {
          const T* o = out + (std::ptrdiff_t(b) * T_ + t) * s.ldo + std::ptrdiff_t(h) * D;
          A acc = 0;
          for (int d = 0; d < D; ++d) acc += dO(t, d) * static_cast<A>(o[d]);
          Di(t) = acc;
        }
        const A* lse_bh = lse + (std::ptrdiff_t(b) * s.Hq + h) * T_;
        const auto L = Eigen::Map<const Vec>(lse_bh, T_);
        dQ.setZero();
        for (int i0 = 0; i0 < T_; i0 += qt) {
          const int br = std::min(qt, T_ - i0);
          const auto Qi = Q.middleRows(i0, br);
          const auto dOi = dO.middleRows(i0, br);
          const int key_end = causal ? i0 + br : Tk;
          for (int j0 = 0; j0 < key_end; j0 += kt) {
            const int bc = std::min(kt, key_end - j0);
            auto p = P.topLeftCorner(br, bc);
            auto dp = dP.topLeftCorner(br, bc);
            p.noalias() = Qi * K.middleRows(j0, bc).transpose();
            p = (p.array().colwise() - L.segment(i0, br).array()).exp();
            if (causal) detail::mask_future(p, i0, br, j0, bc, A(0));
            dV.middleRows(j0, bc).noalias() += p.transpose() * dOi;
            dp.noalias() = dOi * V.middleRows(j0, bc).transpose();
            dp = p.array() * (dp.array().colwise() - Di.segment(i0, br).array());  // dS, in dP's place
            dQ.middleRows(i0, br).noalias() += dp * K.middleRows(j0, bc);
            dK.middleRows(j0, bc).noalias() += dp.transpose() * Qi;  // Q holds scale q
          }
        }
        detail::scatter_rows(dQ.data(), dq + b * T_ * s.ldq + h * D, s.ldq, T_, D, scale);
      }
      detail::scatter_rows(dK.data(), dk + std::ptrdiff_t(b) * Tk * s.ldkv + kh * D, s.ldkv, Tk, D);
      detail::scatter_rows(dV.data(), dv + std::ptrdiff_t(b) * Tk * s.ldkv + kh * D, s.ldkv, Tk, D);
    }
  }
}

}  // namespace loom::kernels::cpu

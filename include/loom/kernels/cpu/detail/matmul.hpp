// matmul: Eigen's GEMM on row-major maps for float and double (no copies: transposes are views); bf16/fp16
// through float blocks. Include <loom/kernels/cpu/ops.hpp> instead.
#pragma once

#include <loom/kernels/cpu/detail/common.hpp>

namespace loom::kernels::cpu::detail {

//! C = alpha op(A) op(B) + beta C with A, B, C in the same type; beta = 0 never reads C (it may hold NaN).
template <bool TA, bool TB, class A, class Lhs, class Rhs, class Dst>
void gemm_eval(const Lhs& a, const Rhs& b, Dst&& c, A alpha, A beta) {
  auto run = [&](const auto& oa, const auto& ob) {
    if (a.size() == 0 || b.size() == 0) {  // K = 0: the product is zero
      if (beta == A(0)) c.setZero();
      else c *= beta;
    } else if (beta == A(0)) {
      c.noalias() = alpha * oa * ob;
    } else {
      if (beta != A(1)) c *= beta;
      c.noalias() += alpha * oa * ob;
    }
  };
  if constexpr (TA && TB) run(a.transpose(), b.transpose());
  else if constexpr (TA) run(a.transpose(), b);
  else if constexpr (TB) run(a, b.transpose());
  else run(a, b);
}

//! Row strides of the stored operands and of C, in elements.
struct Strides {
  std::ptrdiff_t a, b, c;
};
template <bool TA, bool TB>
Strides dense(int M, int N, int K) {
  return {TA ? M : K, TB ? K : N, N};
}

template <bool TA, bool TB, class T>
void gemm_direct(const T* A, const T* B, T* C, int M, int N, int K, T alpha, T beta, Strides ld) {
  const auto a = mat(A, TA ? K : M, TA ? M : K, ld.a);
  const auto b = mat(B, TB ? N : K, TB ? K : N, ld.b);
  gemm_eval<TA, TB>(a, b, mat(C, M, N, ld.c), alpha, beta);
}

//! bf16/fp16: C is computed in float blocks of MB x NB over K blocks of KB; the operand blocks are converted once
//! per C block, which costs little beside the block's 2 MB NB K flops.
template <bool TA, bool TB, class T>
void gemm_blocked(const T* A, const T* B, T* C, int M, int N, int K, float alpha, float beta, Strides ld) {
  constexpr int MB = 256, NB = 256, KB = 256;
  const std::ptrdiff_t lda = ld.a, ldb = ld.b;
  std::vector<float> abuf(std::size_t(std::min(M, MB)) * std::min(K, KB));
  std::vector<float> bbuf(std::size_t(std::min(K, KB)) * std::min(N, NB));
  std::vector<float> cbuf(std::size_t(std::min(M, MB)) * std::min(N, NB));
  for (int n0 = 0; n0 < N; n0 += NB) {
    const int nb = std::min(NB, N - n0);
    for (int m0 = 0; m0 < M; m0 += MB) {
      const int mb = std::min(MB, M - m0);
      auto c = mat(cbuf.data(), mb, nb, nb);
      if (K == 0) c.setZero();
      for (int k0 = 0; k0 < K; k0 += KB) {
        const int kb = std::min(KB, K - k0);
        // The stored blocks: op(A)[m0.., k0..] is A[k0.., m0..] when transposed; likewise for B.
        const int ar = TA ? kb : mb, ac = TA ? mb : kb;
        const int br = TB ? nb : kb, bc = TB ? kb : nb;
        auto a = mat(abuf.data(), ar, ac, ac);
        auto b = mat(bbuf.data(), br, bc, bc);
        a = mat(A + (TA ? std::ptrdiff_t(k0) * lda + m0 : std::ptrdiff_t(m0) * lda + k0), ar, ac, lda)
                .template cast<float>();
        b = mat(B + (TB ? std::ptrdiff_t(n0) * ldb + k0 : std::ptrdiff_t(k0) * ldb + n0), br, bc, ldb)
                .template cast<float>();
        gemm_eval<TA, TB>(a, b, c, 1.0f, k0 == 0 ? 0.0f : 1.0f);
      }
      auto out = mat(C + std::ptrdiff_t(m0) * ld.c + n0, mb, nb, ld.c);
      if (beta == 0.0f) out = (alpha * c).template cast<T>();
      else out = (alpha * c + beta * out.template cast<float>()).template cast<T>();
    }
  }
}

template <bool TA, bool TB, class T>
void gemm_one(const T* A, const T* B, T* C, int M, int N, int K, float alpha, float beta, Strides ld) {
  if constexpr (is_low_precision_v<T>) gemm_blocked<TA, TB>(A, B, C, M, N, K, alpha, beta, ld);
  else gemm_direct<TA, TB>(A, B, C, M, N, K, T(alpha), T(beta), ld);
}

template <bool TA, bool TB, class T>
void gemm_batched(const T* A, const T* B, T* C, int M, int N, int K, float alpha, float beta, int batch,
                  std::ptrdiff_t sa, std::ptrdiff_t sb, std::ptrdiff_t sc) {
  for (int i = 0; i < batch; ++i)
    gemm_one<TA, TB>(A + i * sa, B + i * sb, C + i * sc, M, N, K, alpha, beta, dense<TA, TB>(M, N, K));
}

}  // namespace loom::kernels::cpu::detail

namespace loom::kernels::cpu {

template <class T>
void matmul(const T* A, const T* B, T* C, int M, int N, int K, bool trans_a, bool trans_b, float alpha, float beta,
            int batch, std::ptrdiff_t stride_a, std::ptrdiff_t stride_b, std::ptrdiff_t stride_c) {
  detail::check_type<T>();
  if (M <= 0 || N <= 0 || batch <= 0) return;
  using detail::gemm_batched;
  if (trans_a && trans_b) gemm_batched<true, true>(A, B, C, M, N, K, alpha, beta, batch, stride_a, stride_b, stride_c);
  else if (trans_a) gemm_batched<true, false>(A, B, C, M, N, K, alpha, beta, batch, stride_a, stride_b, stride_c);
  else if (trans_b) gemm_batched<false, true>(A, B, C, M, N, K, alpha, beta, batch, stride_a, stride_b, stride_c);
  else gemm_batched<false, false>(A, B, C, M, N, K, alpha, beta, batch, stride_a, stride_b, stride_c);
}

template <class T>
void matmul_ld(const T* A, std::ptrdiff_t lda, const T* B, std::ptrdiff_t ldb, T* C, std::ptrdiff_t ldc, int M, int N,
               int K, bool trans_a, bool trans_b, float alpha, float beta) {
  detail::check_type<T>();
  if (M <= 0 || N <= 0) return;
  using detail::gemm_one;
  const detail::Strides ld{lda, ldb, ldc};
  if (trans_a && trans_b) gemm_one<true, true>(A, B, C, M, N, K, alpha, beta, ld);
  else if (trans_a) gemm_one<true, false>(A, B, C, M, N, K, alpha, beta, ld);
  else if (trans_b) gemm_one<false, true>(A, B, C, M, N, K, alpha, beta, ld);
  else gemm_one<false, false>(A, B, C, M, N, K, alpha, beta, ld);
}

}  // namespace loom::kernels::cpu

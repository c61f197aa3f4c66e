// Matrix products on the device through cuBLASLt: row-major C = op(A) op(B) is the column-major C^T = op(B)^T
// op(A)^T, so the operands swap; bf16/fp16 compute in fp32 (CUBLAS_COMPUTE_32F), float in full fp32 (no TF32),
// double in fp64; batches by strides. Each thread keeps, per device, a cuBLASLt handle and the plans (descriptors
// and the heuristic's algorithm) of the shapes it has run; the workspace comes from the caching allocator.
#pragma once

#include <loom/kernels/cuda/elementwise.cuh>

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>

namespace loom::kernels::cuda {

namespace detail {

template <class T>
struct BlasTypes;
template <>
struct BlasTypes<float> {
  static constexpr cudaDataType_t data = CUDA_R_32F, scale = CUDA_R_32F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  using Scalar = float;
};
template <>
struct BlasTypes<double> {
  static constexpr cudaDataType_t data = CUDA_R_64F, scale = CUDA_R_64F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_64F;
  using Scalar = double;
};
template <>
struct BlasTypes<__nv_bfloat16> {
  static constexpr cudaDataType_t data = CUDA_R_16BF, scale = CUDA_R_32F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  using Scalar = float;
};
template <>
struct BlasTypes<__half> {
  static constexpr cudaDataType_t data = CUDA_R_16F, scale = CUDA_R_32F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  using Scalar = float;
};

//! The most workspace a product may use (what cuBLAS recommends for Hopper).
inline constexpr std::size_t gemm_workspace_limit = std::size_t{32} << 20;

//! Everything the algorithm choice depends on.
struct GemmKey {
  cudaDataType_t type;
  int M, N, K, batch;
  bool trans_a, trans_b;
  std::int64_t stride_a, stride_b, stride_c;
  int align_a, align_b, align_c;
  bool operator==(const GemmKey&) const = default;
};
struct GemmKeyHash {
  std::size_t operator()(const GemmKey& k) const {
    std::size_t h = 0;
    auto mix = [&](std::int64_t v) { h ^= std::hash<std::int64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    mix(k.type);
    mix(k.M);
    mix(k.N);
    mix(k.K);
    mix(k.batch);
    mix(k.trans_a * 2 + k.trans_b);
    mix(k.stride_a);
    mix(k.stride_b);
    mix(k.stride_c);
    mix((k.align_a << 20) ^ (k.align_b << 10) ^ k.align_c);
    return h;
  }
};

//! The descriptors of one product and the algorithm cuBLASLt's heuristic chose (found = false: none; the product
//! then goes through cublasGemmStridedBatchedEx).
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLAS's A (our B), B (our A), C
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace = 0;
  bool found = false;

  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {
    // Errors are ignored: at thread exit the driver may already be shutting down.
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

//! One thread's cuBLASLt state on one device.
class BlasContext {
 public:
  BlasContext() { LOOM_CUBLAS(cublasLtCreate(&lt_)); }
  BlasContext(const BlasContext&) = delete;
  BlasContext& operator=(const BlasContext&) = delete;
  ~BlasContext() {
    plans_.clear();
    if (blas_) cublasDestroy(blas_);
    cublasLtDestroy(lt_);
  }

  cublasLtHandle_t lt() const { return lt_; }
  cublasHandle_t blas() {
    if (!blas_) LOOM_CUBLAS(cublasCreate(&blas_));
    return blas_;
  }
  template <class T>
  const GemmPlan& plan(const GemmKey& key) {
    auto it = plans_.find(key);
    if (it == plans_.end()) it = plans_.emplace(key, make_plan<T>(key)).first;
    return *it->second;
  }

 private:
  template <class T>
  std::unique_ptr<GemmPlan> make_plan(const GemmKey& k) {
    using BT = BlasTypes<T>;
    auto p = std::make_unique<GemmPlan>();
    LOOM_CUBLAS(cublasLtMatmulDescCreate(&p->op, BT::compute, BT::scale));
    const cublasOperation_t op_a = k.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS's A is our B
    const cublasOperation_t op_b = k.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    // Column-major views of the row-major operands: B (K x N, or N x K when trans_b), A (M x K, or K x M), C (M x N).
    const std::uint64_t M = k.M, N = k.N, K = k.K;
    LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p->a, BT::data, k.trans_b ? K : N, k.trans_b ? N : K,
                                           std::int64_t(k.trans_b ? K : N)));
    LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p->b, BT::data, k.trans_a ? M : K, k.trans_a ? K : M,
                                           std::int64_t(k.trans_a ? M : K)));
    LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p->c, BT::data, N, M, std::int64_t(N)));
    if (k.batch > 1) {
      const std::int32_t count = k.batch;
      auto batched = [&](cublasLtMatrixLayout_t l, std::int64_t stride) {
        LOOM_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
        LOOM_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                     sizeof(stride)));
      };
      batched(p->a, k.stride_b);
      batched(p->b, k.stride_a);
      batched(p->c, k.stride_c);
    }
    cublasLtMatmulPreference_t pref = nullptr;
    LOOM_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    const std::uint64_t ws = gemm_workspace_limit;
    const std::uint32_t al_a = k.align_b, al_b = k.align_a, al_c = k.align_c;
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t rc = [&] {
      cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
      auto set = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* v, std::size_t n) {
        if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulPreferenceSetAttribute(pref, attr, v, n);
      };
      set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
      set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
      set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
      set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c));
      set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c));
      if (s != CUBLAS_STATUS_SUCCESS) return s;
      return cublasLtMatmulAlgoGetHeuristic(lt_, p->op, p->a, p->b, p->c, p->c, pref, 1, &result, &found);
    }();
    cublasLtMatmulPreferenceDestroy(pref);
    // No algorithm for this combination (e.g. an unusual stride) is not an error: the fallback runs it.
    if (rc != CUBLAS_STATUS_NOT_SUPPORTED) LOOM_CUBLAS(rc);
    if (rc == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
      p->algo = result.algo;
      p->workspace = result.workspaceSize;
      p->found = true;
    }
    return p;
  }

  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  std::unordered_map<GemmKey, std::unique_ptr<GemmPlan>, GemmKeyHash> plans_;
};

//! This thread's context on the current device.
inline BlasContext& blas_context() {
  thread_local std::map<int, std::unique_ptr<BlasContext>> contexts;
  auto& c = contexts[current_device()];
  if (!c) c = std::make_unique<BlasContext>();
  return *c;
}

//! The largest power of two up to 256 dividing the address of every batch's matrix.
inline int alignment_of(const void* p, std::int64_t stride_bytes, int batch) {
  std::uint64_t v = reinterpret_cast<std::uintptr_t>(p) | 256;
  if (batch > 1) v |= static_cast<std::uint64_t>(stride_bytes);
  return static_cast<int>(v & (~v + 1));
}

template <class T>
void matmul(const T* A, const T* B, T* C, int M, int N, int K, bool trans_a, bool trans_b, float alpha, float beta,
            int batch, std::ptrdiff_t stride_a, std::ptrdiff_t stride_b, std::ptrdiff_t stride_c,
            cudaStream_t stream) {
  using BT = BlasTypes<T>;
  using Scalar = typename BT::Scalar;
  LOOM_CHECK(M >= 0 && N >= 0 && K >= 0 && batch >= 0, "matmul: negative size (M=", M, ", N=", N, ", K=", K,
             ", batch=", batch, ")");
  if (M == 0 || N == 0 || batch == 0) return;
  if (K == 0) {  // op(A) op(B) is zero: C = beta C in every batch
    for (int i = 0; i < batch; ++i)
      launch_map(Scale<T>{C + i * stride_c, acc_t<T>(beta)}, std::size_t(M) * N, false, stream, "matmul");
    return;
  }
  if (batch == 1) stride_a = stride_b = stride_c = 0;
  const GemmKey key{BT::data,
                    M,
                    N,
                    K,
                    batch,
                    trans_a,
                    trans_b,
                    stride_a,
                    stride_b,
                    stride_c,
                    alignment_of(A, stride_a * std::int64_t(sizeof(T)), batch),
                    alignment_of(B, stride_b * std::int64_t(sizeof(T)), batch),
                    alignment_of(C, stride_c * std::int64_t(sizeof(T)), batch)};
  BlasContext& ctx = blas_context();
  const GemmPlan& plan = ctx.plan<T>(key);
  const Scalar al = Scalar(alpha), be = Scalar(beta);
  if (plan.found) {
    CudaBuffer<unsigned char> workspace(plan.workspace, stream);
    LOOM_CUBLAS(cublasLtMatmul(ctx.lt(), plan.op, &al, B, plan.a, A, plan.b, &be, C, plan.c, C, plan.c, &plan.algo,
                               workspace.data(), plan.workspace, stream));
    return;
  }
  cublasHandle_t h = ctx.blas();
  LOOM_CUBLAS(cublasSetStream(h, stream));
  LOOM_CUBLAS(cublasGemmStridedBatchedEx(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         N, M, K, &al, B, BT::data, trans_b ? K : N, stride_b, A, BT::data,
                                         trans_a ? M : K, stride_a, &be, C, BT::data, N, stride_c, batch, BT::compute,
                                         CUBLAS_GEMM_DEFAULT));
}

}  // namespace detail

//! C = alpha * op(A) * op(B) + beta * C, for `batch` independent products; op(A) is M x K (A stored M x K, or K x M
//! when trans_a), op(B) is K x N (B stored K x N, or N x K when trans_b), C is M x N; all row-major and contiguous;
//! batch i uses A + i*stride_a, B + i*stride_b, C + i*stride_c. bf16/fp16 accumulate in float.
template <Floating T>
void matmul(const T* A, const T* B, T* C, int M, int N, int K, bool trans_a, bool trans_b, float alpha, float beta,
            int batch, std::ptrdiff_t stride_a, std::ptrdiff_t stride_b, std::ptrdiff_t stride_c,
            cudaStream_t stream) {
  detail::matmul(detail::dev(A), detail::dev(B), detail::dev(C), M, N, K, trans_a, trans_b, alpha, beta, batch,
                 stride_a, stride_b, stride_c, stream);
}
//! C = op(A) op(B), one product.
template <Floating T>
void matmul(const T* A, const T* B, T* C, int M, int N, int K, bool trans_a, bool trans_b, cudaStream_t stream) {
  matmul(A, B, C, M, N, K, trans_a, trans_b, 1.0f, 0.0f, 1, 0, 0, 0, stream);
}
//! C = alpha op(A) op(B) + beta C, one product.
template <Floating T>
void matmul(const T* A, const T* B, T* C, int M, int N, int K, bool trans_a, bool trans_b, float alpha, float beta,
            cudaStream_t stream) {
  matmul(A, B, C, M, N, K, trans_a, trans_b, alpha, beta, 1, 0, 0, 0, stream);
}

}  // namespace loom::kernels::cuda

// Matrix products on the device through cuBLASLt: row-major C = op(A) op(B) is the column-major C^T = op(B)^T
// op(A)^T, so the operands swap; bf16/fp16 compute in fp32 (CUBLAS_COMPUTE_32F), float in full fp32 (no TF32),
// double in fp64; batches by strides. Each thread keeps, per device, a cuBLASLt handle and the plans (descriptors
// and the heuristic's algorithm) of the shapes it has run; the workspace comes from the caching allocator.
#pragma once

#include <loom/kernels/cuda/elementwise.cuh>

#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

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

//! What cuBLASLt does to a product as it stores it (GemmKey::epilogue): nothing, add a bias to every row, the same
//! and then GELU (tanh form) keeping its input (forward of an MLP's first layer, with or without the bias),
//! multiply by the GELU's derivative at a kept input (backward), or sum our B's rows into the bias pointer (a
//! weight gradient's product giving its bias's gradient: cuBLAS's A is our B, whose columns are the bias's, and
//! the sum runs over the product's inner size).
enum class Epilogue { plain, bias, gelu_bias, gelu, dgelu, bgrad };
inline cublasLtEpilogue_t epilogue_of(Epilogue e) {
  switch (e) {
    case Epilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::gelu_bias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::gelu: return CUBLASLT_EPILOGUE_GELU_AUX;
    case Epilogue::dgelu: return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::bgrad: return CUBLASLT_EPILOGUE_BGRADA;
    default: return CUBLASLT_EPILOGUE_DEFAULT;
  }
}
//! Whether epilogue e keeps or reads the GELU's input (the aux matrix).
constexpr bool with_aux(Epilogue e) {
  return e == Epilogue::gelu_bias || e == Epilogue::gelu || e == Epilogue::dgelu;
}
//! Whether epilogue e reads or writes the bias pointer.
constexpr bool with_bias_pointer(Epilogue e) {
  return e == Epilogue::bias || e == Epilogue::gelu_bias || e == Epilogue::bgrad;
}

//! Everything the algorithm choice depends on.
struct GemmKey {
  cudaDataType_t type;
  int M, N, K, batch;
  bool trans_a, trans_b;
  std::int64_t stride_a, stride_b, stride_c;
  int align_a, align_b, align_c;
  std::int64_t ld_a = 0, ld_b = 0, ld_c = 0;  //!< row strides of the row-major operands; 0: dense
  Epilogue epilogue = Epilogue::plain;        //!< what cuBLASLt does to the product as it stores it
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
    mix(k.ld_a);
    mix(k.ld_b);
    mix(k.ld_c);
    mix(static_cast<int>(k.epilogue));
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
    if (k.epilogue != Epilogue::plain) {
      // A bias is one value per row of the column-major C^T, per column of our C; the GELU's input is stored
      // (forward) or read (backward) laid out as C. The heuristic reads the pointers' alignment from their values:
      // stand-ins on 16 bytes, all that epilogue_product checks. Whatever the library refuses leaves the plan
      // without an algorithm, and the caller runs the epilogue as a pass of its own.
      const cublasLtEpilogue_t epilogue = epilogue_of(k.epilogue);
      const void* stand_in = reinterpret_cast<const void*>(std::uintptr_t{16});
      const std::int64_t aux_ld = k.N;
      const bool gelu = with_aux(k.epilogue);
      const bool with_bias = with_bias_pointer(k.epilogue);
      cublasStatus_t st = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                         sizeof(epilogue));
      if (st == CUBLAS_STATUS_SUCCESS && with_bias)
        st = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &stand_in, sizeof(stand_in));
      if (st == CUBLAS_STATUS_SUCCESS && gelu)
        st = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld));
      if (st == CUBLAS_STATUS_SUCCESS && gelu)
        st = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &stand_in,
                                            sizeof(stand_in));
      if (st != CUBLAS_STATUS_SUCCESS) return p;
    }
    // Column-major views of the row-major operands: B (K x N, or N x K when trans_b), A (M x K, or K x M), C (M x N).
    const std::uint64_t M = k.M, N = k.N, K = k.K;
    LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p->a, BT::data, k.trans_b ? K : N, k.trans_b ? N : K,
                                           k.ld_b ? k.ld_b : std::int64_t(k.trans_b ? K : N)));
    LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p->b, BT::data, k.trans_a ? M : K, k.trans_a ? K : M,
                                           k.ld_a ? k.ld_a : std::int64_t(k.trans_a ? M : K)));
    LOOM_CUBLAS(cublasLtMatrixLayoutCreate(&p->c, BT::data, N, M, k.ld_c ? k.ld_c : std::int64_t(N)));
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
    // No algorithm for this combination (e.g. an unusual stride, an epilogue the library lacks) is not an error:
    // the fallback runs it.
    if (rc != CUBLAS_STATUS_NOT_SUPPORTED && k.epilogue == Epilogue::plain) LOOM_CUBLAS(rc);
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

//! Runs the product `key` describes (row strides key.ld_*, or dense; batches by key.stride_*) through cuBLASLt's
//! plan for it, or cublasGemmStridedBatchedEx where the heuristic offered none.
template <class T>
void run_product(const GemmKey& key, const T* A, const T* B, T* C, float alpha, float beta, cudaStream_t stream) {
  using BT = BlasTypes<T>;
  using Scalar = typename BT::Scalar;
  BlasContext& ctx = blas_context();
  const GemmPlan& plan = ctx.plan<T>(key);
  const Scalar al = Scalar(alpha), be = Scalar(beta);
  if (plan.found) {
    CudaBuffer<unsigned char> workspace(plan.workspace, stream);
    LOOM_CUBLAS(cublasLtMatmul(ctx.lt(), plan.op, &al, B, plan.a, A, plan.b, &be, C, plan.c, C, plan.c, &plan.algo,
                               workspace.data(), plan.workspace, stream));
    return;
  }
  const int M = key.M, N = key.N, K = key.K;
  const std::int64_t lda = key.ld_a ? key.ld_a : (key.trans_a ? M : K);
  const std::int64_t ldb = key.ld_b ? key.ld_b : (key.trans_b ? K : N), ldc = key.ld_c ? key.ld_c : N;
  cublasHandle_t h = ctx.blas();
  LOOM_CUBLAS(cublasSetStream(h, stream));
  LOOM_CUBLAS(cublasGemmStridedBatchedEx(h, key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &al, B, BT::data,
                                         static_cast<int>(ldb), key.stride_b, A, BT::data, static_cast<int>(lda),
                                         key.stride_a, &be, C, BT::data, static_cast<int>(ldc), key.stride_c,
                                         key.batch, BT::compute, CUBLAS_GEMM_DEFAULT));
}

//! One product with row strides of its own (lda, ldb, ldc elements; 16-byte multiples).
template <class T>
void strided_product(const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T* C, std::int64_t ldc, int M,
                     int N, int K, bool trans_a, bool trans_b, float alpha, float beta, cudaStream_t stream) {
  GemmKey key{BlasTypes<T>::data, M, N, K, 1, trans_a, trans_b, 0, 0, 0, alignment_of(A, 0, 1),
              alignment_of(B, 0, 1), alignment_of(C, 0, 1)};
  key.ld_a = lda, key.ld_b = ldb, key.ld_c = ldc;
  run_product(key, A, B, C, alpha, beta, stream);
}

//! A product whose FLOPs reach pad_min_flops and outnumber the bytes its padded copies move (read and written) by
//! pad_min_intensity<T> runs on copies with 16-byte row strides where a row stride is not one (GPT-2's vocabulary
//! of 50257 makes the logits' rows 100514 bytes): Hopper's fast kernels need aligned rows. The copies pay where
//! the slow kernels lose more time than they take: at about a third of bf16's tensor-core rate against 3.35 TB/s,
//! from about 150 FLOPs a byte moved; float and double, which lose less, from less.
inline constexpr double pad_min_flops = double(1 << 28);
template <class T>
inline constexpr double pad_min_intensity = sizeof(T) == 2 ? 128 : sizeof(T) == 4 ? 32 : 16;
//! How many products this process ran on padded copies (what the tests check).
inline std::atomic<long>& padded_products() {
  static std::atomic<long> n{0};
  return n;
}

//! Whether rows of T ld elements apart keep 16-byte alignment (what Hopper's fast kernels and the epilogues need).
template <class T>
constexpr bool rows_of_16_bytes(std::int64_t ld) {
  return ld * std::int64_t(sizeof(T)) % 16 == 0;
}

//! Runs the product on padded copies of its operands whose row strides (lda, ldb, ldc) are not multiples of 16
//! bytes, when that pays (pad_min_flops, pad_min_intensity); returns whether it did.
template <class T>
bool padded_product(const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T* C, std::int64_t ldc, int M, int N,
                    int K, bool trans_a, bool trans_b, float alpha, float beta, cudaStream_t stream) {
  constexpr std::int64_t unit = 128 / sizeof(T);  // padded rows: whole 128-byte lines
  struct Operand {
    std::int64_t rows, ld;
    bool pad() const { return !rows_of_16_bytes<T>(ld); }
    std::int64_t padded() const { return (ld + unit - 1) / unit * unit; }
  };
  const Operand a{trans_a ? K : M, lda}, b{trans_b ? N : K, ldb}, c{M, ldc};
  if (!a.pad() && !b.pad() && !c.pad()) return false;
  const double flops = 2.0 * M * N * K;
  double moved = 0;  // each copy reads and writes the operand; C is copied back, and in first where beta is not 0
  for (const Operand* o : {&a, &b, &c})
    if (o->pad()) moved += 2.0 * double(o->rows) * double(o->ld) * sizeof(T) * (o == &c && beta != 0 ? 2 : 1);
  if (flops < pad_min_flops || flops < pad_min_intensity<T> * moved) return false;
  auto copy = [&](const T* src, std::int64_t lds, T* dst, std::int64_t ldd, std::int64_t rows, std::int64_t w) {
    LOOM_CUDA(cudaMemcpy2DAsync(dst, std::size_t(ldd) * sizeof(T), src, std::size_t(lds) * sizeof(T),
                                std::size_t(w) * sizeof(T), std::size_t(rows), cudaMemcpyDeviceToDevice, stream));
  };
  CudaBuffer<T> pa(a.pad() ? std::size_t(a.rows * a.padded()) : 0, stream);
  CudaBuffer<T> pb(b.pad() ? std::size_t(b.rows * b.padded()) : 0, stream);
  CudaBuffer<T> pc(c.pad() ? std::size_t(c.rows * c.padded()) : 0, stream);
  const std::int64_t width_a = trans_a ? M : K, width_b = trans_b ? K : N;
  if (a.pad()) copy(A, a.ld, pa.data(), a.padded(), a.rows, width_a);
  if (b.pad()) copy(B, b.ld, pb.data(), b.padded(), b.rows, width_b);
  if (c.pad() && beta != 0) copy(C, c.ld, pc.data(), c.padded(), c.rows, N);
  strided_product(a.pad() ? pa.data() : A, a.pad() ? a.padded() : a.ld, b.pad() ? pb.data() : B,
                  b.pad() ? b.padded() : b.ld, c.pad() ? pc.data() : C, c.pad() ? c.padded() : c.ld, M, N, K,
                  trans_a, trans_b, alpha, beta, stream);
  if (c.pad()) copy(pc.data(), c.padded(), C, c.ld, c.rows, N);
  ++padded_products();
  return true;
}

//! The sizes of one product, refused where negative.
inline void check_sizes(int M, int N, int K) {
  LOOM_CHECK(M >= 0 && N >= 0 && K >= 0, "matmul: negative size (M=", M, ", N=", N, ", K=", K, ")");
}

template <class T>
void matmul(const T* A, const T* B, T* C, int M, int N, int K, bool trans_a, bool trans_b, float alpha, float beta,
            int batch, std::ptrdiff_t stride_a, std::ptrdiff_t stride_b, std::ptrdiff_t stride_c,
            cudaStream_t stream) {
  using BT = BlasTypes<T>;
  LOOM_CHECK(M >= 0 && N >= 0 && K >= 0 && batch >= 0, "matmul: negative size (M=", M, ", N=", N, ", K=", K,
             ", batch=", batch, ")");
  if (M == 0 || N == 0 || batch == 0) return;
  if (K == 0) {  // op(A) op(B) is zero: C = beta C in every batch (zeros where beta is 0, as BLAS writes them)
    for (int i = 0; i < batch; ++i) {
      if (beta == 0) LOOM_CUDA(cudaMemsetAsync(C + i * stride_c, 0, std::size_t(M) * N * sizeof(T), stream));
      else launch_map(Scale<T>{C + i * stride_c, acc_t<T>(beta)}, std::size_t(M) * N, false, stream, "matmul");
    }
    return;
  }
  if (batch == 1) stride_a = stride_b = stride_c = 0;
  if (batch == 1 && padded_product(A, trans_a ? M : K, B, trans_b ? K : N, C, N, M, N, K, trans_a, trans_b, alpha,
                                   beta, stream))
    return;
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
  run_product(key, A, B, C, alpha, beta, stream);
}

//! How many products this process ran with cuBLASLt's epilogue doing more (a bias, a GELU or its derivative, a
//! bias's gradient) or reading a residual as C (what the tests check).
inline std::atomic<long>& fused_epilogues() {
  static std::atomic<long> n{0};
  return n;
}

//! C = alpha op(A) op(B) + beta C_in through cuBLASLt's epilogue e (bias: N values; aux: the GELU's input, M x N),
//! dense operands, C_in being `in` where given (an M x N matrix other than C: a residual) and C itself otherwise;
//! returns false, having done nothing, where the type, the rows' alignment or the heuristic rule it out. The GELU
//! epilogues take 16-bit types only (cuBLASLt's GELU is not float's accuracy); an inner size of one (an outer
//! product) takes the separate passes, as PyTorch's addmm does, cuBLASLt's epilogues being unreliable there.
template <class T>
bool epilogue_product(Epilogue e, const T* A, const T* B, const T* bias, T* aux, T* C, int M, int N, int K,
                      bool trans_a, bool trans_b, cudaStream_t stream, float alpha = 1.0f, float beta = 0.0f,
                      const T* in = nullptr) {
  using BT = BlasTypes<T>;
  const bool gelu = with_aux(e);
  if (std::is_same_v<T, double> || (gelu && sizeof(T) != 2) || K < 2 || !rows_of_16_bytes<T>(trans_a ? M : K) ||
      !rows_of_16_bytes<T>(trans_b ? K : N) || !rows_of_16_bytes<T>(N) || (bias && !aligned(bias, 16)) ||
      (aux && !aligned(aux, 16)))
    return false;
  GemmKey key{BT::data, M, N, K, 1, trans_a, trans_b, 0, 0, 0, alignment_of(A, 0, 1), alignment_of(B, 0, 1),
              in ? std::min(alignment_of(C, 0, 1), alignment_of(in, 0, 1)) : alignment_of(C, 0, 1)};
  key.epilogue = e;
  BlasContext& ctx = blas_context();
  const GemmPlan& plan = ctx.plan<T>(key);
  if (!plan.found) return false;
  using Scalar = typename BT::Scalar;
  const Scalar al = Scalar(alpha), be = Scalar(beta);
  if (bias)
    LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (aux)
    LOOM_CUBLAS(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
  CudaBuffer<unsigned char> workspace(plan.workspace, stream);
  LOOM_CUBLAS(cublasLtMatmul(ctx.lt(), plan.op, &al, B, plan.a, A, plan.b, &be, in ? in : C, plan.c, C, plan.c,
                             &plan.algo, workspace.data(), plan.workspace, stream));
  ++fused_epilogues();
  return true;
}

//! C = alpha op(A) B + beta C, dbias += the column sums of B (K x N): the bias's gradient summed in the product's
//! epilogue into a scratch vector, then added (the epilogue writes; a gradient accumulates), or a second pass.
template <class T>
void matmul_bgrad(const T* A, const T* B, T* C, T* dbias, int M, int N, int K, bool trans_a, float alpha, float beta,
                  cudaStream_t stream) {
  check_sizes(M, N, K);
  if (N == 0) return;
  if (M > 0 && K > 0 && alpha == 1.0f) {  // whether the epilogue's sums take alpha is not the library's word
    CudaBuffer<T> sums(std::size_t(N), stream);
    if (epilogue_product<T>(Epilogue::bgrad, A, B, sums.data(), nullptr, C, M, N, K, trans_a, false, stream, alpha,
                            beta)) {
      accumulate(sums.data(), dbias, std::size_t(N), stream);
      return;
    }
  }
  if (M > 0) matmul(A, B, C, M, N, K, trans_a, false, alpha, beta, 1, 0, 0, 0, stream);
  bias_backward(B, dbias, K, N, stream);
}

//! C = op(A) op(B) + bias on every row.
template <class T>
void matmul_bias(const T* A, const T* B, const T* bias, T* C, int M, int N, int K, bool trans_a, bool trans_b,
                 cudaStream_t stream) {
  check_sizes(M, N, K);
  if (M == 0 || N == 0) return;
  if (epilogue_product<T>(Epilogue::bias, A, B, bias, nullptr, C, M, N, K, trans_a, trans_b, stream)) return;
  matmul(A, B, C, M, N, K, trans_a, trans_b, 1.0f, 0.0f, 1, 0, 0, 0, stream);
  bias_add(C, bias, C, M, N, stream);
}

//! C = op(A) op(B) (+ bias on every row, where bias is given) + R: a residual R (M x N, not C) read as the
//! product's C, with the bias in the epilogue, where cuBLASLt takes them; else the product and an add.
template <class T>
void matmul_residual(const T* A, const T* B, const T* bias, const T* R, T* C, int M, int N, int K, bool trans_a,
                     bool trans_b, cudaStream_t stream) {
  check_sizes(M, N, K);
  LOOM_CHECK(R != C, "matmul_residual: the residual must not be the output (M=", M, ", N=", N, ")");
  if (M == 0 || N == 0) return;
  if (epilogue_product<T>(bias ? Epilogue::bias : Epilogue::plain, A, B, bias, nullptr, C, M, N, K, trans_a, trans_b,
                          stream, 1.0f, 1.0f, R))
    return;
  if (bias) matmul_bias(A, B, bias, C, M, N, K, trans_a, trans_b, stream);
  else matmul(A, B, C, M, N, K, trans_a, trans_b, 1.0f, 0.0f, 1, 0, 0, 0, stream);
  add(R, C, C, std::size_t(M) * N, stream);
}

//! pre = op(A) op(B) (+ bias on every row, where bias is given), C = GELU(pre).
template <class T>
void matmul_bias_gelu(const T* A, const T* B, const T* bias, T* pre, T* C, int M, int N, int K, bool trans_a,
                      bool trans_b, cudaStream_t stream) {
  check_sizes(M, N, K);
  if (M == 0 || N == 0) return;
  if (epilogue_product<T>(bias ? Epilogue::gelu_bias : Epilogue::gelu, A, B, bias, pre, C, M, N, K, trans_a,
                          trans_b, stream))
    return;
  if (bias) matmul_bias(A, B, bias, pre, M, N, K, trans_a, trans_b, stream);
  else matmul(A, B, pre, M, N, K, trans_a, trans_b, 1.0f, 0.0f, 1, 0, 0, 0, stream);
  gelu_forward(pre, C, std::size_t(M) * N, stream);
}

//! C = (op(A) op(B)) GELU'(pre), element by element.
template <class T>
void matmul_dgelu(const T* A, const T* B, const T* pre, T* C, int M, int N, int K, bool trans_a, bool trans_b,
                  cudaStream_t stream) {
  check_sizes(M, N, K);
  if (M == 0 || N == 0) return;
  if (epilogue_product<T>(Epilogue::dgelu, A, B, nullptr, const_cast<T*>(pre), C, M, N, K, trans_a, trans_b,
                          stream))
    return;
  matmul(A, B, C, M, N, K, trans_a, trans_b, 1.0f, 0.0f, 1, 0, 0, 0, stream);
  gelu_backward(pre, C, C, std::size_t(M) * N, stream);
}

template <class T>
void matmul_ld(const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T* C, std::int64_t ldc, int M, int N, int K,
               bool trans_a, bool trans_b, float alpha, float beta, cudaStream_t stream) {
  const std::int64_t width_a = trans_a ? M : K, width_b = trans_b ? K : N;
  check_sizes(M, N, K);
  if (M == 0 || N == 0) return;
  LOOM_CHECK(lda >= std::max<std::int64_t>(width_a, 1) && ldb >= std::max<std::int64_t>(width_b, 1) && ldc >= N,
             "matmul: a row stride shorter than its row (lda=", lda, " for ", width_a, " columns, ldb=", ldb, " for ",
             width_b, ", ldc=", ldc, " for ", N, ")");
  if (K == 0) {  // C = beta C, row by row
    if (beta == 0) {
      LOOM_CUDA(cudaMemset2DAsync(C, std::size_t(ldc) * sizeof(T), 0, std::size_t(N) * sizeof(T), std::size_t(M),
                                  stream));
    } else {
      for (int r = 0; r < M; ++r)
        launch_map(Scale<T>{C + r * ldc, acc_t<T>(beta)}, std::size_t(N), false, stream, "matmul");
    }
    return;
  }
  if (padded_product(A, lda, B, ldb, C, ldc, M, N, K, trans_a, trans_b, alpha, beta, stream)) return;
  strided_product(A, lda, B, ldb, C, ldc, M, N, K, trans_a, trans_b, alpha, beta, stream);
}

//! How many groups of products this process ran as one grouped product of cuBLAS (what the tests check).
inline std::atomic<long>& grouped_products() {
  static std::atomic<long> n{0};
  return n;
}

//! The products of a group (device element type T) in one call of cuBLAS's grouped product: each a problem of its
//! own sizes, consecutive products of equal sizes sharing a group of the call, their operands' addresses uploaded
//! to the device on the stream. A product without rows or columns is skipped, one without an inner size scales C
//! by beta (as matmul does), and a group left with a single product, one of 16-bit operands off 16 bytes, or one
//! the library has no grouped kernels for (CUBLAS_STATUS_NOT_SUPPORTED), runs as matmul, product by product.
template <class T>
void matmul_group(const Product<T>* ps, std::size_t count, bool trans_a, bool trans_b, float alpha, float beta,
                  cudaStream_t stream) {
  using BT = BlasTypes<T>;
  using Scalar = typename BT::Scalar;
  check_group(ps, count);
  std::vector<const Product<T>*> run;  // the products cuBLAS computes
  for (std::size_t i = 0; i < count; ++i) {
    const Product<T>& p = ps[i];
    if (p.m == 0 || p.n == 0) continue;
    if (p.k == 0) matmul(p.a, p.b, p.c, p.m, p.n, 0, trans_a, trans_b, alpha, beta, 1, 0, 0, 0, stream);
    else run.push_back(&p);
  }
  if (run.empty()) return;
  const auto one_by_one = [&] {
    for (const Product<T>* p : run)
      matmul(p->a, p->b, p->c, p->m, p->n, p->k, trans_a, trans_b, alpha, beta, 1, 0, 0, 0, stream);
  };
  // 16-bit operands on 16 bytes, rows of 16-byte multiples: what the grouped kernels read in packs (a mixture of
  // experts' widths are multiples of 8 in practice; other groups go one product at a time).
  const auto packed = [&](const Product<T>& p) {
    if constexpr (sizeof(T) != 2) return true;
    else
      return aligned(p.a, 16) && aligned(p.b, 16) && aligned(p.c, 16) && p.n % 8 == 0 &&
             (trans_b ? p.k : p.n) % 8 == 0 && (trans_a ? p.m : p.k) % 8 == 0;
  };
  if (run.size() == 1 || !std::all_of(run.begin(), run.end(), [&](const Product<T>* p) { return packed(*p); }))
    return one_by_one();
  // Column-major, as run_product: C^T (n x m) = op(B)^T (n x k) op(A)^T (k x m), cuBLAS's A being our B.
  std::vector<int> m, n, k, lda, ldb, ldc, size;
  std::vector<Scalar> alphas, betas;
  std::vector<cublasOperation_t> op_a, op_b;
  std::vector<const void*> pointers(3 * run.size());  // cuBLAS's A array, then its B array, then C's
  for (std::size_t i = 0; i < run.size(); ++i) {
    const Product<T>& p = *run[i];
    pointers[i] = p.b, pointers[run.size() + i] = p.a, pointers[2 * run.size() + i] = p.c;
    if (!m.empty() && m.back() == p.n && n.back() == p.m && k.back() == p.k) {
      ++size.back();
      continue;
    }
    m.push_back(p.n), n.push_back(p.m), k.push_back(p.k);
    lda.push_back(trans_b ? p.k : p.n), ldb.push_back(trans_a ? p.m : p.k), ldc.push_back(p.n);
    alphas.push_back(Scalar(alpha)), betas.push_back(Scalar(beta)), size.push_back(1);
    op_a.push_back(trans_b ? CUBLAS_OP_T : CUBLAS_OP_N), op_b.push_back(trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  }
  // A copy from pageable memory has read it when the call returns: the host vector may go.
  CudaBuffer<const void*> on_device(pointers.size(), stream);
  LOOM_CUDA(cudaMemcpyAsync(on_device.data(), pointers.data(), pointers.size() * sizeof(const void*),
                            cudaMemcpyHostToDevice, stream));
  const void* const* A = on_device.data();
  const void* const* B = A + run.size();
  void* const* C = const_cast<void* const*>(A + 2 * run.size());
  cublasHandle_t h = blas_context().blas();
  LOOM_CUBLAS(cublasSetStream(h, stream));
  const int groups = static_cast<int>(m.size());
  const cublasStatus_t status = [&] {
    if constexpr (std::is_same_v<T, double>)
      return cublasDgemmGroupedBatched(h, op_a.data(), op_b.data(), m.data(), n.data(), k.data(), alphas.data(),
                                       reinterpret_cast<const double* const*>(A), lda.data(),
                                       reinterpret_cast<const double* const*>(B), ldb.data(), betas.data(),
                                       reinterpret_cast<double* const*>(C), ldc.data(), groups, size.data());
    else
      return cublasGemmGroupedBatchedEx(h, op_a.data(), op_b.data(), m.data(), n.data(), k.data(), alphas.data(), A,
                                        BT::data, lda.data(), B, BT::data, ldb.data(), betas.data(), C, BT::data,
                                        ldc.data(), groups, size.data(), BT::compute);
  }();
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return one_by_one();  // a library without grouped kernels for it
  cublas_check(status, std::is_same_v<T, double> ? "cublasDgemmGroupedBatched" : "cublasGemmGroupedBatchedEx");
  ++grouped_products();
}

}  // namespace detail

//! count products of sizes of their own, alike in transposes, alpha and beta, as one grouped product (one launch
//! for a mixture of experts' products, and no plan per size: their row counts change every step). The products may
//! run at the same time: their outputs must not overlap.
template <Floating T>
void matmul_group(const Product<T>* ps, std::size_t count, bool trans_a, bool trans_b, float alpha, float beta,
                  cudaStream_t stream) {
  using D = device_t<T>;
  std::vector<Product<D>> on(count);
  for (std::size_t i = 0; i < count; ++i)
    on[i] = {detail::dev(ps[i].a), detail::dev(ps[i].b), detail::dev(ps[i].c), ps[i].m, ps[i].n, ps[i].k};
  detail::matmul_group(on.data(), count, trans_a, trans_b, alpha, beta, stream);
}

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
//! One product C = alpha op(A) op(B) + beta C whose stored rows lie lda, ldb and ldc elements apart (at least
//! their widths); strides of 16-byte multiples take the tensor cores' fast kernels (row_pitch), others go through
//! padded copies where that pays.
template <Floating T>
void matmul_ld(const T* A, std::ptrdiff_t lda, const T* B, std::ptrdiff_t ldb, T* C, std::ptrdiff_t ldc, int M, int N,
               int K, bool trans_a, bool trans_b, float alpha, float beta, cudaStream_t stream) {
  detail::matmul_ld(detail::dev(A), lda, detail::dev(B), ldb, detail::dev(C), ldc, M, N, K, trans_a, trans_b, alpha,
                    beta, stream);
}
// Products that do more as they store C, in cuBLASLt's epilogue where it has one for the type and the shape
// (detail::fused_epilogues counts them), else in a second pass.

//! C = op(A) op(B) + bias, the bias (N values) added to every row: one product.
template <Floating T>
void matmul_bias(const T* A, const T* B, const T* bias, T* C, int M, int N, int K, bool trans_a, bool trans_b,
                 cudaStream_t stream) {
  detail::matmul_bias(detail::dev(A), detail::dev(B), detail::dev(bias), detail::dev(C), M, N, K, trans_a, trans_b,
                      stream);
}
//! C = op(A) op(B) + bias (may be null) + R, R an M x N residual other than C: a residual branch's last product
//! and the residual sum in one (the residual read as the product's C).
template <Floating T>
void matmul_residual(const T* A, const T* B, const T* bias, const T* R, T* C, int M, int N, int K, bool trans_a,
                     bool trans_b, cudaStream_t stream) {
  detail::matmul_residual(detail::dev(A), detail::dev(B), detail::dev(bias), detail::dev(R), detail::dev(C), M, N, K,
                          trans_a, trans_b, stream);
}
//! pre = op(A) op(B) + bias (bias may be null), C = GELU(pre), tanh form: an MLP's first layer, keeping the GELU's
//! input for backward. The epilogue computes GELU from pre before pre is rounded to T (bf16 and fp16 only).
template <Floating T>
void matmul_bias_gelu(const T* A, const T* B, const T* bias, T* pre, T* C, int M, int N, int K, bool trans_a,
                      bool trans_b, cudaStream_t stream) {
  detail::matmul_bias_gelu(detail::dev(A), detail::dev(B), detail::dev(bias), detail::dev(pre), detail::dev(C), M, N,
                           K, trans_a, trans_b, stream);
}
//! C = alpha op(A) B + beta C and dbias += the column sums of B (K x N as stored): a layer's weight and bias
//! gradients from its output's gradient B, the bias's summed by the product (cuBLASLt's BGRADA epilogue).
template <Floating T>
void matmul_bgrad(const T* A, const T* B, T* C, T* dbias, int M, int N, int K, bool trans_a, float alpha, float beta,
                  cudaStream_t stream) {
  detail::matmul_bgrad(detail::dev(A), detail::dev(B), detail::dev(C), detail::dev(dbias), M, N, K, trans_a, alpha,
                       beta, stream);
}
//! C = (op(A) op(B)) GELU'(pre), element by element: the gradient of an MLP's hidden layer from its output's.
template <Floating T>
void matmul_dgelu(const T* A, const T* B, const T* pre, T* C, int M, int N, int K, bool trans_a, bool trans_b,
                  cudaStream_t stream) {
  detail::matmul_dgelu(detail::dev(A), detail::dev(B), detail::dev(pre), detail::dev(C), M, N, K, trans_a, trans_b,
                       stream);
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

// Ops<Cuda>: the device dispatch of <loom/kernels/ops.hpp> for CUDA: every operation runs on the stream the value
// holds, through the entry points of <loom/kernels/cuda/entry.hpp>; copies and fills are stream-ordered; the sums
// (losses, squared gradients) reduce on the device to per-block double partials, which the host adds in a fixed
// order, so the result is deterministic. Any C++ compiler builds it: a program that links loom::cuda_kernels
// (which defines LOOM_EXTERN_CUDA_KERNELS) gets the kernels from there, compiled once; a source that nvcc compiles
// without it gets their definitions here (header-only), as <loom/kernels/cuda/device_ops.cuh> does.
#pragma once

#include <loom/kernels/cuda/check.cuh>
#include <loom/kernels/cuda/entry.hpp>
#include <loom/kernels/cuda/profile.hpp>
#include <loom/core/worker.hpp>
#include <loom/kernels/ops.hpp>
#include <loom/tensor/cuda.hpp>

#include <utility>

namespace loom::kernels {

//! The CUDA kernels on one stream (default: the legacy default stream, which Tensor<T, Cuda>'s memory is allocated
//! for, so that freeing a tensor is ordered after the kernels that used it without an event). A model or optimizer
//! on another stream must order its tensors' lifetimes itself. Ranks that share a GPU (threads) rely on that one
//! stream: a synchronize() or mark() of any of them orders against every rank's queued kernels, which is what makes
//! a buffer allocated before the wait safe for a collective that writes it from another stream (ZeRO's reductions,
//! the pipeline's receives); per-thread default streams (nvcc --default-stream per-thread) would break it.
template <>
struct Ops<Cuda> {
  using device = Cuda;
  template <class T>
  using acc_t = loom::acc_t<T>;
  cudaStream_t stream = nullptr;

  //! Temporary memory of n elements, for this stream.
  template <class U>
  using Scratch = CudaBuffer<U>;
  template <class U>
  Scratch<U> scratch(std::size_t n) const {
    return Scratch<U>(n, stream);
  }

  //! The profile's span of a product, named by its shape and what its epilogue adds (`what`).
  cuda::ProfileScope product_span(int M, int N, int K, bool trans_a, bool trans_b, const char* what) const {
    const auto name = [&] {
      return loom::detail::cat("matmul ", M, "x", N, "x", K, trans_a ? " At" : "", trans_b ? " Bt" : "", what);
    };
    return cuda::ProfileScope(stream, name, 2.0 * M * N * K);
  }

  template <class T>
  void matmul(const T* A, const T* B, T* C, int M, int N, int K, bool trans_a, bool trans_b, float alpha = 1.0f,
              float beta = 0.0f) const {
    const auto span = product_span(M, N, K, trans_a, trans_b, "");
    cuda::entry::matmul(A, B, C, M, N, K, trans_a, trans_b, alpha, beta, stream);
  }
  //! C = op(A) op(B) + bias (N values, added to every row), one product: the bias in cuBLASLt's epilogue.
  template <class T>
  void matmul_bias(const T* A, const T* B, const T* bias, T* C, int M, int N, int K, bool trans_a,
                   bool trans_b) const {
    const auto span = product_span(M, N, K, trans_a, trans_b, " +bias");
    cuda::entry::matmul_bias(A, B, bias, C, M, N, K, trans_a, trans_b, stream);
  }
  //! C = op(A) op(B) + bias (may be null) + R (M x N, not C): one product, R read as its C and the bias in its
  //! epilogue.
  template <class T>
  void matmul_residual(const T* A, const T* B, const T* bias, const T* R, T* C, int M, int N, int K, bool trans_a,
                       bool trans_b) const {
    const auto span = product_span(M, N, K, trans_a, trans_b, bias ? " +bias +res" : " +res");
    cuda::entry::matmul_residual(A, B, bias, R, C, M, N, K, trans_a, trans_b, stream);
  }
  //! pre = op(A) op(B) + bias (bias may be null), C = GELU(pre): one product, the GELU in cuBLASLt's epilogue.
  template <class T>
  void matmul_bias_gelu(const T* A, const T* B, const T* bias, T* pre, T* C, int M, int N, int K, bool trans_a,
                        bool trans_b) const {
    const auto span = product_span(M, N, K, trans_a, trans_b, " +gelu");
    cuda::entry::matmul_bias_gelu(A, B, bias, pre, C, M, N, K, trans_a, trans_b, stream);
  }
  //! C = (op(A) op(B)) GELU'(pre): one product, the derivative in cuBLASLt's epilogue.
  template <class T>
  void matmul_dgelu(const T* A, const T* B, const T* pre, T* C, int M, int N, int K, bool trans_a,
                    bool trans_b) const {
    const auto span = product_span(M, N, K, trans_a, trans_b, " *dgelu");
    cuda::entry::matmul_dgelu(A, B, pre, C, M, N, K, trans_a, trans_b, stream);
  }
  //! One product whose stored rows lie lda, ldb and ldc elements apart.
  template <class T>
  void matmul_ld(const T* A, std::ptrdiff_t lda, const T* B, std::ptrdiff_t ldb, T* C, std::ptrdiff_t ldc, int M,
                 int N, int K, bool trans_a, bool trans_b, float alpha = 1.0f, float beta = 0.0f) const {
    const auto span = product_span(M, N, K, trans_a, trans_b, "");
    cuda::entry::matmul_ld(A, lda, B, ldb, C, ldc, M, N, K, trans_a, trans_b, alpha, beta, stream);
  }
  //! C = alpha op(A) B + beta C and dbias += the column sums of B: the bias's gradient in the product's epilogue.
  template <class T>
  void matmul_bgrad(const T* A, const T* B, T* C, T* dbias, int M, int N, int K, bool trans_a, float alpha = 1.0f,
                    float beta = 0.0f) const {
    const auto span = product_span(M, N, K, trans_a, false, " +bgrad");
    cuda::entry::matmul_bgrad(A, B, C, dbias, M, N, K, trans_a, alpha, beta, stream);
  }
  //! count products of sizes of their own, alike in transposes, alpha and beta: one grouped product of cuBLAS.
  template <class T>
  void matmul_group(const Product<T>* ps, std::size_t count, bool trans_a, bool trans_b, float alpha = 1.0f,
                    float beta = 0.0f) const {
    double flops = 0;
    for (std::size_t i = 0; i < count; ++i) flops += 2.0 * ps[i].m * ps[i].n * ps[i].k;
    const cuda::ProfileScope span(
        stream, [&] { return loom::detail::cat("matmul group", trans_a ? " At" : "", trans_b ? " Bt" : ""); }, flops);
    cuda::entry::matmul_group(ps, count, trans_a, trans_b, alpha, beta, stream);
  }
  //! The row stride, in elements, of a wide matrix of `cols` columns of T that products and the loss read (the
  //! logits): whole 128-byte lines, which the tensor cores' fast products and 16-byte loads need (GPT-2's 50257
  //! columns of bf16 become 50304).
  template <class T>
  static constexpr std::ptrdiff_t row_pitch(std::ptrdiff_t cols) {
    constexpr std::ptrdiff_t line = 128 / static_cast<std::ptrdiff_t>(sizeof(T));
    return (cols + line - 1) / line * line;
  }
  template <class T>
  void bias_add(const T* x, const T* bias, T* out, int R, int C) const {
    const cuda::ProfileScope span("bias_add", stream);
    cuda::entry::bias_add(x, bias, out, R, C, stream);
  }
  template <class T>
  void bias_backward(const T* dout, T* dbias, int R, int C) const {
    const cuda::ProfileScope span("bias_backward", stream);
    cuda::entry::bias_backward(dout, dbias, R, C, stream);
  }
  template <class T>
  void add(const T* a, const T* b, T* out, std::size_t n) const {
    const cuda::ProfileScope span("add", stream);
    cuda::entry::add(a, b, out, n, stream);
  }
  template <class T>
  void accumulate(const T* x, T* y, std::size_t n) const {
    const cuda::ProfileScope span("accumulate", stream);
    cuda::entry::accumulate(x, y, n, stream);
  }
  template <class T>
  void gelu_forward(const T* x, T* out, std::size_t n) const {
    const cuda::ProfileScope span("gelu_forward", stream);
    cuda::entry::gelu_forward(x, out, n, stream);
  }
  template <class T>
  void gelu_backward(const T* x, const T* dout, T* dx, std::size_t n) const {
    const cuda::ProfileScope span("gelu_backward", stream);
    cuda::entry::gelu_backward(x, dout, dx, n, stream);
  }

  template <class T>
  void swiglu_forward(const T* h, T* out, int R, int F) const {
    const cuda::ProfileScope span("swiglu_forward", stream);
    cuda::entry::swiglu_forward(h, out, R, F, stream);
  }
  template <class T>
  void swiglu_backward(const T* h, const T* dout, T* dh, int R, int F) const {
    const cuda::ProfileScope span("swiglu_backward", stream);
    cuda::entry::swiglu_backward(h, dout, dh, R, F, stream);
  }
  template <class T>
  void rmsnorm_forward(const T* x, const T* w, T* out, acc_t<T>* rstd, int R, int C, double eps) const {
    const cuda::ProfileScope span("rmsnorm_forward", stream);
    cuda::entry::rmsnorm_forward(x, w, out, rstd, R, C, eps, stream);
  }
  template <class T>
  void rmsnorm_backward_input(const T* dout, const T* x, const T* w, const acc_t<T>* rstd, T* dx, int R, int C,
                              const T* dres = nullptr) const {
    const cuda::ProfileScope span("rmsnorm_backward_input", stream);
    cuda::entry::rmsnorm_backward_input(dout, x, w, rstd, dx, R, C, dres, stream);
  }
  template <class T>
  void rmsnorm_backward_weight(const T* dout, const T* x, const acc_t<T>* rstd, T* dw, int R, int C) const {
    const cuda::ProfileScope span("rmsnorm_backward_weight", stream);
    cuda::entry::rmsnorm_backward_weight(dout, x, rstd, dw, R, C, stream);
  }
  template <class T>
  void rope_rotate(T* x, const acc_t<T>* cos, const acc_t<T>* sin, int n, int ld, int heads, int hd, int t0,
                   bool inverse) const {
    const cuda::ProfileScope span("rope_rotate", stream);
    cuda::entry::rope_rotate(x, cos, sin, n, ld, heads, hd, t0, inverse, stream);
  }

  //! eps in double, as the CPU kernel takes it: the device normalises with the same constant.
  template <class T>
  void layernorm_forward(const T* x, const T* w, const T* b, T* out, acc_t<T>* mean, acc_t<T>* rstd, int R, int C,
                         double eps) const {
    const cuda::ProfileScope span("layernorm_forward", stream);
    cuda::entry::layernorm_forward(x, w, b, out, mean, rstd, R, C, eps, stream);
  }
  template <class T>
  void layernorm_backward_input(const T* dout, const T* x, const T* w, const acc_t<T>* mean, const acc_t<T>* rstd,
                                T* dx, int R, int C, const T* dres = nullptr) const {
    const cuda::ProfileScope span("layernorm_backward_input", stream);
    cuda::entry::layernorm_backward_input(dout, x, w, mean, rstd, dx, R, C, dres, stream);
  }
  template <class T>
  void layernorm_backward_weight(const T* dout, const T* x, const acc_t<T>* mean, const acc_t<T>* rstd, T* dw, T* db,
                                 int R, int C) const {
    const cuda::ProfileScope span("layernorm_backward_weight", stream);
    cuda::entry::layernorm_backward_weight(dout, x, mean, rstd, dw, db, R, C, stream);
  }

  template <class T>
  void ce_partials(const T* logits, acc_t<T>* row_max, acc_t<T>* row_sumexp, int R, int V_local,
                   std::ptrdiff_t ld = 0) const {
    const cuda::ProfileScope span("ce_partials", stream);
    cuda::entry::ce_partials(logits, row_max, row_sumexp, R, V_local, ld, stream);
  }
  template <class T>
  void ce_rescale(const acc_t<T>* local_max, const acc_t<T>* global_max, acc_t<T>* sumexp, int R) const {
    const cuda::ProfileScope span("ce_rescale", stream);
    cuda::entry::ce_rescale<T>(local_max, global_max, sumexp, R, stream);
  }
  template <class T>
  void ce_target_logit(const T* logits, const std::int32_t* targets, acc_t<T>* target_logit, int R, int V_local,
                       int v0, std::ptrdiff_t ld = 0) const {
    const cuda::ProfileScope span("ce_target_logit", stream);
    cuda::entry::ce_target_logit(logits, targets, target_logit, R, V_local, v0, ld, stream);
  }
  template <class T>
  void ce_losses(const acc_t<T>* row_max, const acc_t<T>* row_sumexp, const acc_t<T>* target_logit, T* losses,
                 int R) const {
    const cuda::ProfileScope span("ce_losses", stream);
    cuda::entry::ce_losses<T>(row_max, row_sumexp, target_logit, losses, R, stream);
  }
  template <class T>
  void ce_backward(const T* logits, const std::int32_t* targets, const acc_t<T>* row_max, const acc_t<T>* row_sumexp,
                   const T* dloss, T* dlogits, int R, int V_local, int v0, std::ptrdiff_t ld = 0) const {
    const cuda::ProfileScope span("ce_backward", stream);
    cuda::entry::ce_backward(logits, targets, row_max, row_sumexp, dloss, dlogits, R, V_local, v0, ld, stream);
  }
  //! The whole vocabulary's losses and, over the logits, their gradients (unscaled), in one kernel.
  template <class T>
  void ce_loss_grad(T* logits, const std::int32_t* targets, acc_t<T>* row_max, acc_t<T>* row_sumexp, T* losses, int R,
                    int V, std::ptrdiff_t ld = 0) const {
    const cuda::ProfileScope span("ce_loss_grad", stream);
    cuda::entry::ce_loss_grad(logits, targets, row_max, row_sumexp, losses, R, V, ld, stream);
  }

  template <class T>
  void embedding_forward(const std::int32_t* ids, const T* table, T* out, int n, int C, int v0, int V_local) const {
    const cuda::ProfileScope span("embedding_forward", stream);
    cuda::entry::embedding_forward(ids, table, out, n, C, v0, V_local, stream);
  }
  template <class T>
  void embedding_backward(const std::int32_t* ids, const T* dout, T* dtable, int n, int C, int v0,
                          int V_local) const {
    const cuda::ProfileScope span("embedding_backward", stream);
    cuda::entry::embedding_backward(ids, dout, dtable, n, C, v0, V_local, stream);
  }
  template <class T>
  void add_positions(const T* wpe, T* out, int B, int T_, int C, int t0) const {
    const cuda::ProfileScope span("add_positions", stream);
    cuda::entry::add_positions(wpe, out, B, T_, C, t0, stream);
  }
  template <class T>
  void positions_backward(const T* dout, T* dwpe, int B, int T_, int C, int t0) const {
    const cuda::ProfileScope span("positions_backward", stream);
    cuda::entry::positions_backward(dout, dwpe, B, T_, C, t0, stream);
  }

  template <class T>
  void dropout_forward(const T* x, T* out, std::size_t n, float p, std::uint64_t seed, std::uint64_t index0) const {
    const cuda::ProfileScope span("dropout_forward", stream);
    cuda::entry::dropout_forward(x, out, n, p, seed, index0, stream);
  }
  template <class T>
  void dropout_backward(const T* dout, T* dx, std::size_t n, float p, std::uint64_t seed,
                        std::uint64_t index0) const {
    const cuda::ProfileScope span("dropout_backward", stream);
    cuda::entry::dropout_backward(dout, dx, n, p, seed, index0, stream);
  }

  template <class T>
  void attention_forward(const T* q, const T* k, const T* v, T* out, acc_t<T>* lse,
                         const AttentionShape& s) const {
    const cuda::ProfileScope span("attention_forward", stream, cuda::attention_flops(s));
    cuda::entry::attention_forward(q, k, v, out, lse, s, stream);
  }
  template <class T>
  void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const acc_t<T>* lse, T* dq,
                          T* dk, T* dv, const AttentionShape& s) const {
    const cuda::ProfileScope span("attention_backward", stream, 2.5 * cuda::attention_flops(s));
    cuda::entry::attention_backward(dout, q, k, v, out, lse, dq, dk, dv, s, stream);
  }

  template <class T>
  void adamw_step(T* param, const T* grad, acc_t<T>* m, acc_t<T>* v, std::size_t n, double lr, double beta1,
                  double beta2, double eps, double weight_decay, int t, acc_t<T>* master = nullptr) const {
    const cuda::ProfileScope span("adamw_step", stream);
    cuda::entry::adamw_step(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, t, master, stream);
  }
  //! adamw_step over count runs of the flat buffers, in one launch.
  template <class T>
  void adamw_runs(T* param, const T* grad, acc_t<T>* m, acc_t<T>* v, acc_t<T>* master, const UpdateRun* runs,
                  std::size_t count, double lr, double beta1, double beta2, double eps, double weight_decay,
                  int t) const {
    const cuda::ProfileScope span("adamw_runs", stream);
    cuda::entry::adamw_runs(param, grad, m, v, master, runs, count, lr, beta1, beta2, eps, weight_decay, t, stream);
  }
  template <class T>
  void sgd_step(T* param, const T* grad, acc_t<T>* buf, std::size_t n, double lr, double momentum,
                double weight_decay, bool first, acc_t<T>* master = nullptr) const {
    const cuda::ProfileScope span("sgd_step", stream);
    cuda::entry::sgd_step(param, grad, buf, n, lr, momentum, weight_decay, first, master, stream);
  }

  template <class T>
  void copy(const T* src, T* dst, std::size_t n) const {
    if (src == dst || n == 0) return;
    const cuda::ProfileScope span("copy", stream);
    LOOM_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  }
  template <class T>
  void fill(T* x, std::size_t n, T value) const {
    const cuda::ProfileScope span("fill", stream);
    cuda::entry::fill(x, n, &value, stream);
  }
  template <class T>
  void scale(T* x, std::size_t n, acc_t<T> s) const {
    const cuda::ProfileScope span("scale", stream);
    cuda::entry::scale(x, n, s, stream);
  }
  template <class T>
  void widen(const T* src, acc_t<T>* dst, std::size_t n) const {
    const cuda::ProfileScope span("widen", stream);
    cuda::entry::widen(src, dst, n, stream);
  }
  template <class T>
  void narrow(const acc_t<T>* src, T* dst, std::size_t n) const {
    const cuda::ProfileScope span("narrow", stream);
    cuda::entry::narrow(src, dst, n, stream);
  }
  template <class T>
  void accumulate_wide(const T* x, acc_t<T>* y, std::size_t n) const {
    const cuda::ProfileScope span("accumulate_wide", stream);
    cuda::entry::accumulate_wide(x, y, n, stream);
  }
  //! A block of rows: the same type through a 2-D copy, or acc_t<D> rounded to D by a kernel.
  template <class S, class D>
  void copy_rows(const S* src, std::ptrdiff_t lds, D* dst, std::ptrdiff_t ldd, int rows, int w) const {
    if (rows <= 0 || w <= 0) return;
    if constexpr (std::is_same_v<S, D>) {
      const cuda::ProfileScope span("copy_rows", stream);
      LOOM_CUDA(cudaMemcpy2DAsync(dst, std::size_t(ldd) * sizeof(D), src, std::size_t(lds) * sizeof(S),
                                  std::size_t(w) * sizeof(D), std::size_t(rows), cudaMemcpyDeviceToDevice, stream));
    } else {
      static_assert(std::is_same_v<S, acc_t<D>>, "loom: copy_rows converts only acc_t<D> to D");
      const cuda::ProfileScope span("narrow_rows", stream);
      cuda::entry::narrow_rows(src, lds, dst, ldd, rows, w, stream);
    }
  }
  template <class U>
  void transpose(const U* src, U* dst, int batches, int rows, int cols) const {
    static_assert(std::is_same_v<U, float> || std::is_same_v<U, double>,
                  "loom: Ops<Cuda>::transpose takes the accumulation types, float and double");
    const cuda::ProfileScope span("transpose", stream);
    cuda::entry::transpose<U>(src, dst, batches, rows, cols, stream);
  }
  template <class T>
  void lse_merge(acc_t<T>* O, acc_t<T>* L, const T* Ob, const acc_t<T>* Lb, int B, int H, int c, int D,
                 std::ptrdiff_t ld) const {
    const cuda::ProfileScope span("lse_merge", stream);
    cuda::entry::lse_merge(O, L, Ob, Lb, B, H, c, D, ld, stream);
  }
  template <class T>
  void gather_rows(const T* src, const std::int32_t* rows, const T* weights, T* dst, std::size_t n, int d) const {
    const cuda::ProfileScope span("gather_rows", stream);
    cuda::entry::gather_rows(src, rows, weights, dst, n, d, stream);
  }
  template <class T>
  void scatter_rows(const T* src, const std::int32_t* rows, T* dst, std::size_t n, int d) const {
    const cuda::ProfileScope span("scatter_rows", stream);
    cuda::entry::scatter_rows(src, rows, dst, n, d, stream);
  }
  template <class T>
  void combine_rows(const T* src, const std::int32_t* slots, int k, const T* weights, T* dst, std::size_t tokens,
                    int d) const {
    const cuda::ProfileScope span("combine_rows", stream);
    cuda::entry::combine_rows(src, slots, k, weights, dst, tokens, d, stream);
  }
  template <class T>
  void row_dots(const T* a, const std::int32_t* rows, const T* b, double* out, std::size_t n, int d) const {
    const cuda::ProfileScope span("row_dots", stream);
    cuda::entry::row_dots(a, rows, b, out, n, d, stream);
  }
  //! Device to host: returns when host_dst holds the data.
  template <class T>
  void to_host(const T* src, T* host_dst, std::size_t n) const {
    if (n == 0) return;
    const cuda::ProfileScope span("to_host", stream);
    LOOM_CUDA(cudaMemcpyAsync(host_dst, src, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
    LOOM_CUDA(cudaStreamSynchronize(stream));
  }
  //! Host to device, ordered on the stream; host_src may be reused on return (the copy is staged or done).
  template <class T>
  void from_host(const T* host_src, T* dst, std::size_t n) const {
    if (n == 0) return;
    const cuda::ProfileScope span("from_host", stream);
    LOOM_CUDA(cudaMemcpyAsync(dst, host_src, n * sizeof(T), cudaMemcpyHostToDevice, stream));
    // Pageable memory is staged before the call returns, but a pinned source would be read later: wait, so that
    // the caller may free or change it either way.
    LOOM_CUDA(cudaStreamSynchronize(stream));
  }
  template <class T>
  double sum_squares(const T* x, std::size_t n) const {
    const cuda::ProfileScope span("sum_squares", stream);
    return cuda::entry::sum_squares(x, n, stream);
  }
  template <class T>
  double sum(const T* x, std::size_t n) const {
    const cuda::ProfileScope span("sum", stream);
    return cuda::entry::sum(x, n, stream);
  }
  template <class T>
  void sums_of_squares(const T* x, const std::int64_t* at, const std::int64_t* n, std::size_t count,
                       double* out) const {
    const cuda::ProfileScope span("sums_of_squares", stream);
    cuda::entry::sums_of_squares(x, at, n, count, out, stream);
  }
  void synchronize() const { LOOM_CUDA(cudaStreamSynchronize(stream)); }
  //! An event recorded after the work issued so far on the stream: wait() blocks the calling thread (not the
  //! stream) until the device has done that work. Move-only; the event is destroyed with it.
  class Mark {
   public:
    explicit Mark(cudaStream_t s) {
      LOOM_CUDA(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
      LOOM_CUDA(cudaEventRecord(event_, s));
    }
    Mark(Mark&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
    Mark& operator=(Mark&&) = delete;
    ~Mark() {
      if (event_) cudaEventDestroy(event_);
    }
    void wait() const { LOOM_CUDA(cudaEventSynchronize(event_)); }

   private:
    cudaEvent_t event_ = nullptr;
  };
  Mark mark() const { return Mark(stream); }
};

static_assert(DeviceOps<Ops<Cuda>>, "loom: Ops<Cuda> must provide every operation of DeviceOps, as Ops<Host> does");

//! A stream of its own, made on the calling thread's device at first use. It does not wait for the legacy default
//! stream (cudaStreamNonBlocking): its caller orders it, having waited for the event after the kernels that wrote
//! what it reads, and writing only memory made before those kernels were queued (a block freed with kernels still
//! queued that use it is then no longer in use).
template <>
class SideStream<Cuda> {
 public:
  SideStream() = default;
  SideStream(SideStream&& o) noexcept : ops_{std::exchange(o.ops_.stream, nullptr)} {}
  SideStream& operator=(SideStream&&) = delete;
  ~SideStream() {
    if (ops_.stream) cudaStreamDestroy(ops_.stream);  // its work completes first
  }
  const Ops<Cuda>& ops(const Ops<Cuda>&) {
    if (!ops_.stream) LOOM_CUDA(cudaStreamCreateWithFlags(&ops_.stream, cudaStreamNonBlocking));
    return ops_;
  }

 private:
  Ops<Cuda> ops_;
};

namespace cuda::detail {
//! How a worker makes the device its starter was given its own (loom::ThreadDevice): installed when the program
//! starts.
inline const ThreadDevice thread_device{[](int d) { LOOM_CUDA(cudaSetDevice(d)); }};
inline const bool thread_device_installed = [] {
  ::loom::thread_device().store(&thread_device);
  return true;
}();
}  // namespace cuda::detail

}  // namespace loom::kernels

#if defined(__CUDACC__) && !defined(LOOM_EXTERN_CUDA_KERNELS)
#include <loom/kernels/cuda/entry.cuh>
#endif

// AdamW and SGD with momentum on the device, element for element as torch.optim (and the CPU kernels) compute
// them: the bias corrections and step size in double on the host, the element-wise arithmetic in acc_t<T> and in
// torch's order.
#pragma once

#include <loom/kernels/cuda/elementwise.cuh>

#include <cmath>
#include <vector>

namespace loom::kernels::cuda {

namespace detail {

template <class T>
struct AdamW {
  using A = acc_t<T>;
  static constexpr int width = vec_width<T>;
  T* param;
  const T* grad;
  A* m;
  A* v;
  A decay, b1, one_minus_b1, b2, one_minus_b2, bc2_sqrt, step, eps;
  A* master;  // null, or fp32 master weights (read from param when init)
  bool init;
  template <int N>
  __device__ void apply(std::size_t i) const {
    const bool from_master = master != nullptr && !init;  // the parameters then are only written
    Pack<T, N> p;
    if (!from_master) p = load_pack<N>(param + i);
    const auto g = load_pack<N>(grad + i);
    auto mm = load_pack<N>(m + i);
    auto vv = load_pack<N>(v + i);
    Pack<A, N> w;
    if (from_master) w = load_pack<N>(master + i);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const A G = widen(g.v[j]);
      A P = (from_master ? w.v[j] : widen(p.v[j])) * decay;
      const A M = mm.v[j] * b1 + G * one_minus_b1;
      const A V = vv.v[j] * b2 + one_minus_b2 * G * G;
      P += step * M / (sqrt_(V) / bc2_sqrt + eps);
      mm.v[j] = M;
      vv.v[j] = V;
      w.v[j] = P;
      p.v[j] = narrow<T>(P);
    }
    store_pack(param + i, p);
    if (master != nullptr) store_pack(master + i, w);
    store_pack(m + i, mm);
    store_pack(v + i, vv);
  }
};

template <class T>
struct Sgd {
  using A = acc_t<T>;
  static constexpr int width = vec_width<T>;
  T* param;
  const T* grad;
  A* buf;  // null when momentum is 0 and the caller keeps none
  A wd, mom, step;
  bool use_wd, use_momentum, first;
  A* master;  // null, or fp32 master weights (read from param on the first step)
  template <int N>
  __device__ void apply(std::size_t i) const {
    const bool from_master = master != nullptr && !first;  // the parameters then are only written
    Pack<T, N> p;
    if (!from_master) p = load_pack<N>(param + i);
    const auto g = load_pack<N>(grad + i);
    Pack<A, N> b, w;
    if (buf != nullptr) b = load_pack<N>(buf + i);
    if (from_master) w = load_pack<N>(master + i);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const A P = from_master ? w.v[j] : widen(p.v[j]);
      A G = use_wd ? widen(g.v[j]) + wd * P : widen(g.v[j]);
      if (use_momentum && !first) G = b.v[j] * mom + G;
      b.v[j] = G;
      w.v[j] = P + step * G;
      p.v[j] = narrow<T>(w.v[j]);
    }
    store_pack(param + i, p);
    if (buf != nullptr) store_pack(buf + i, b);
    if (master != nullptr) store_pack(master + i, w);
  }
};

//! The update of step t (1-based) on these buffers: decay is 1 - lr wd (each run of adamw_runs sets its own), the
//! bias corrections and the step size in double on the host.
template <class T>
AdamW<T> adamw_op(T* param, const T* grad, acc_t<T>* m, acc_t<T>* v, double decay, double lr, double beta1,
                  double beta2, double eps, int t, acc_t<T>* master) {
  using A = acc_t<T>;
  return {param,
          grad,
          m,
          v,
          A(decay),
          A(beta1),
          A(1.0 - beta1),
          A(beta2),
          A(1.0 - beta2),
          A(std::sqrt(1.0 - std::pow(beta2, t))),
          A(-lr / (1.0 - std::pow(beta1, t))),
          A(eps),
          master,
          t == 1};
}

//! A run of adamw_runs as its kernel reads it: UpdateRun with its decay factor (1 - lr wd, or 1) and the first of
//! the chunks its elements make.
struct DeviceRun {
  std::int64_t param, at, n, first_chunk;
  double decay;
};
//! The elements one block of adamw_runs updates (the last chunk of a run, fewer).
inline constexpr std::int64_t run_chunk = 8192;
inline constexpr int run_threads = 256;

//! Block b updates chunk b: it finds its run (the last whose first chunk is at or before b), and updates the chunk's
//! elements in packs where every operand's address allows them, one by one otherwise (a run may start anywhere).
template <class T>
__global__ void __launch_bounds__(run_threads) adamw_runs_kernel(AdamW<T> op, const DeviceRun* runs, int count) {
  using A = acc_t<T>;
  const std::int64_t chunk = blockIdx.x;
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (runs[mid].first_chunk <= chunk) lo = mid;
    else hi = mid - 1;
  }
  const DeviceRun r = runs[lo];
  const std::int64_t begin = (chunk - r.first_chunk) * run_chunk;
  const std::int64_t len = r.n - begin < run_chunk ? r.n - begin : run_chunk;
  op.param += r.param + begin;
  op.grad += r.param + begin;
  op.m += r.at + begin;
  op.v += r.at + begin;
  if (op.master != nullptr) op.master += r.at + begin;
  op.decay = A(r.decay);
  constexpr int N = vec_width<T>;
  constexpr std::size_t state_pack = N * sizeof(A);
  const bool vec = aligned(op.param, 16) && aligned(op.grad, 16) && aligned(op.m, state_pack) &&
                   aligned(op.v, state_pack) && aligned(op.master, state_pack);
  std::int64_t i = threadIdx.x;
  if (vec) {
    const std::int64_t packs = len / N;
    for (std::int64_t p = threadIdx.x; p < packs; p += run_threads) op.template apply<N>(std::size_t(p) * N);
    i = packs * N + threadIdx.x;
  }
  for (; i < len; i += run_threads) op.template apply<1>(std::size_t(i));
}

}  // namespace detail

//! torch.optim.AdamW's update for step t (1-based): p -= lr*wd*p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//! p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps). m and v in acc_t<T>; with `master` (or null), the
//! update acts on these fp32 master weights, taken from param at t = 1, and param is them rounded.
template <Floating T>
void adamw_step(T* param, const T* grad, acc_t<T>* m, acc_t<T>* v, std::size_t n, double lr, double beta1,
                double beta2, double eps, double weight_decay, int t, acc_t<T>* master, cudaStream_t stream) {
  using D = device_t<T>;
  using A = acc_t<T>;
  const auto op = detail::adamw_op(detail::dev(param), detail::dev(grad), m, v, 1.0 - lr * weight_decay, lr, beta1,
                                   beta2, eps, t, master);
  // m and v go in packs of as many elements as param's 16 bytes: 32 bytes of float for bf16/fp16.
  constexpr std::size_t acc_pack = detail::vec_width<D> * sizeof(A);
  const bool vec = detail::vec_ok({param, grad}) && detail::aligned(m, acc_pack) && detail::aligned(v, acc_pack) &&
                   detail::aligned(master, acc_pack);
  detail::launch_map(op, n, vec, stream, "adamw_step");
}

//! adamw_step over count runs of the flat buffers (param and grad at run.param, m, v and master at run.at;
//! weight_decay where run.decay; master null or fp32 master weights) in one launch: a block per chunk of a run, each
//! element updated as adamw_step updates it. The runs' table goes to the device on the stream.
template <Floating T>
void adamw_runs(T* param, const T* grad, acc_t<T>* m, acc_t<T>* v, acc_t<T>* master, const UpdateRun* runs,
                std::size_t count, double lr, double beta1, double beta2, double eps, double weight_decay, int t,
                cudaStream_t stream) {
  using D = device_t<T>;
  std::vector<detail::DeviceRun> table;
  std::int64_t chunks = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const UpdateRun& r = runs[i];
    LOOM_CHECK(r.n >= 0 && r.param >= 0 && r.at >= 0, "adamw_runs: run ", i, " has a negative place or size (param=",
               r.param, ", at=", r.at, ", n=", r.n, ")");
    if (r.n == 0) continue;
    table.push_back({r.param, r.at, r.n, chunks, r.decay ? 1.0 - lr * weight_decay : 1.0});
    chunks += (r.n + detail::run_chunk - 1) / detail::run_chunk;
  }
  if (chunks == 0) return;
  LOOM_CHECK(chunks <= 0x7fffffff, "adamw_runs: ", chunks, " chunks of ", detail::run_chunk,
             " elements are more blocks than a launch takes");
  // A copy from pageable memory has read it when the call returns: the table may go.
  CudaBuffer<detail::DeviceRun> on_device(table.size(), stream);
  LOOM_CUDA(cudaMemcpyAsync(on_device.data(), table.data(), table.size() * sizeof(detail::DeviceRun),
                            cudaMemcpyHostToDevice, stream));
  const auto op = detail::adamw_op(detail::dev(param), detail::dev(grad), m, v, 1.0, lr, beta1, beta2, eps, t, master);
  detail::adamw_runs_kernel<D><<<static_cast<unsigned>(chunks), detail::run_threads, 0, stream>>>(
      op, on_device.data(), static_cast<int>(table.size()));
  detail::check_launch("adamw_runs");
}

//! torch.optim.SGD with momentum (dampening 0, no Nesterov): g += wd*p; buf = first ? g : momentum*buf + g;
//! p -= lr*buf. With momentum 0 the buffer is unused by the update (it may be null). `master` as for adamw_step,
//! taken from param on the first step.
template <Floating T>
void sgd_step(T* param, const T* grad, acc_t<T>* buf, std::size_t n, double lr, double momentum, double weight_decay,
              bool first, acc_t<T>* master, cudaStream_t stream) {
  using D = device_t<T>;
  using A = acc_t<T>;
  const detail::Sgd<D> op{detail::dev(param), detail::dev(grad), buf,   A(weight_decay), A(momentum), A(-lr),
                          weight_decay != 0.0, momentum != 0.0,  first, master};
  constexpr std::size_t acc_pack = detail::vec_width<D> * sizeof(A);
  const bool vec = detail::vec_ok({param, grad}) && detail::aligned(buf, acc_pack) && detail::aligned(master, acc_pack);
  detail::launch_map(op, n, vec, stream, "sgd_step");
}

}  // namespace loom::kernels::cuda

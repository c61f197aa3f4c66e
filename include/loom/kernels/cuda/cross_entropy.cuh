// Cross-entropy over a slice [v0, v0 + V_local) of the vocabulary on the device: per-row max and sum-exp partials
// (one block per row, one pass, cub::BlockReduce), their rescaling to a global max, the target logit, the losses
// and the gradient of the logits. The caller combines partials across vocabulary shards as on the CPU.
#pragma once

#include <loom/kernels/cuda/layernorm.cuh>

#include <cub/block/block_reduce.cuh>

namespace loom::kernels::cuda {

namespace detail {

struct MaxOp {
  template <class A>
  __device__ A operator()(A a, A b) const {
    return a < b ? b : a;
  }
};

//! Calls f(v, x) for v = 0 .. V - 1 of row lr, x = lr[v] widened, this thread's share of a block of Block threads:
//! 16 bytes a load where the row starts on 16 bytes (a device pitch makes every row do), one by one otherwise.
template <int Block, class T, class F>
__device__ __forceinline__ void for_row(const T* lr, int V, F&& f) {
  constexpr int W = vec_width<T>;
  int done = 0;
  if (reinterpret_cast<std::uintptr_t>(lr) % 16 == 0) {
    const int packs = V / W;
    for (int i = threadIdx.x; i < packs; i += Block) {
      const auto x = load_pack<W>(lr + i * W);
#pragma unroll
      for (int j = 0; j < W; ++j) f(i * W + j, widen(x.v[j]));
    }
    done = packs * W;
  }
  for (int v = done + threadIdx.x; v < V; v += Block) f(v, widen(lr[v]));
}

//! Max and sum of exp(logit - max) over one row in one pass (each thread rescales its running sum when its max
//! grows; the block then brings the threads' sums to the row's max), shared by every thread of the block.
template <class T, int Block>
__device__ void row_max_sumexp(const T* lr, int V, acc_t<T>& m_out, acc_t<T>& s_out) {
  using A = acc_t<T>;
  using Reduce = cub::BlockReduce<A, Block>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ A s_m, s_s;
  A m = neg_inf<A>(), s = 0;
  for_row<Block>(lr, V, [&](int, A x) {
    if (x > m) {
      s = s * exp_(m - x) + A(1);  // 0 * exp(-inf) = 0 on the first
      m = x;
    } else if (x != neg_inf<A>()) {
      s += exp_(x - m);
    }
  });
  const A row_m = Reduce(tmp).Reduce(m, MaxOp{});
  if (threadIdx.x == 0) s_m = row_m;
  __syncthreads();
  const A mm = s_m;
  // A share that saw nothing adds 0; one that saw only NaN (m still -inf, s NaN) keeps the NaN, as on the host.
  const A mine = s == A(0) ? A(0) : s * exp_(m - mm);
  const A sum = Reduce(tmp).Sum(mine);
  if (threadIdx.x == 0) s_s = sum;
  __syncthreads();
  m_out = mm;
  s_out = s_s;
}

template <class T, int Block>
__global__ void __launch_bounds__(Block)
    ce_partials_kernel(const T* logits, acc_t<T>* row_max, acc_t<T>* row_sumexp, int V, std::ptrdiff_t ld) {
  const std::size_t row = blockIdx.x;
  acc_t<T> m, s;
  row_max_sumexp<T, Block>(logits + row * ld, V, m, s);
  if (threadIdx.x == 0) {
    row_max[row] = m;
    row_sumexp[row] = s;
  }
}

template <class T, int Block>
__global__ void __launch_bounds__(Block)
    cross_entropy_forward_kernel(const T* logits, const std::int32_t* targets, T* losses, acc_t<T>* row_max,
                                 acc_t<T>* row_sumexp, int V) {
  using A = acc_t<T>;
  const std::size_t row = blockIdx.x;
  A m, s;
  row_max_sumexp<T, Block>(logits + row * V, V, m, s);
  if (threadIdx.x == 0) {
    const std::int32_t t = targets[row];
    const A target = (t >= 0 && t < V) ? widen(logits[row * V + t]) : A(0);
    row_max[row] = m;
    row_sumexp[row] = s;
    losses[row] = narrow<T>(log_(s) + m - target);
  }
}

template <class A>
__global__ void ce_rescale_kernel(const A* local_max, const A* global_max, A* sumexp, int R) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= R) return;
  // A slice without entries (sum 0, max -inf) contributes nothing, also when the global max is -inf; a NaN sum
  // stays NaN (cpu::ce_rescale's rule).
  sumexp[r] = sumexp[r] == A(0) ? A(0) : sumexp[r] * exp_(local_max[r] - global_max[r]);
}

template <class T>
__global__ void ce_target_logit_kernel(const T* logits, const std::int32_t* targets, acc_t<T>* target_logit, int R,
                                       int V, int v0, std::ptrdiff_t ld) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= R) return;
  const long long t = static_cast<long long>(targets[r]) - v0;
  target_logit[r] = (t >= 0 && t < V) ? widen(logits[std::size_t(r) * ld + t]) : acc_t<T>(0);
}

template <class T>
__global__ void ce_losses_kernel(const acc_t<T>* row_max, const acc_t<T>* row_sumexp, const acc_t<T>* target_logit,
                                 T* losses, int R) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= R) return;
  losses[r] = narrow<T>(log_(row_sumexp[r]) + row_max[r] - target_logit[r]);
}

//! dr[v] = f(v, lr[v] widened) for v = 0 .. V - 1, this thread's share of a block of Block threads: 16 bytes a load
//! and a store where both rows start on 16 bytes, one by one otherwise. dr may be lr: each element (or pack) is
//! read, then written, by one thread.
template <int Block, class T, class F>
__device__ __forceinline__ void map_row(const T* lr, T* dr, int V, F&& f) {
  constexpr int W = vec_width<T>;
  int done = 0;
  if (reinterpret_cast<std::uintptr_t>(lr) % 16 == 0 && reinterpret_cast<std::uintptr_t>(dr) % 16 == 0) {
    const int packs = V / W;
    for (int i = threadIdx.x; i < packs; i += Block) {
      auto x = load_pack<W>(lr + i * W);
#pragma unroll
      for (int j = 0; j < W; ++j) x.v[j] = f(i * W + j, widen(x.v[j]));
      store_pack(dr + i * W, x);
    }
    done = packs * W;
  }
  for (int v = done + threadIdx.x; v < V; v += Block) dr[v] = f(v, widen(lr[v]));
}

template <class T, int Block>
__global__ void __launch_bounds__(Block)
    ce_backward_kernel(const T* logits, const std::int32_t* targets, const acc_t<T>* row_max,
                       const acc_t<T>* row_sumexp, const T* dloss, T* dlogits, int V, int v0, std::ptrdiff_t ld) {
  using A = acc_t<T>;
  const std::size_t row = blockIdx.x;
  const A m = row_max[row], inv = A(1) / row_sumexp[row], g = widen(dloss[row]);
  const long long t = static_cast<long long>(targets[row]) - v0;
  map_row<Block>(logits + row * ld, dlogits + row * ld, V,
                 [&](int v, A x) { return narrow<T>(g * (exp_(x - m) * inv - (v == t ? A(1) : A(0)))); });
}

// The loss and its gradient in one pass over each row of the whole vocabulary: the row's max and sum of exp, the
// loss from the target's logit (read by thread 0 before any thread overwrites the row), then each logit replaced by
// its gradient, read again while the block's row is still in L2.
template <class T, int Block>
__global__ void __launch_bounds__(Block)
    ce_loss_grad_kernel(T* logits, const std::int32_t* targets, acc_t<T>* row_max, acc_t<T>* row_sumexp, T* losses,
                        int V, std::ptrdiff_t ld) {
  using A = acc_t<T>;
  const std::size_t row = blockIdx.x;
  T* lr = logits + row * ld;
  A m, s;
  row_max_sumexp<T, Block>(lr, V, m, s);
  const std::int32_t t = targets[row];
  if (threadIdx.x == 0) {
    const A target = (t >= 0 && t < V) ? widen(lr[t]) : A(0);
    row_max[row] = m;
    row_sumexp[row] = s;
    losses[row] = narrow<T>(log_(s) + m - target);
  }
  __syncthreads();  // the target's logit is read before the row is overwritten
  const A inv = A(1) / s;
  map_row<Block>(lr, lr, V, [&](int v, A x) { return narrow<T>(exp_(x - m) * inv - (v == t ? A(1) : A(0))); });
}

inline unsigned blocks_for(int n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

}  // namespace detail

// The logits' rows lie ld elements apart (0: V_local, dense); rows that start on 16 bytes are read 16 bytes at a time.

//! Per row: max over the slice, and sum of exp(logit - max) over the slice.
template <Floating T>
void ce_partials(const T* logits, acc_t<T>* row_max, acc_t<T>* row_sumexp, int R, int V_local, std::ptrdiff_t ld,
                 cudaStream_t stream) {
  if (R <= 0) return;
  detail::with_row_block(V_local, [&](auto block) {
    detail::ce_partials_kernel<device_t<T>, block()>
        <<<R, block(), 0, stream>>>(detail::dev(logits), row_max, row_sumexp, V_local, ld ? ld : V_local);
  });
  detail::check_launch("ce_partials");
}

//! Rescales local partials to a new (global) max: sumexp *= exp(local_max - global_max).
template <Floating T>
void ce_rescale(const acc_t<T>* local_max, const acc_t<T>* global_max, acc_t<T>* sumexp, int R, cudaStream_t stream) {
  if (R <= 0) return;
  detail::ce_rescale_kernel<<<detail::blocks_for(R, 256), 256, 0, stream>>>(local_max, global_max, sumexp, R);
  detail::check_launch("ce_rescale");
}

//! Per row: the logit of targets[r] when it lies in this slice, else 0.
template <Floating T>
void ce_target_logit(const T* logits, const std::int32_t* targets, acc_t<T>* target_logit, int R, int V_local, int v0,
                     std::ptrdiff_t ld, cudaStream_t stream) {
  if (R <= 0) return;
  detail::ce_target_logit_kernel<<<detail::blocks_for(R, 256), 256, 0, stream>>>(
      detail::dev(logits), targets, target_logit, R, V_local, v0, ld ? ld : V_local);
  detail::check_launch("ce_target_logit");
}

//! losses[r] = log(sumexp[r]) + max[r] - target_logit[r], from global partials.
template <Floating T>
void ce_losses(const acc_t<T>* row_max, const acc_t<T>* row_sumexp, const acc_t<T>* target_logit, T* losses, int R,
               cudaStream_t stream) {
  if (R <= 0) return;
  detail::ce_losses_kernel<<<detail::blocks_for(R, 256), 256, 0, stream>>>(row_max, row_sumexp, target_logit,
                                                                           detail::dev(losses), R);
  detail::check_launch("ce_losses");
}

//! dlogits[r, v] = dloss[r] * (exp(logit - max[r]) / sumexp[r] - [v0 + v == targets[r]]), with global partials;
//! dlogits may be logits.
template <Floating T>
void ce_backward(const T* logits, const std::int32_t* targets, const acc_t<T>* row_max, const acc_t<T>* row_sumexp,
                 const T* dloss, T* dlogits, int R, int V_local, int v0, std::ptrdiff_t ld, cudaStream_t stream) {
  if (R <= 0) return;
  detail::with_row_block(V_local, [&](auto block) {
    detail::ce_backward_kernel<device_t<T>, block()>
        <<<R, block(), 0, stream>>>(detail::dev(logits), targets, row_max, row_sumexp, detail::dev(dloss),
                                    detail::dev(dlogits), V_local, v0, ld ? ld : V_local);
  });
  detail::check_launch("ce_backward");
}

//! The whole vocabulary's cross-entropy and its gradient at once: losses[r], the row's max and sum of exp, and each
//! logit replaced by d(losses[r]) / d(logit) = softmax - [v == targets[r]] (unscaled: the products that use it
//! apply the loss's scale), one pass over the logits where forward and backward take two reads and a write.
template <Floating T>
void ce_loss_grad(T* logits, const std::int32_t* targets, acc_t<T>* row_max, acc_t<T>* row_sumexp, T* losses, int R,
                  int V, std::ptrdiff_t ld, cudaStream_t stream) {
  if (R <= 0) return;
  detail::with_row_block(V, [&](auto block) {
    detail::ce_loss_grad_kernel<device_t<T>, block()><<<R, block(), 0, stream>>>(
        detail::dev(logits), targets, row_max, row_sumexp, detail::dev(losses), V, ld ? ld : V);
  });
  detail::check_launch("ce_loss_grad");
}

//! The whole single-slice cross-entropy: losses[r] and the partials (R each) for ce_backward.
template <Floating T>
void cross_entropy_forward(const T* logits, const std::int32_t* targets, T* losses, acc_t<T>* row_max,
                           acc_t<T>* row_sumexp, int R, int V, cudaStream_t stream) {
  if (R <= 0) return;
  detail::with_row_block(V, [&](auto block) {
    detail::cross_entropy_forward_kernel<device_t<T>, block()><<<R, block(), 0, stream>>>(
        detail::dev(logits), targets, detail::dev(losses), row_max, row_sumexp, V);
  });
  detail::check_launch("cross_entropy_forward");
}

}  // namespace loom::kernels::cuda

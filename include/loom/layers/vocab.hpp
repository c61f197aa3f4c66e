// The vocabulary split over the tensor-parallel group: the embedding table's rows, and with them the logits of the
// tied output layer and the cross-entropy over them. Rank r holds entries [v0, v0 + V_local) (ceil(V/t) each, the
// last ranks fewer when t does not divide V); the logits are never gathered: the loss combines per-row max and
// sum-of-exp partials across the group.
#pragma once

#include <loom/layers/param.hpp>
#include <loom/layers/tp.hpp>

#include <vector>

namespace loom::layers {

//! The entries [first, first + count) of a vocabulary of V that rank r of t holds.
struct VocabSlice {
  int first, count;
};
inline VocabSlice vocab_slice(int V, int t, int r) {
  const auto u = units_of(V, t, r);
  return {static_cast<int>(u.first), static_cast<int>(u.count)};
}

//! Looks up tokens in this rank's rows of the table (zero for tokens held elsewhere) and sums over the group, as
//! the region's exit: all-reduce, or reduce-scatter to this rank's tokens with sequence parallelism.
template <class T, class Dev = Host, class Tp = TensorParallel<1>>
struct VocabParallelEmbedding {
  using weight_placement = Shard<0>;

  static void declare(ParamTable& t, const std::string& name, std::int64_t vocab, std::int64_t dim, double init_std) {
    t.add<weight_placement>(name + ".weight", {vocab, dim}, true, init_std);
  }

  Region<T, Dev, Tp> region;  //!< N tokens of dim features
  VocabSlice slice;

  //! out (this rank's rows x dim) from the N ids (in Dev's memory), through full (N x dim; may be out without
  //! sequence parallelism).
  void forward(const std::int32_t* ids, const T* table, T* full, T* out) const {
    region.ops.embedding_forward(ids, table, full, region.N, region.C, slice.first, slice.count);
    region.exit_forward(full, out);
  }
  //! dtable += the scatter of d(out), gathered into dfull (N x dim) first with sequence parallelism.
  void backward(const std::int32_t* ids, const T* dout, T* dfull, T* dtable) const {
    region.exit_backward(dout, dfull);
    region.ops.embedding_backward(ids, dfull, dtable, region.N, region.C, slice.first, slice.count);
  }
};

//! Cross-entropy of N rows of logits over this rank's slice of the vocabulary. Forward issues two all-reduces: the
//! row maxima, then the rescaled sums of exp together with the target logits (on a device, ordered on the model's
//! stream: TpGroup::order_on).
template <class T, class Dev = Host, class Tp = TensorParallel<1>>
struct VocabParallelCrossEntropy {
  using acc = typename kernels::Ops<Dev>::template acc_t<T>;
  TpGroup<T, Tp>* tp;
  int N;
  VocabSlice slice;
  kernels::Ops<Dev> ops{};
  std::ptrdiff_t ld = 0;  //!< elements between the logits' rows (0: slice.count)

  //! losses (N) and the global row_max and row_sumexp (N each) that backward needs; targets in Dev's memory.
  void forward(const T* logits, const std::int32_t* targets, T* losses, acc* row_max, acc* row_sumexp) const {
    if (N <= 0) return;
    const std::size_t n = static_cast<unsigned>(N);  // through unsigned: GCC 12 then sees no negative N in copies
    if constexpr (Tp::size == 1) {  // the rank's partials are the whole rows': no exchange, nothing to rescale
      auto target = ops.template scratch<acc>(n);
      ops.ce_partials(logits, row_max, row_sumexp, N, slice.count, ld);
      ops.ce_target_logit(logits, targets, target.data(), N, slice.count, slice.first, ld);
      ops.template ce_losses<T>(row_max, row_sumexp, target.data(), losses, N);
      return;
    }
    auto local_max = ops.template scratch<acc>(n), sums = ops.template scratch<acc>(2 * n);
    ops.ce_partials(logits, local_max.data(), row_sumexp, N, slice.count, ld);
    ops.copy(local_max.data(), row_max, n);
    tp->all_reduce_acc(row_max, N, comm::Reduce::max);
    ops.template ce_rescale<T>(local_max.data(), row_max, row_sumexp, N);
    ops.copy(row_sumexp, sums.data(), n);
    ops.ce_target_logit(logits, targets, sums.data() + N, N, slice.count, slice.first, ld);
    tp->all_reduce_acc(sums.data(), 2 * n, comm::Reduce::sum);
    ops.copy(sums.data(), row_sumexp, n);
    ops.template ce_losses<T>(row_max, row_sumexp, sums.data() + N, losses, N);
  }
  //! Without tensor parallelism (the rank holds the whole vocabulary), forward's losses and partials and backward's
  //! gradient at once: the logits become the gradient of each row's loss, before the loss's scale (the products
  //! that use it apply the scale). One pass over the logits where forward and backward make three.
  void forward_with_gradient(T* logits, const std::int32_t* targets, T* losses, acc* row_max, acc* row_sumexp) const {
    static_assert(Tp::size == 1, "loom: the loss's gradient in its forward needs the whole vocabulary on the rank");
    if (N <= 0) return;
    ops.ce_loss_grad(logits, targets, row_max, row_sumexp, losses, N, slice.count, ld);
  }
  //! dlogits (may be logits) from dloss (N).
  void backward(const T* logits, const std::int32_t* targets, const acc* row_max, const acc* row_sumexp,
                const T* dloss, T* dlogits) const {
    ops.ce_backward(logits, targets, row_max, row_sumexp, dloss, dlogits, N, slice.count, slice.first, ld);
  }
};

}  // namespace loom::layers

// The two ends of the model around its blocks: the embedding (tokens from the vocabulary-parallel table, plus learned
// positions where the spec has them, then dropout) and the head (final norm, logits against the output table, the
// tied embedding or lm_head, vocabulary-parallel cross-entropy). Each call takes the parameters, the micro-batch's
// storage and its dropout it uses.
#pragma once

#include <loom/layers/vocab.hpp>
#include <loom/models/gpt/activations.hpp>
#include <loom/models/gpt/block.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace loom::models {

//! The embedding for one batch shape, on this rank's rows of the region, which sit in the batch's sequences as
//! `place` says: each row takes the position of its token in the whole sequence.
template <class T, class Dev, class Tp>
class GptEmbedding {
 public:
  GptEmbedding(layers::Region<T, Dev, Tp> region, layers::VocabSlice slice, RowPlace place)
      : region_(region), emb_{region, slice}, place_(place) {}

  //! x (this rank's rows x d) from ids (all N, where the kernels read them); full is N x d scratch with sequence
  //! parallelism, else x. wpe: the learned positions, or null (rotary positions enter in attention).
  void forward(const std::int32_t* ids, const T* wte, const T* wpe, T* full, T* x, const Dropout& drop) const {
    const int d = region_.C;
    emb_.forward(ids, wte, full, x);
    if (const int b = place_.whole_sequences(); wpe && b > 0) {
      region_.ops.add_positions(wpe, x, b, place_.seq, d, 0);
    } else if (wpe) {
      place_.each_run([&](int i, int n, int, int t0) {
        region_.ops.add_positions(wpe, x + std::ptrdiff_t(i) * d, 1, n, d, t0);
      });
    }
    drop.forward(region_.ops, x, x, 0, 0);
  }
  //! Accumulates the tables' gradients from dx, the gradient of x (overwritten); dfull as full in forward.
  void backward(const std::int32_t* ids, T* dx, T* dfull, T* dwte, T* dwpe, const Dropout& drop) const {
    const int d = region_.C;
    drop.backward(region_.ops, dx, dx, 0, 0);
    emb_.backward(ids, dx, dfull, dwte);
    if (const int b = place_.whole_sequences(); dwpe && b > 0) {  // summed over the sequences in one pass
      region_.ops.positions_backward(dx, dwpe, b, place_.seq, d, 0);
    } else if (dwpe) {
      place_.each_run([&](int i, int n, int, int t0) {
        region_.ops.positions_backward(dx + std::ptrdiff_t(i) * d, dwpe, 1, n, d, t0);
      });
    }
  }

 private:
  layers::Region<T, Dev, Tp> region_;
  layers::VocabParallelEmbedding<T, Dev, Tp> emb_;
  RowPlace place_;
};

//! The head for one batch shape: the final norm on this rank's rows of the last block's output (slot.out), the
//! logits of this rank's vocabulary against the output table (wte: the tied embedding, or lm_head), and the loss.
template <class T, class Dev, class Tp>
class GptHead {
 public:
  //! gradient_in_forward: the loss's forward writes its gradient over the logits, where the rank holds the whole
  //! vocabulary (GptOptions::loss_gradient_in_forward).
  GptHead(layers::Region<T, Dev, Tp> region, layers::VocabSlice slice, layers::Norm<T, Dev> norm,
          bool gradient_in_forward = false)
      : region_(region), ce_{region.tp, region.N, slice, region.ops, pitch(slice)}, slice_(slice), norm_(norm),
        fused_(Tp::size == 1 && gradient_in_forward) {}

  //! Elements between the rows of the logits of this rank's vocabulary slice (a device pads them to whole lines).
  static std::ptrdiff_t pitch(layers::VocabSlice slice) {
    return kernels::Ops<Dev>::template row_pitch<T>(slice.count);
  }

  //! The mean loss of the micro-batch in st, keeping what backward needs there (lnf_b: null for RMSNorm).
  double forward(GptSlot<T, Dev, Tp>& st, const T* wte, const T* lnf_w, const T* lnf_b) const {
    const auto& ops = region_.ops;
    const int N = region_.N, d = region_.C;
    norm_.forward(st.out.data(), lnf_w, lnf_b, st.lnf.data(), st.lnf_mean.data(), st.lnf_rstd.data(), region_.rows(),
                  d);
    T* lnf_full = full_or(st.lnf_full, st.lnf.data());
    region_.enter_forward(st.lnf.data(), lnf_full);
    ops.matmul_ld(lnf_full, d, wte, d, st.logits.data(), ce_.ld, N, slice_.count, d, false, true);
    st.logits_are_gradient = false;
    if constexpr (Tp::size == 1) {
      if (fused_ && st.backward_follows) {
        ce_.forward_with_gradient(st.logits.data(), st.targets, st.losses.data(), st.row_max.data(),
                                  st.row_sumexp.data());
        st.logits_are_gradient = true;
      }
    }
    if (!st.logits_are_gradient)
      ce_.forward(st.logits.data(), st.targets, st.losses.data(), st.row_max.data(), st.row_sumexp.data());
    return ops.sum(st.losses.data(), std::size_t(N)) / N;
  }
  //! dx, the gradient of the last block's output, from the loss scaled by `scale` (the logits in st become their
  //! gradient); dlnf (this rank's rows x d) keeps the norm's output gradient for backward_weight. dlnf_full and
  //! dloss are scratch (N x d with sequence parallelism, N).
  void backward_input(GptSlot<T, Dev, Tp>& st, double scale, const T* wte, const T* lnf_w, T* dlnf, T* dlnf_full,
                      T* dloss, T* dx) const {
    const auto& ops = region_.ops;
    const int N = region_.N, d = region_.C;
    T* logits = st.logits.data();
    // The logits become the scaled gradient here; or, where forward left each row's loss gradient in them, the
    // products apply the scale as their alpha, a float: where that would round it more than T (double), the
    // gradient is scaled first.
    const double s = scale / N;
    st.logits_alpha = 1.0f;
    if (!st.logits_are_gradient) {
      ops.fill(dloss, std::size_t(N), static_cast<T>(s));
      ce_.backward(logits, st.targets, st.row_max.data(), st.row_sumexp.data(), dloss, logits);
    } else if (sizeof(T) <= sizeof(float) || static_cast<double>(static_cast<float>(s)) == s) {
      st.logits_alpha = static_cast<float>(s);
    } else {
      ops.scale(logits, std::size_t(N) * std::size_t(ce_.ld), static_cast<acc_t<T>>(s));
    }
    T* dfull = region_.sequence_parallel ? dlnf_full : dlnf;
    ops.matmul_ld(logits, ce_.ld, wte, d, dfull, d, N, d, slice_.count, false, false, st.logits_alpha);
    region_.enter_backward(dfull, dlnf);
    norm_.backward_input(dlnf, st.out.data(), lnf_w, st.lnf_mean.data(), st.lnf_rstd.data(), dx, region_.rows(), d);
  }
  //! Accumulates the output table's gradient (this rank's vocabulary rows) and the final norm's.
  void backward_weight(const GptSlot<T, Dev, Tp>& st, const T* dlnf, T* dwte, T* dlnf_w, T* dlnf_b) const {
    const auto& ops = region_.ops;
    const int N = region_.N, d = region_.C;
    ops.matmul_ld(st.logits.data(), ce_.ld, full_or(st.lnf_full, st.lnf.data()), d, dwte, d, slice_.count, d, N, true,
                  false, st.logits_alpha, 1.0f);
    norm_.backward_weight(dlnf, st.out.data(), st.lnf_mean.data(), st.lnf_rstd.data(), dlnf_w, dlnf_b,
                          region_.rows(), d);
  }

 private:
  //! Where a full (N-row) tensor lives: buf with sequence parallelism, else alt (this rank holds every row).
  T* full_or(const Tensor<T, Dev>& buf, T* alt) const { return region_.sequence_parallel ? buf.data() : alt; }

  layers::Region<T, Dev, Tp> region_;
  layers::VocabParallelCrossEntropy<T, Dev, Tp> ce_;
  layers::VocabSlice slice_;
  layers::Norm<T, Dev> norm_;
  bool fused_;  //!< the loss's forward writes its gradient over the logits
};

}  // namespace loom::models

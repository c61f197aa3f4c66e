// The GPT's activation storage and its accounting: what each micro-batch in flight keeps between its forward and
// its backward (a slot), what a split backward keeps between B and W, the scratch every call shares, how much of
// it a batch shape needs, and the bytes held.
#pragma once

#include <loom/models/gpt/block.hpp>
#include <loom/tensor/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace loom::models {

//! What one micro-batch in flight keeps: its blocks' activations, its output (the next part's input, or the final
//! residual), and in the part with the loss the final norm, the logits and the loss statistics.
template <class T, class Dev, class Tp>
struct GptSlot {
  using Block = GptBlock<T, Dev, Tp>;
  using Buf = Tensor<T, Dev>;
  using AccBuf = Tensor<loom::acc_t<T>, Dev>;

  std::vector<typename Block::Acts> act;  //!< one per block; with recompute only act[0].x (the part's input)
  std::vector<Buf> inputs;                //!< with recompute: each block's input but the first
  Buf out, lnf, lnf_full, logits, losses;
  //! The gradient of the part's input: during the slot's backward the gradient of each block's output in turn, then
  //! input_grad(slot) (the embedding's output gradient in the part with it). The slot's own: a backward of another
  //! slot does not touch it.
  Buf dx;
  AccBuf lnf_mean, lnf_rstd, row_max, row_sumexp;
  //! The tokens where the kernels read them: the caller's arrays on the host, the copies below on a device.
  const std::int32_t* ids = nullptr;
  const std::int32_t* targets = nullptr;
  Tensor<std::int32_t, Dev> ids_on_device, targets_on_device;
  //! With context parallelism: this rank's tokens of each sequence (its zigzag chunks), which ids and targets name.
  std::vector<std::int32_t> local_ids, local_targets;
  Dropout dropout{0, 0, 0, {}, 0};
  bool forwarded = false;
  bool backward_follows = true;  //!< the micro-batch's (MicroBatch::backward)
  //! Whether forward left the gradient of each row's loss (before the loss's scale) in logits.
  bool logits_are_gradient = false;
  //! The alpha backward's products with the logits' gradient apply: the loss's scale over the rows where forward
  //! left the gradient unscaled, else 1 (set by the head's backward_input, read by its backward_weight).
  float logits_alpha = 1.0f;

  //! Block i's input (i counted from the part's first block).
  T* input_of(std::size_t i, bool recompute) const {
    return i == 0 || !recompute ? act[recompute ? 0 : i].x.data() : inputs[i].data();
  }
  //! Where block i writes its output: the next block's input, or the part's output after its last block.
  T* output_of(std::size_t i, bool recompute) const {
    return i + 1 < act.size() ? input_of(i + 1, recompute) : out.data();
  }
};

//! What a split backward keeps per slot between B (input gradients) and W (weight gradients): each block's branch
//! gradients, the final norm's output gradient.
template <class T, class Dev, class Tp>
struct GptSplit {
  std::vector<typename GptBlock<T, Dev, Tp>::Grads> blocks;
  Tensor<T, Dev> dlnf;
};

//! The sizes activation storage is made for: a batch shape on this rank's rows, in a part of the model.
struct GptActivationShape {
  std::int64_t rows, tokens, d_model, vocab_rows;  //!< this rank's rows, all N tokens, width, its vocabulary
  int blocks;
  bool embedding, head;
  Recompute recompute;
  int first = 0;  //!< the part's first block
  bool full() const { return recompute == Recompute::full; }
  bool selective() const { return recompute == Recompute::selective; }
};

//! Every slot's storage and the scratch the calls share, for one batch shape.
template <class T, class Dev, class Tp>
struct GptActivations {
  using Block = GptBlock<T, Dev, Tp>;
  using Buf = Tensor<T, Dev>;
  using AccBuf = Tensor<loom::acc_t<T>, Dev>;

  std::vector<GptSlot<T, Dev, Tp>> slots;
  std::vector<GptSplit<T, Dev, Tp>> splits;  //!< made on a slot's first split backward
  typename Block::Acts scratch_act;      //!< with full recompute: the block being recomputed
  //! The branch gradients of a backward that is not split; with selective recompute also the attention core that
  //! forward computes and does not keep.
  typename Block::Grads grads;
  Buf recompute_out, dlnf, partial, emb_full, dlnf_full, dloss;

  //! Storage for shape s in every slot (n of them), made by block's layers.
  void allocate(int n, const GptActivationShape& s, const Block& block) {
    MemoryUseScope use(MemoryUse::activations);
    const std::int64_t rows = s.rows, N = s.tokens, d = s.d_model;
    slots.assign(static_cast<std::size_t>(n), GptSlot<T, Dev, Tp>{});
    for (auto& st : slots) {
      st.act.resize(static_cast<std::size_t>(s.blocks));
      st.inputs.resize(static_cast<std::size_t>(s.blocks));
      if (s.full()) {
        st.act[0].x = Buf({rows, d});
        for (std::size_t i = 1; i < st.inputs.size(); ++i) st.inputs[i] = Buf({rows, d});
      } else {
        for (int i = 0; i < s.blocks; ++i)
          st.act[std::size_t(i)] = block.make_acts(true, !s.selective(), s.first + i);
      }
      st.out = Buf({rows, d});
      st.dx = Buf({rows, d});
      if (s.head) {
        st.lnf = Buf({rows, d});
        st.lnf_mean = AccBuf({rows});
        st.lnf_rstd = AccBuf({rows});
        if (Tp::sequence_parallel) st.lnf_full = Buf({N, d});
        // Rows padded to whole lines (GptHead::pitch) are zeroed once: no kernel writes the padding, and a 16-byte
        // load or an in-place scale that covers it then reads defined values.
        const std::int64_t pitch = kernels::Ops<Dev>::template row_pitch<T>(s.vocab_rows);
        st.logits = pitch == s.vocab_rows ? Buf({N, pitch}) : Buf::zeros({N, pitch});
        st.losses = Buf({N});
        st.row_max = AccBuf({N});
        st.row_sumexp = AccBuf({N});
      }
    }
    splits.clear();
    scratch_act = s.full() ? block.make_acts(false) : typename Block::Acts{};
    recompute_out = s.full() ? Buf({rows, d}) : Buf();
    dlnf = Buf({rows, d});
    partial = emb_full = dlnf_full = Buf();
    if (Tp::sequence_parallel) partial = Buf({N, d}), emb_full = Buf({N, d}), dlnf_full = Buf({N, d});
    dloss = Buf({N});
    grads = block.make_grads(s.selective());
  }

  //! The split-backward storage of slot `slot`, made on first use.
  GptSplit<T, Dev, Tp>& split(int slot, const GptActivationShape& s, const Block& block) {
    if (splits.size() != slots.size()) splits.assign(slots.size(), GptSplit<T, Dev, Tp>{});
    auto& sp = splits[static_cast<std::size_t>(slot)];
    if (sp.blocks.empty()) {
      MemoryUseScope use(MemoryUse::activations);
      for (int i = 0; i < s.blocks; ++i) sp.blocks.push_back(block.make_grads(s.selective(), s.first + i));
      if (s.head) sp.dlnf = Buf({s.rows, s.d_model});
    }
    return sp;
  }

  //! Bytes of every activation and scratch tensor held (this model's own count: ranks that are threads of one
  //! process share the process's).
  std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto& st : slots) {
      for (const auto& a : st.act) n += Block::bytes(a);
      for (const auto& t : st.inputs) n += Block::held(t);
      n += Block::held(st.out, st.dx, st.lnf, st.lnf_full, st.logits, st.losses, st.lnf_mean, st.lnf_rstd, st.row_max,
                       st.row_sumexp);
    }
    n += Block::bytes(scratch_act) + Block::bytes(grads);
    n += Block::held(recompute_out, dlnf, partial, emb_full, dlnf_full, dloss);
    for (const auto& sp : splits) {
      for (const auto& g : sp.blocks) n += Block::bytes(g);
      n += Block::held(sp.dlnf);
    }
    return n;
  }
};

}  // namespace loom::models

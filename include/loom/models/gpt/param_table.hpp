// The GPT's parameters: the table a rank (or a pipeline part of the model) holds, named and ordered as Hugging
// Face's GPT-2, each declared by the layer that owns it with its placement over the tensor-parallel group; and the
// index of the groups the model computes with (the tied embedding, the positions, each block, the final norm).
#pragma once

#include <loom/layers/attention.hpp>
#include <loom/layers/mlp.hpp>
#include <loom/layers/moe.hpp>
#include <loom/layers/param.hpp>
#include <loom/layers/vocab.hpp>
#include <loom/models/gpt/shape.hpp>

#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

namespace loom::models {

using layers::ParamSpec;

//! The parameters of tensor-parallel rank `rank` of `tp` (and expert-parallel rank ep_rank of ep) in part `part` of
//! a GPT of shape s, in Hugging Face's order. tp = ep = 1 and the whole part give the whole model. The tied
//! embedding is held by the parts with the embedding and with the output layer.
template <class T>
std::vector<ParamSpec> gpt_param_specs(const GptShape& s, int tp, int rank, GptPart part, int ep = 1,
                                       int ep_rank = 0) {
  layers::ParamTable t(tp, rank);
  const int d = s.d_model, first = part.first, last = part.last < 0 ? s.layers : part.last;
  const double std_w = 0.02, std_proj = 0.02 / std::sqrt(2.0 * s.layers);
  t.skip(first != 0 && last != s.layers);
  layers::VocabParallelEmbedding<T>::declare(t, "wte", s.vocab, d, std_w);
  t.skip(first != 0);
  t.add<Replicate>("wpe.weight", {s.max_seq, d}, true, 0.01);
  for (int l = 0; l < s.layers; ++l) {
    t.skip(l < first || l >= last);
    const std::string h = "h." + std::to_string(l) + ".";
    t.add<Replicate>(h + "ln_1.weight", {d}, false, 0, 1);
    t.add<Replicate>(h + "ln_1.bias", {d}, false, 0);
    layers::ParallelAttention<T>::declare(t, h + "attn.", d, s.heads, s.kv_heads, std_w, std_proj);
    t.add<Replicate>(h + "ln_2.weight", {d}, false, 0, 1);
    t.add<Replicate>(h + "ln_2.bias", {d}, false, 0);
    if (s.moe_block(l))
      layers::MoeLayer<T>::declare(t, h + "mlp.", d, s.experts, s.expert_width(), s.shared_experts, ep, ep_rank,
                                   std_w, std_proj);
    else
      layers::ParallelMlp<T>::declare(t, h + "mlp.", d, s.ffn(), std_w, std_proj);
  }
  t.skip(last != s.layers);
  t.add<Replicate>("ln_f.weight", {d}, false, 0, 1);
  t.add<Replicate>("ln_f.bias", {d}, false, 0);
  return t.take();
}

//! An index into a part's parameter table that names no parameter: the part does not hold it.
inline constexpr std::size_t no_param = static_cast<std::size_t>(-1);

//! Parameters [first, last) of a part's table, and `also` one more (the tied table, which the output layer
//! completes in a part without the embedding): what a backward chunk completes.
struct ParamRange {
  std::size_t first, last, also = no_param;
};

//! Where the groups of a part's table start: blocks [first, last) of the shape's; the tied table and the positions
//! with the embedding (block 0), the tied table and the final norm with the output layer (the last block). A dense
//! block has 12 parameters (ln_1 2, attention 4, ln_2 2, MLP 4); a mixture-of-experts block 8 and its MoE layer's
//! (its router, its shared experts, the experts this expert-parallel rank of ep holds).
struct GptParamIndex {
  static constexpr std::size_t dense_block = 12;
  int first, last;
  std::size_t wte, wpe, block0, lnf_w, lnf_b;
  std::vector<std::size_t> starts;  //!< block first + i starts at starts[i]; starts.back() ends the last

  GptParamIndex(const GptShape& s, int ep, GptPart part)
      : first(part.first), last(part.last < 0 ? s.layers : part.last),
        wte(first == 0 || last == s.layers ? 0 : no_param), wpe(first == 0 ? 1 : no_param),
        block0((wte == 0 ? 1 : 0) + (first == 0 ? 1 : 0)) {
    starts.push_back(block0);
    for (int l = first; l < last; ++l)
      starts.push_back(starts.back() + (s.moe_block(l) ? 8 + layers::MoeLayer<float>::param_count(
                                                                  s.experts / ep, s.shared_experts)
                                                      : dense_block));
    lnf_w = last == s.layers ? starts.back() : no_param;
    lnf_b = last == s.layers ? lnf_w + 1 : no_param;
  }

  //! Block l's first parameter (l global, in [first, last)).
  std::size_t block(int l) const { return starts[static_cast<std::size_t>(l - first)]; }
  ParamRange of_block(int l) const { return {block(l), starts[static_cast<std::size_t>(l - first) + 1]}; }
};

}  // namespace loom::models

// The model's parameters: the table a rank (or a pipeline part of the model) holds, named and ordered as Hugging
// Face's GPT-2 (for every spec: Llama's parts take the same names for the same roles), each declared by the layer
// that owns it with its placement over the tensor-parallel group; and the index of the groups the model computes with
// (the embedding, the positions, each block, the final norm and the output layer).
#pragma once

#include <loom/layers/attention.hpp>
#include <loom/layers/mlp.hpp>
#include <loom/layers/moe.hpp>
#include <loom/layers/norm.hpp>
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
//! a model of shape s, in the order of the single-rank model's flat buffer (GPT-2's names; Llama's and Mixtral's
//! blocks have the same names for the same roles, models/gpt/hf.hpp maps them to Hugging Face's). tp = ep = 1 and
//! the whole part give the whole model. A tied embedding table is held by the parts with the embedding and with the
//! output layer; an untied one by the first, and the output layer's table (lm_head) by the last.
template <class T>
std::vector<ParamSpec> gpt_param_specs(const GptShape& s, int tp, int rank, GptPart part, int ep = 1,
                                       int ep_rank = 0) {
  layers::ParamTable t(tp, rank);
  const int d = s.d_model, first = part.first, last = part.last < 0 ? s.layers : part.last;
  const bool rms = s.norm == NormKind::rms;
  const double std_w = 0.02, std_proj = 0.02 / std::sqrt(2.0 * s.layers);
  t.skip(first != 0 && (!s.tied || last != s.layers));
  layers::VocabParallelEmbedding<T>::declare(t, "wte", s.vocab, d, std_w);
  t.skip(first != 0);
  if (!s.rope()) t.add<Replicate>("wpe.weight", {s.max_seq, d}, true, 0.01);
  for (int l = 0; l < s.layers; ++l) {
    t.skip(l < first || l >= last);
    const std::string h = "h." + std::to_string(l) + ".";
    layers::Norm<T>::declare(t, h + "ln_1", d, rms);
    layers::ParallelAttention<T>::declare(t, h + "attn.", d, s.heads, s.kv_heads, std_w, std_proj, s.bias);
    layers::Norm<T>::declare(t, h + "ln_2", d, rms);
    if (s.moe_block(l))
      layers::MoeLayer<T>::declare(t, h + "mlp.", d, s.experts, s.expert_width(), s.shared_experts, ep, ep_rank,
                                   std_w, std_proj, s.gated(), s.bias);
    else
      layers::ParallelMlp<T>::declare(t, h + "mlp.", d, s.ffn(), std_w, std_proj, s.gated(), s.bias);
  }
  t.skip(last != s.layers);
  layers::Norm<T>::declare(t, "ln_f", d, rms);
  if (!s.tied) layers::VocabParallelEmbedding<T>::declare(t, "lm_head", s.vocab, d, std_w);
  return t.take();
}

//! Where the groups of a part's table start: the embedding's (the table, and the learned positions) in the part with
//! block 0; blocks [first, last) of the shape's; the output layer's (the final norm, and lm_head when untied) in the
//! part with the last block, which also holds a tied table (at 0 when it has no embedding). Read from the table's
//! names, so that it holds for every spec.
struct GptParamIndex {
  int first, last;
  bool embeds;  //!< the part holds the embedding (block 0)
  std::size_t wte, wpe, block0, lnf_w, lnf_b, lm_head, end;
  std::vector<std::size_t> starts;  //!< block first + i starts at starts[i]; starts.back() ends the last

  GptParamIndex(const GptShape& s, GptPart part, const std::vector<ParamSpec>& specs)
      : first(part.first), last(part.last < 0 ? s.layers : part.last), embeds(first == 0) {
    auto find = [&](const std::string& name) {
      for (std::size_t p = 0; p < specs.size(); ++p)
        if (specs[p].name == name) return p;
      return no_param;
    };
    wte = find("wte.weight"), wpe = find("wpe.weight"), lnf_w = find("ln_f.weight"), lnf_b = find("ln_f.bias");
    lm_head = find("lm_head.weight"), end = specs.size();
    block0 = embeds ? (wpe != no_param ? wpe + 1 : 1) : (wte == 0 ? 1 : 0);
    std::size_t p = block0;
    for (int l = first; l < last; ++l) {
      starts.push_back(p);
      const std::string prefix = "h." + std::to_string(l) + ".";
      while (p < specs.size() && specs[p].name.compare(0, prefix.size(), prefix) == 0) ++p;
    }
    starts.push_back(p);
  }

  //! Block l's first parameter (l global, in [first, last)).
  std::size_t block(int l) const { return starts[static_cast<std::size_t>(l - first)]; }
  ParamRange of_block(int l) const { return {block(l), starts[static_cast<std::size_t>(l - first) + 1]}; }
  //! The embedding's parameters [0, block0) (in the part with it), and the output layer's: the final norm and
  //! lm_head, and a tied table as `also`.
  ParamRange of_embedding() const { return {0, block0}; }
  ParamRange of_head() const { return {lnf_w, end, lm_head == no_param ? wte : no_param}; }
  //! The table the output layer multiplies by: lm_head, or the tied embedding table.
  std::size_t output_table() const { return lm_head != no_param ? lm_head : wte; }
};

}  // namespace loom::models

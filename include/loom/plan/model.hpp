// What the planner plans: a model's shape (train_gpt's shapes and published ones), and a run of it (the batch, the
// sequence, the micro-batches, the element type, recomputation, the optimizer) under a recipe, the way a framework
// keeps its training state and activations: loom's own, or Megatron-LM's as its papers describe it.
#pragma once

#include <loom/core/error.hpp>
#include <loom/models/gpt/shape.hpp>

#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>

namespace loom::plan {

using models::GptShape;
using models::Recompute;

//! The element type of parameters and activations.
enum class Dtype : std::uint8_t { f64, f32, bf16 };

constexpr int bytes_of(Dtype d) { return d == Dtype::f64 ? 8 : d == Dtype::f32 ? 4 : 2; }
//! The accumulation type's bytes (acc_t): optimizer state, master weights, statistics.
constexpr int acc_bytes_of(Dtype d) { return d == Dtype::f64 ? 8 : 4; }
constexpr std::string_view describe_dtype(Dtype d) { return d == Dtype::f64 ? "f64" : d == Dtype::f32 ? "f32" : "bf16"; }
constexpr std::optional<Dtype> dtype_named(std::string_view n) {
  for (Dtype d : {Dtype::f64, Dtype::f32, Dtype::bf16})
    if (describe_dtype(d) == n) return d;
  return std::nullopt;
}

//! How the training state and the activations are kept. loom: as loom's trainer keeps them (parameters and
//! gradients in the element type, the optimizer's state and bf16's master weights in acc_t, activations as
//! models::GptActivations holds them). megatron: as Megatron-LM (Korthikanti et al. 2022): bf16 parameters, fp32
//! gradient buffers, fp32 Adam moments and master weights (18 bytes per parameter; the distributed optimizer, ZeRO-1
//! in loom's spelling, shards the 12 of the optimizer), activations by the paper's per-layer formula.
enum class Recipe : std::uint8_t { loom, megatron };

constexpr std::string_view describe_recipe(Recipe r) { return r == Recipe::loom ? "loom" : "megatron"; }

//! One training run of a model: what train_gpt's flags that change memory or time say.
struct Run {
  int batch = 16;          //!< --batch: global sequences per optimizer step
  int seq = 64;            //!< --seq: tokens per sequence
  int micro_batches = 1;   //!< --micro-batches: per data-parallel rank and step
  Dtype dtype = Dtype::f32;
  Recompute recompute = Recompute::none;
  bool sgd = false;        //!< --optimizer sgd (one momentum buffer) instead of adamw (two moments)
  double capacity_factor = 1.25;  //!< a mixture of experts' (0: dropless)
  std::int64_t bucket_bytes = std::int64_t{25} << 20;  //!< --bucket-mb: gradient buckets
  Recipe recipe = Recipe::loom;
  //! Under Megatron-LM's recipe: attention as a fused flash kernel (causal work, no s x s scores kept) instead of
  //! the 2021-22 papers' square scores and softmax. loom's attention is always of the first kind.
  bool flash = false;
  //! Under Megatron-LM's recipe: fp16 training as Megatron-LM ran it in 2021, the gradient buffer in fp16 (all-reduced
  //! so) and copied to an fp32 gradient of the master weights for the step (20 bytes per parameter there); without
  //! it, bf16's fp32 gradient buffer (18 bytes).
  bool fp16_grads = false;
  //! Under Megatron-LM's recipe: the gradient all-reduce overlaps the last micro-batch's backward (PyTorch's
  //! DistributedDataParallel, or Megatron-Core's --overlap-grad-reduce); without it, it follows backward.
  bool overlap_grad_reduce = false;
  //! Under Megatron-LM's recipe: dropout, whose masks the activations keep (GPT-3's runs; Llama 3 trains without).
  bool dropout = true;
  //! Under Megatron-LM's recipe: Llama 3's pipeline, whose first part holds the embedding alone and last part the
  //! output layer alone, the blocks split over the parts between (a stage's first chunk then has no block).
  bool ends_alone = false;
  //! Under Megatron-LM's recipe: context parallelism as Llama 3 ran it, each layer's keys and values all-gathered over
  //! the group before attention (and their gradients reduce-scattered), not passed around a ring under it.
  bool cp_all_gather = false;

  //! Sequences per micro-batch on a data-parallel rank (of dp).
  constexpr int micro_batch_size(int dp) const { return batch / (dp * micro_batches); }
};

//! A Megatron-LM GPT (Narayanan et al. 2021, Korthikanti et al. 2022): GPT-2's parts, vocabulary 51200, 2048
//! positions, an MLP of 4 h.
constexpr GptShape megatron_gpt(int layers, int hidden, int heads) {
  return GptShape{layers, heads, heads, hidden, 51200, 2048};
}
//! Llama 3 (Grattafiori et al. 2024, Table 3): GQA with 8 key/value heads, vocabulary 128256, RoPE theta 500000 with
//! Llama 3.1's scaling, an untied output layer.
constexpr GptShape llama3(int layers, int d, int heads, int ffn, int max_seq = 131072) {
  return models::llama3_spec({layers, heads, 8, d, 128256, max_seq, ffn}, 500000, {8, 1, 4, 8192});
}

//! Published shapes by name: the models of Korthikanti et al. 2022 (megatron-22b, gpt3-175b, megatron-530b,
//! megatron-1t), Narayanan et al. 2021's Table 1 (megatron-1.7b ... megatron-1t), Llama 3 (8B, 70B, 405B) and
//! Mixtral 8x7B.
inline constexpr std::pair<std::string_view, GptShape> published_shapes[] = {
    {"megatron-1.7b", megatron_gpt(24, 2304, 24)},    {"megatron-3.6b", megatron_gpt(30, 3072, 32)},
    {"megatron-7.5b", megatron_gpt(36, 4096, 32)},    {"megatron-18b", megatron_gpt(40, 6144, 48)},
    {"megatron-22b", megatron_gpt(48, 6144, 64)},     {"megatron-39b", megatron_gpt(48, 8192, 64)},
    {"megatron-76b", megatron_gpt(60, 10240, 80)},    {"megatron-146b", megatron_gpt(80, 12288, 96)},
    {"gpt3-175b", megatron_gpt(96, 12288, 96)},       {"megatron-310b", megatron_gpt(96, 16384, 128)},
    {"megatron-530b", megatron_gpt(105, 20480, 128)}, {"megatron-1t", megatron_gpt(128, 25600, 160)},
    {"llama3-8b", llama3(32, 4096, 32, 14336)},       {"llama3-70b", llama3(80, 8192, 64, 28672)},
    {"llama3-405b", llama3(126, 16384, 128, 53248)},
    {"mixtral-8x7b", models::mixtral_spec({32, 32, 8, 4096, 32000, 32768, 14336})},
};

//! The shape called `name`: train_gpt's (models::shape_named) or a published one; none if neither.
constexpr std::optional<GptShape> model_named(std::string_view name) {
  if (auto s = models::shape_named(name)) return s;
  for (const auto& [n, s] : published_shapes)
    if (n == name) return s;
  return std::nullopt;
}

//! The names model_named knows, comma-separated.
inline std::string model_names() {
  std::string s = "tiny, small, gpt2, long, tiny-moe, small-moe, llama-tiny, llama-small, llama3-1b, mixtral-tiny, "
                  "mixtral-small";
  for (const auto& [n, shape] : published_shapes) s += ", " + std::string(n);
  return s;
}

}  // namespace loom::plan

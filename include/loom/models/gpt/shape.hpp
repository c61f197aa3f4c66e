// The GPT's compile-time description: its shape, the part of it a pipeline stage holds, its options, and the rules
// a shape and a layout must meet, checked where a model is declared.
#pragma once

#include <loom/config.hpp>
#include <loom/core/device.hpp>
#include <loom/models/part.hpp>

#include <cmath>
#include <cstdint>
#include <numbers>
#include <numeric>
#include <optional>
#include <utility>
#include <string_view>
#include <type_traits>
#include <vector>

namespace loom::models {

//! The norm a block (and the final norm) uses: LayerNorm with weight and bias (GPT-2), or RMSNorm with a weight
//! (Llama, Mixtral).
enum class NormKind : std::uint8_t { layer, rms };
//! How a token's position enters: learned absolute positions added to the embedding (GPT-2), or rotary positions
//! applied to every head's queries and keys (RoPE: Llama, Mixtral).
enum class PositionKind : std::uint8_t { learned, rope };
//! The MLP's (and every expert's) activation: GELU between two projections (GPT-2), or SwiGLU, silu(x W_gate) *
//! (x W_up) before the down projection (Llama, Mixtral).
enum class MlpKind : std::uint8_t { gelu, swiglu };

//! Llama 3's scaling of the rotary frequencies (Hugging Face's rope_scaling of rope_type "llama3"): wavelengths
//! longer than original_max / low_freq_factor are stretched by `factor`, those shorter than original_max /
//! high_freq_factor kept, those between interpolated. factor 0: no scaling.
struct RopeScaling {
  double factor = 0, low_freq_factor = 1, high_freq_factor = 4;
  int original_max = 8192;
  constexpr bool operator==(const RopeScaling&) const = default;
};

//! The shape of a decoder-only transformer, and the parts its blocks are made of. vocab is the full vocabulary,
//! max_seq the longest sequence (the learned positions' count, or the rotary tables' length), d_ff the MLP's width
//! (0: 4 d_model, GPT-2's). A mixture-of-experts model has `experts` > 0: block l's MLP is a mixture of experts when
//! l % moe_every == 0, each token going to top_k of them; every expert is an MLP of width expert_ff (0: the dense
//! width), and shared_experts such MLPs (one of their summed width) take every token as well (DeepSeek's shared
//! experts).
//!
//! The parts (a spec, as Megatron-Core's layer specs name a block's submodules): the norm, the positions, the MLP's
//! activation, whether the attention's and MLP's linear layers have biases, whether the output layer is the
//! embedding table (tied) or a table of its own, whether the router renormalises the chosen experts' weights, and
//! RoPE's base and scaling. GPT-2, Llama 3 and Mixtral are three specs of the same block (gpt2_spec, llama3_spec,
//! mixtral_spec below).
struct GptShape {
  int layers, heads, kv_heads, d_model, vocab, max_seq, d_ff = 0;
  int experts = 0, top_k = 2, moe_every = 1, expert_ff = 0, shared_experts = 0;
  NormKind norm = NormKind::layer;
  PositionKind positions = PositionKind::learned;
  MlpKind mlp = MlpKind::gelu;
  bool bias = true;         //!< biases on the attention's and the MLPs' projections
  bool tied = true;         //!< the output layer multiplies by the embedding table (else lm_head.weight)
  bool renormalize = true;  //!< a router's top-k weights renormalised to sum to one (else the softmax's own)
  double rope_theta = 10000;
  RopeScaling rope_scaling{};

  constexpr int head_dim() const { return d_model / heads; }
  constexpr int qkv_width() const { return (heads + 2 * kv_heads) * head_dim(); }
  constexpr int ffn() const { return d_ff > 0 ? d_ff : 4 * d_model; }
  //! Whether block l's MLP is a mixture of experts.
  constexpr bool moe_block(int l) const { return experts > 0 && moe_every > 0 && l % moe_every == 0; }
  constexpr int expert_width() const { return expert_ff > 0 ? expert_ff : ffn(); }
  constexpr bool gated() const { return mlp == MlpKind::swiglu; }
  constexpr bool rope() const { return positions == PositionKind::rope; }
  //! Elements of one norm's parameters (weight, and LayerNorm's bias).
  constexpr std::int64_t norm_params() const { return norm == NormKind::layer ? 2 * d_model : d_model; }
  //! Parameters of an MLP of width f: its up projection (d x f, or d x 2f gate and up with SwiGLU), its down
  //! projection (f x d), and their biases where the spec has them.
  constexpr std::int64_t mlp_params(int f) const {
    const std::int64_t up = gated() ? 2 * std::int64_t{f} : f;
    return std::int64_t{d_model} * up + std::int64_t{f} * d_model + (bias ? up + d_model : 0);
  }
  //! Block l's parameters; with `held_experts` >= 0, counting that many of its experts (a rank's share).
  constexpr std::int64_t block_params(int l, int held_experts = -1) const {
    const std::int64_t d = d_model;
    const std::int64_t common = 2 * norm_params() + d * qkv_width() + d * d + (bias ? qkv_width() + d : 0);
    if (!moe_block(l)) return common + mlp_params(ffn());
    const int e = held_experts < 0 ? experts : held_experts;
    return common + d * experts + (shared_experts > 0 ? mlp_params(shared_experts * expert_width()) : 0) +
           e * mlp_params(expert_width());
  }
  //! Parameters, counting a tied embedding once.
  constexpr std::int64_t params() const { return active_params(-1); }
  //! Parameters a token's computation reads: every expert counted (-1), or top_k of each MoE layer's (active).
  constexpr std::int64_t active_params(int held_experts) const {
    std::int64_t n = std::int64_t{vocab} * d_model * (tied ? 1 : 2) + norm_params() +
                     (rope() ? 0 : std::int64_t{max_seq} * d_model);
    for (int l = 0; l < layers; ++l) n += block_params(l, held_experts);
    return n;
  }
  constexpr std::int64_t active_params() const { return active_params(top_k); }
  //! Training FLOPs per token (forward and backward, 3 x 2 per multiply-add) at sequence length seq: the matrix
  //! products of the active parameters (the embedding lookup excluded, the output layer included) and causal
  //! attention's two products, seq/2 keys on average (PaLM's appendix B counts 6N + 12 L d seq for full attention).
  constexpr double flops_per_token(int seq) const {
    const double matmul = static_cast<double>(active_params() - std::int64_t{vocab} * d_model * (tied ? 0 : 1) -
                                              (rope() ? 0 : std::int64_t{max_seq} * d_model));
    return 6.0 * matmul + 6.0 * layers * heads * head_dim() * static_cast<double>(seq);
  }

  constexpr bool operator==(const GptShape&) const = default;
};

//! The rotary frequencies of a shape's heads, one per plane (head_dim / 2): theta^(-2j / head_dim), then Llama 3's
//! scaling where the shape has it (Hugging Face's rope_type "llama3"); in double.
inline std::vector<double> rope_frequencies(const GptShape& s) {
  const int hd = s.head_dim();
  const RopeScaling& r = s.rope_scaling;
  std::vector<double> f(static_cast<std::size_t>(hd / 2));
  for (int j = 0; j < hd / 2; ++j) {
    double inv = 1.0 / std::pow(s.rope_theta, 2.0 * j / hd);
    if (r.factor != 0) {
      const double wavelen = 2 * std::numbers::pi / inv;
      const double low_wavelen = r.original_max / r.low_freq_factor, high_wavelen = r.original_max / r.high_freq_factor;
      if (wavelen > low_wavelen) {
        inv /= r.factor;
      } else if (wavelen >= high_wavelen) {  // between: interpolated
        const double smooth = (r.original_max / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        inv = (1 - smooth) * inv / r.factor + smooth * inv;
      }
    }
    f[static_cast<std::size_t>(j)] = inv;
  }
  return f;
}

//! The parts of GPT-2's block: LayerNorm, learned positions, GELU, biases, the tied embedding.
constexpr GptShape gpt2_spec(GptShape s) { return s; }
//! Llama 3's: RMSNorm, RoPE (theta, and the frequency scaling when given), SwiGLU, no biases, an output layer of its
//! own.
constexpr GptShape llama3_spec(GptShape s, double theta = 500000, RopeScaling scaling = {}) {
  s.norm = NormKind::rms, s.positions = PositionKind::rope, s.mlp = MlpKind::swiglu;
  s.bias = false, s.tied = false, s.rope_theta = theta, s.rope_scaling = scaling;
  return s;
}
//! Mixtral's: Llama's block with a mixture of SwiGLU experts in every layer, top-k of them, their softmax weights
//! renormalised over the chosen. No block has a dense MLP: d_ff is the experts' width (Hugging Face's
//! intermediate_size), so that a shape read from Mixtral's config.json is this one.
constexpr GptShape mixtral_spec(GptShape s, int experts = 8, int top_k = 2, double theta = 1e6) {
  s = llama3_spec(s, theta);
  s.experts = experts, s.top_k = top_k, s.moe_every = 1, s.renormalize = true;
  s.expert_ff = s.d_ff = s.expert_width();
  return s;
}

//! The shapes train_gpt knows by name.
inline constexpr GptShape tiny{2, 4, 4, 64, 256, 128};
inline constexpr GptShape small{4, 8, 8, 256, 256, 256};
inline constexpr GptShape gpt2{12, 12, 12, 768, 50257, 1024};
//! tiny's width and depth with 32768 learned positions: the long-context shape context parallelism is shown on.
inline constexpr GptShape long_context{2, 4, 4, 64, 256, 32768};
//! tiny and small with a mixture of 8 experts, top-2, in every block; each expert half the dense MLP's width, so
//! that a token reads as many MLP parameters as in the dense model.
inline constexpr GptShape tiny_moe{2, 4, 4, 64, 256, 128, 0, 8, 2, 1, 128};
inline constexpr GptShape small_moe{4, 8, 8, 256, 256, 256, 0, 8, 2, 1, 512};
//! The Llama family on bytes: tiny's and small's dimensions (grouped-query attention, SwiGLU of width 8/3 d rounded
//! to 32) with Llama 3's parts; RoPE's frequencies scaled as Llama 3.1's for contexts past a quarter of max_seq.
inline constexpr GptShape llama_tiny = llama3_spec({2, 4, 2, 64, 256, 128, 192}, 500000, {8, 1, 4, 32});
inline constexpr GptShape llama_small = llama3_spec({4, 8, 4, 256, 256, 256, 704}, 500000, {8, 1, 4, 64});
//! Llama 3.2 1B's dimensions: 16 layers, d 2048, 32 heads of 64, 8 kv heads, FFN 8192, vocabulary 128256, RoPE
//! theta 500000 with Llama 3's scaling (factor 32 from 8192 positions), and its tied output layer.
inline constexpr GptShape llama3_1b = [] {
  GptShape s = llama3_spec({16, 32, 8, 2048, 128256, 131072, 8192}, 500000, {32, 1, 4, 8192});
  s.tied = true;
  return s;
}();
//! Mixtral's parts at tiny's and small's dimensions: 8 SwiGLU experts of half the dense width, top-2.
inline constexpr GptShape mixtral_tiny = mixtral_spec({2, 4, 2, 64, 256, 128, 0, 0, 2, 1, 96});
inline constexpr GptShape mixtral_small = mixtral_spec({4, 8, 4, 256, 256, 256, 0, 0, 2, 1, 352});

//! The shape train_gpt's --model calls `name` (tiny, small, gpt2, long, tiny-moe, small-moe, llama-tiny, llama-small,
//! llama3-1b, mixtral-tiny, mixtral-small), or none.
constexpr std::optional<GptShape> shape_named(std::string_view name) {
  constexpr std::pair<std::string_view, GptShape> named[] = {
      {"tiny", tiny},           {"small", small},           {"gpt2", gpt2},
      {"long", long_context},   {"tiny-moe", tiny_moe},     {"small-moe", small_moe},
      {"llama-tiny", llama_tiny}, {"llama-small", llama_small}, {"llama3-1b", llama3_1b},
      {"mixtral-tiny", mixtral_tiny}, {"mixtral-small", mixtral_small}};
  for (const auto& [n, s] : named)
    if (n == name) return s;
  return std::nullopt;
}

//! The part of a GPT a pipeline stage holds (models::Part): the part with block 0 holds the embedding, the part with
//! the last block the final norm, the output layer and the loss.
using GptPart = Part;

//! What a block keeps from forward for backward (Korthikanti et al. 2022). none: every activation; selective: all
//! but the attention core's output and log-sum-exp, which backward recomputes from q, k and v (with context
//! parallelism, another pass around the ring or another all-to-all); full: only the block's input, the whole block
//! recomputed during backward.
enum class Recompute { none, selective, full };

//! "none", "selective" or "full".
constexpr std::string_view describe_recompute(Recompute r) {
  return r == Recompute::none ? "none" : r == Recompute::selective ? "selective" : "full";
}
//! The mode describe_recompute names `name`, or none.
constexpr std::optional<Recompute> recompute_named(std::string_view name) {
  for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full})
    if (describe_recompute(r) == name) return r;
  return std::nullopt;
}

//! How a mixture-of-experts layer routes (layers::RouterConfig takes the experts and top_k from the shape).
struct MoeOptions {
  double capacity_factor = 1.25;  //!< capacity = ceil(T k / E x factor) per sequence of T tokens; 0: dropless
  double aux_loss_coeff = 0.01;   //!< the Switch load-balancing loss's coefficient
  double z_loss_coeff = 0.0;      //!< the router z-loss's
  bool sigmoid = false;           //!< sigmoid scores (DeepSeek-V3) instead of the softmax
};

struct GptOptions {
  Recompute recompute = Recompute::none;
  MoeOptions moe{};
  float dropout = 0.0f;    //!< on the embedding output and each residual branch
  double ln_eps = 1e-5;  //!< the norms' epsilon (LayerNorm's or RMSNorm's)
  //! Whether building the model writes its buffers: the parameters initialised from the seed, the gradients zeroed.
  //! A model whose buffers are held in shards (ZeRO-3) is built without, and whoever holds a shard writes it
  //! (GptWeights::initialise for the parameters; the gradients it zeroes before they are written).
  bool write_buffers = true;
  //! Without tensor parallelism, whether the loss's forward also writes its gradient over the logits (one kernel
  //! and one pass over them fewer on a device; the products of backward apply the loss's scale): then logits() is
  //! not available after forward. The trainer, which never reads the logits, turns it on.
  bool loss_gradient_in_forward = false;
};

//! The first rule of a GPT's dimensions that a shape breaks, or an empty view (Gpt<S> checks them at compile time,
//! GptModel when it is built).
constexpr std::string_view shape_violation(GptShape s) {
  if (s.layers < 1 || s.heads < 1 || s.kv_heads < 1 || s.d_model < 1 || s.vocab < 1 || s.max_seq < 1)
    return "every GPT dimension must be at least 1";
  if (s.d_model % s.heads != 0) return "d_model must be divisible by heads";
  if (s.heads % s.kv_heads != 0) return "heads must be divisible by kv_heads";
  if (s.experts < 0 || s.shared_experts < 0 || s.expert_ff < 0) return "experts, expert_ff and shared_experts must "
                                                                        "not be negative";
  if (s.experts > 0 && (s.top_k < 1 || s.top_k > s.experts)) return "top_k must be in 1..experts";
  if (s.experts > 0 && s.moe_every < 1) return "moe_every must be at least 1";
  if (s.rope() && s.head_dim() % 2 != 0) return "rotary positions need an even head_dim";
  if (s.rope() && !(s.rope_theta > 1)) return "rope_theta must be above 1";
  if (s.rope_scaling.factor != 0 && (s.rope_scaling.factor < 1 || s.rope_scaling.original_max < 1 ||
                                     !(s.rope_scaling.high_freq_factor > s.rope_scaling.low_freq_factor)))
    return "rope scaling needs factor >= 1, original_max >= 1 and high_freq_factor > low_freq_factor";
  return {};
}

//! The first rule of TensorParallelRules that a shape breaks over tp ranks, or an empty view: for choosing among
//! layouts at compile time without tripping the rules.
constexpr std::string_view tensor_parallel_violation(GptShape s, int tp, bool sequence_parallel) {
  if (s.heads % tp != 0) return "heads must be divisible by TP";
  if (s.kv_heads % tp != 0 && tp % s.kv_heads != 0) return "kv_heads and TP must divide one another";
  if (s.ffn() % tp != 0) return "d_ff must be divisible by TP";
  if (s.vocab < tp) return "the vocabulary must have at least TP entries";
  if (sequence_parallel && s.max_seq % tp != 0) return "with sequence parallelism max_seq must be divisible by TP";
  return {};
}

//! The rules a shape must meet to be split over TP ranks, checked where a model is declared.
template <GptShape S, int TP, bool SequenceParallel>
struct TensorParallelRules {
  static_assert(S.heads % TP == 0, "loom: heads must be divisible by TP (attention is split by heads)");
  static_assert(S.kv_heads % TP == 0 || TP % S.kv_heads == 0,
                "loom: kv_heads and TP must divide one another (kv heads are split when kv_heads >= TP and "
                "replicated on TP / kv_heads ranks when kv_heads < TP)");
  static_assert(S.ffn() % TP == 0, "loom: d_ff must be divisible by TP (the MLP is split by features)");
  static_assert(S.vocab >= TP, "loom: the vocabulary must have at least TP entries (it is split by rows)");
  static_assert(!SequenceParallel || S.max_seq % TP == 0,
                "loom: with sequence parallelism max_seq must be divisible by TP (sequences are split over TP)");
  static constexpr bool ok = true;
};

//! The first rule of ContextParallelRules that a shape breaks over cp ranks with algorithm a (after a split over tp
//! ranks), or an empty view.
constexpr std::string_view context_parallel_violation(GptShape s, int tp, int cp, CpAlgorithm a) {
  const int heads = s.heads / tp, kv = s.kv_heads >= tp ? s.kv_heads / tp : 1;
  if (cp > 1 && a == CpAlgorithm::ulysses && (heads % cp != 0 || kv % cp != 0))
    return "Ulysses needs each tensor-parallel rank's heads and key/value heads divisible by CP";
  if (s.max_seq < 2 * cp) return "CP<n> cuts each sequence into 2n chunks: max_seq must be at least 2n";
  return {};
}

//! The rules a shape must meet to be split over CP context-parallel ranks with algorithm A, on top of TP's: Ulysses
//! gives each cp rank a share of this tensor-parallel rank's query and key/value heads, so both must divide by CP
//! (key/value heads are not replicated to make them: a shape whose kv heads do not divide uses ring attention).
template <GptShape S, int TP, int CP, CpAlgorithm A>
struct ContextParallelRules {
  static constexpr int local_heads = S.heads / TP;
  static constexpr int local_kv_heads = S.kv_heads >= TP ? S.kv_heads / TP : 1;
  static_assert(CP == 1 || A != CpAlgorithm::ulysses || local_heads % CP == 0,
                "loom: CP<n, Ulysses> needs each tensor-parallel rank's heads (heads / TP) divisible by n (the "
                "all-to-all splits them over the cp ranks); ring attention takes any");
  static_assert(CP == 1 || A != CpAlgorithm::ulysses || local_kv_heads % CP == 0,
                "loom: CP<n, Ulysses> needs each tensor-parallel rank's key/value heads divisible by n (they are "
                "not replicated); ring attention takes any");
  static_assert(S.max_seq >= 2 * CP,
                "loom: CP<n> cuts each sequence into 2n chunks: max_seq must be at least 2n");
  static constexpr bool ok = true;
};

//! The first rule of ExpertParallelRules that a shape breaks over ep ranks, or an empty view.
constexpr std::string_view expert_parallel_violation(GptShape s, int ep) {
  if (ep > 1 && s.experts == 0) return "EP<n> needs a mixture-of-experts model (experts > 0)";
  if (s.experts > 0 && s.experts % ep != 0) return "the experts must be divisible by EP";
  return {};
}

//! The rules a shape must meet for its experts to be split over EP ranks: each rank holds experts / EP of every
//! MoE layer's.
template <GptShape S, int EP>
struct ExpertParallelRules {
  static_assert(EP == 1 || S.experts > 0, "loom: EP<n> (n > 1) needs a mixture-of-experts model (experts > 0)");
  static_assert(S.experts == 0 || S.experts % EP == 0,
                "loom: the experts must be divisible by EP (each expert-parallel rank holds experts / EP)");
  static constexpr bool ok = true;
};

//! Every rule a shape S must meet to be trained on the whole layout Cfg on device Dev: the tensor-, context- and
//! expert-parallel rules and the device's. train::Trainer<Cfg, Gpt<S, ...>> checks them; Gpt<S, T, ModelLayout<Cfg>>
//! checks those its model layout names (all but the expert-parallel degree's).
template <GptShape S, class Cfg, class Dev = Host>
struct LayoutRules {
  static constexpr int tp = Cfg::template size<Axis::tp>, cp = Cfg::template size<Axis::cp>;
  static_assert(TensorParallelRules<S, tp, Cfg::sequence_parallel>::ok);
  static_assert(ContextParallelRules<S, tp, cp, Cfg::cp_algorithm>::ok);
  static_assert(ExpertParallelRules<S, Cfg::template size<Axis::ep>>::ok);
  static_assert(DeviceRules<Dev, Cfg>::ok);
  static constexpr bool ok = true;
};

}  // namespace loom::models

// The GPT's compile-time description: its shape, the part of it a pipeline stage holds, its options, and the rules
// a shape and a layout must meet, checked where a model is declared.
#pragma once

#include <loom/config.hpp>
#include <loom/core/device.hpp>

#include <cstdint>
#include <string_view>
#include <type_traits>

namespace loom::models {

//! The shape of a GPT. vocab is the full vocabulary, max_seq the number of learned positions, d_ff the MLP's width
//! (0: 4 d_model, GPT-2's).
struct GptShape {
  int layers, heads, kv_heads, d_model, vocab, max_seq, d_ff = 0;

  constexpr int head_dim() const { return d_model / heads; }
  constexpr int qkv_width() const { return (heads + 2 * kv_heads) * head_dim(); }
  constexpr int ffn() const { return d_ff > 0 ? d_ff : 4 * d_model; }
  constexpr std::int64_t block_params() const {
    const std::int64_t d = d_model;
    return 2 * d + d * qkv_width() + qkv_width() + d * d + d + 2 * d + d * ffn() + ffn() + ffn() * d + d;
  }
  //! Parameters, counting the tied embedding once.
  constexpr std::int64_t params() const {
    return std::int64_t{vocab} * d_model + std::int64_t{max_seq} * d_model + layers * block_params() + 2 * d_model;
  }
};

//! The shapes train_gpt knows by name.
inline constexpr GptShape tiny{2, 4, 4, 64, 256, 128};
inline constexpr GptShape small{4, 8, 8, 256, 256, 256};
inline constexpr GptShape gpt2{12, 12, 12, 768, 50257, 1024};

//! The part of the model a pipeline stage holds: blocks [first, last) (last -1: to the end); the part with block 0
//! holds the embedding, the part with the last block the final norm, the tied output layer and the loss.
struct GptPart {
  int first = 0, last = -1;
};

struct GptOptions {
  bool recompute = false;  //!< keep only each block's input; recompute the rest during backward
  float dropout = 0.0f;    //!< on the embedding output and each residual branch
  float ln_eps = 1e-5f;
  //! Whether building the model writes its buffers: the parameters initialised from the seed, the gradients zeroed.
  //! A model whose buffers are held in shards (ZeRO-3) is built without, and whoever holds a shard writes it
  //! (GptWeights::initialise for the parameters; the gradients it zeroes before they are written).
  bool write_buffers = true;
};

//! The first rule of a GPT's dimensions that a shape breaks, or an empty view (Gpt<S> checks them at compile time,
//! GptModel when it is built).
constexpr std::string_view shape_violation(GptShape s) {
  if (s.layers < 1 || s.heads < 1 || s.kv_heads < 1 || s.d_model < 1 || s.vocab < 1 || s.max_seq < 1)
    return "every GPT dimension must be at least 1";
  if (s.d_model % s.heads != 0) return "d_model must be divisible by heads";
  if (s.heads % s.kv_heads != 0) return "heads must be divisible by kv_heads";
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

//! The rules a layout must meet for a model on device Dev, checked where a model is declared.
//!
//! On a device only a tensor-parallel group of one, which issues no collective, is correct. The communicators take
//! device pointers (Nccl; Local with <loom/comm/local_cuda.cuh>, ranks sharing one GPU), but the model does not yet
//! wait for its stream before a tensor-parallel collective, and sync_grads packs the shared gradients in host
//! memory (std::vector). Those two lift the rule.
template <class Dev, class Cfg>
struct DeviceRules {
  static_assert(std::is_same_v<Dev, Host> || std::is_same_v<Dev, Cuda>, "loom: a model's device is Host or Cuda");
  static_assert(std::is_same_v<Dev, Host> || (Cfg::template size<Axis::tp> == 1 && !Cfg::sequence_parallel),
                "loom: a model on a CUDA device supports tp = 1 only, without sequence parallelism (the "
                "tensor-parallel collectives take host memory)");
  static constexpr bool ok = true;
};

//! What a layout may carry that no model or trainer reads yet. A layout that carries it does not compile, rather
//! than train as something other than what its type says; checked where a model or its layout is declared.
template <class Cfg>
struct ImplementedRules {
  static_assert(Cfg::template size<Axis::cp> == 1,
                "loom: CP<n> with n > 1 (context parallelism) is not implemented yet");
  static_assert(!Cfg::cp_algorithm_given,
                "loom: CP<n, Ring> and CP<n, Ulysses> (context-parallel attention) are not implemented yet");
  static_assert(Cfg::template size<Axis::ep> == 1,
                "loom: EP<n> with n > 1 (expert parallelism) is not implemented yet");
  static constexpr bool ok = true;
};

namespace detail {
template <class Cfg>
struct ModelLayoutOf {
  static_assert(ImplementedRules<Cfg>::ok);
  static constexpr int tp = Cfg::template size<Axis::tp>;
  using type = std::conditional_t<tp == 1, Parallel<>,
                                  std::conditional_t<Cfg::sequence_parallel, Parallel<TP<tp, SequenceParallel>>,
                                                     Parallel<TP<tp>>>>;
};
}  // namespace detail

//! The part of a layout a model's type depends on: its tensor-parallel degree and sequence parallelism. Gpt<S, T,
//! ModelLayout<Cfg>> is one type for every layout that differs from Cfg only in its other axes.
template <class Cfg>
using ModelLayout = typename detail::ModelLayoutOf<Cfg>::type;

}  // namespace loom::models

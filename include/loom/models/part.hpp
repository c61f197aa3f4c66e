// What every model shares with the trainer, whatever its kind: the part of a model a pipeline stage holds (a range of
// its blocks), a range of a part's parameter table, the part of a layout a model's type depends on (ModelLayout),
// and the rules a layout must meet for a model on a device.
#pragma once

#include <loom/config.hpp>
#include <loom/core/device.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace loom::models {

//! The part of a model a pipeline stage holds: blocks [first, last) of the model's shape().layers (last -1: to the
//! end). The part with block 0 reads the token ids; the part with the last block computes the loss.
struct Part {
  int first = 0, last = -1;
};

//! An index into a part's parameter table that names no parameter: the part does not hold it.
inline constexpr std::size_t no_param = static_cast<std::size_t>(-1);

//! Parameters [first, last) of a part's table, and `also` one more (a table tied between the input and the output,
//! which the output layer completes in a part without the input's): what a backward chunk completes, or what a
//! forward unit reads.
struct ParamRange {
  std::size_t first, last, also = no_param;
};

//! One micro-batch through a part of a model: whole sequences, of which a rank takes its share (with context
//! parallelism its two zigzag chunks of each). A model may declare its own MicroBatch with these members; the
//! library's models use this one.
struct MicroBatch {
  const std::int32_t* ids;      //!< B*T in host memory, read by the part with the embedding
  const std::int32_t* targets;  //!< B*T in host memory, read by the part with the loss
  int batch, seq;               //!< B sequences of T tokens
  std::uint64_t step = 0;       //!< keys dropout, with row0 (the global index of the batch's first sequence),
  std::int64_t row0 = 0;        //!< so that its mask does not depend on how the batch is split
  //! Whether a backward of the micro-batch follows its forward: false in evaluation, where the loss's forward keeps
  //! only the loss (GptOptions::loss_gradient_in_forward then leaves the logits as they are).
  bool backward = true;
};

//! The rules a layout must meet for a model on device Dev, checked where a model is declared.
//!
//! On a device, tensor parallelism (with sequence parallelism or without) runs its collectives on device memory
//! (Local with <loom/comm/local_cuda.hpp>, ranks sharing one GPU; Nccl, a GPU each), the model's stream synchronised
//! before each, and sums its ranks' shared gradients there (SharedGradients); context parallelism runs ring or Ulysses
//! attention there (their blocks, exchanges, reorders and merges on device memory), and a mixture of experts its
//! dispatch and combine (the host routes: layers::RoutedExperts). Every layout a host model takes, a device's does.
template <class Dev, class Cfg>
struct DeviceRules {
  static_assert(std::is_same_v<Dev, Host> || std::is_same_v<Dev, Cuda>, "loom: a model's device is Host or Cuda");
  static constexpr bool ok = true;
};

namespace detail {
template <class Cfg>
struct ModelLayoutOf {
  static constexpr int tp = Cfg::template size<Axis::tp>, cp = Cfg::template size<Axis::cp>;
  using TpAxis = std::conditional_t<Cfg::sequence_parallel, TP<tp, SequenceParallel>, TP<tp>>;
  using CpAxis = std::conditional_t<Cfg::cp_algorithm == CpAlgorithm::ulysses, CP<cp, Ulysses>, CP<cp, Ring>>;
  using type = std::conditional_t<cp == 1, std::conditional_t<tp == 1, Parallel<>, Parallel<TpAxis>>,
                                  std::conditional_t<tp == 1, Parallel<CpAxis>, Parallel<TpAxis, CpAxis>>>;
};
}  // namespace detail

//! The part of a layout a model's type depends on: its tensor-parallel degree and sequence parallelism, its
//! context-parallel degree and algorithm (CP<n> is CP<n, Ring>). Gpt<S, T, ModelLayout<Cfg>> is one type for every
//! layout that differs from Cfg only in its other axes. The expert-parallel degree is not part of it: a model's
//! experts split over the expert-parallel communicator it is given (EP<n>'s group), so that dp4 and dp4.ep4 share
//! one model's code; LayoutRules checks a shape against the whole layout.
template <class Cfg>
using ModelLayout = typename detail::ModelLayoutOf<Cfg>::type;

}  // namespace loom::models

// The tensor-parallel group as layers see it, and the conjugate operators at the edges of a tensor-parallel region.
//
// A region (the column-parallel then row-parallel pair of an attention or MLP block) starts with an operator that
// is the identity in forward and an all-reduce in backward, and ends with its conjugate: an all-reduce in forward,
// the identity in backward. With sequence parallelism the activations outside the region are split along the
// tokens, and the pair becomes an all-gather entering the region (a reduce-scatter in backward) and a
// reduce-scatter leaving it (an all-gather in backward): the same bytes, without the redundant work on replicas.
#pragma once

#include <loom/comm/types.hpp>
#include <loom/core/error.hpp>
#include <loom/kernels/ops.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

namespace loom::layers {

//! Where a collective was issued, for counting: inside the blocks' forward or backward, in the gradient
//! synchronisation of replicated parameters, or elsewhere (embedding, loss).
enum class Phase : std::uint8_t { other, forward, backward, grads };

//! Collectives issued in one phase, and their volume: the elements one rank sends under the bandwidth-optimal
//! (ring) algorithm: 2n(t-1)/t for an all-reduce of n, n(t-1)/t for an all-gather or reduce-scatter whose full
//! tensor holds n.
struct CollectiveCounts {
  std::int64_t all_reduce = 0, all_gather = 0, reduce_scatter = 0;
  double volume = 0;
};

//! The tensor-parallel degree and sequence parallelism that layers are compiled for: the tp axis of the layout
//! type, TP<Size> or TP<Size, SequenceParallel>. Every size and branch that depends on them is a constant.
template <int Size, bool SequenceParallel = false>
struct TensorParallel {
  static_assert(Size >= 1, "loom: a tensor-parallel group has at least one rank");
  static constexpr int size = Size;
  static constexpr bool sequence_parallel = SequenceParallel;
};
//! Whether Tp is a TensorParallel<...>.
template <class Tp>
inline constexpr bool is_tensor_parallel_v = false;
template <int Size, bool SequenceParallel>
inline constexpr bool is_tensor_parallel_v<TensorParallel<Size, SequenceParallel>> = true;

namespace detail {

//! The collectives a tensor-parallel group issues, on whichever communicator it was given, ordered on `stream`
//! (Op::stream; empty: on the host).
template <class T>
struct TpLink {
  using acc = loom::acc_t<T>;
  std::optional<void*> stream;
  virtual ~TpLink() = default;
  virtual void all_reduce(std::span<T> x) = 0;
  virtual void all_reduce_acc(std::span<acc> x, comm::Reduce op) = 0;
  virtual void all_gather(std::span<const T> in, std::span<T> out) = 0;
  virtual void all_gather_acc(std::span<const acc> in, std::span<acc> out) = 0;
  virtual void reduce_scatter(std::span<const T> in, std::span<T> out) = 0;
};
template <class T, class C>
struct TpLinkOf final : TpLink<T> {
  using acc = loom::acc_t<T>;
  explicit TpLinkOf(C& c) : c(c) {}
  void all_reduce(std::span<T> x) override {
    const auto on = c.on_stream(this->stream);
    c.all_reduce(x, comm::Reduce::sum);
  }
  void all_reduce_acc(std::span<acc> x, comm::Reduce op) override {
    const auto on = c.on_stream(this->stream);
    c.all_reduce(x, op);
  }
  void all_gather(std::span<const T> in, std::span<T> out) override {
    const auto on = c.on_stream(this->stream);
    c.all_gather(in, out);
  }
  void all_gather_acc(std::span<const acc> in, std::span<acc> out) override {
    const auto on = c.on_stream(this->stream);
    c.all_gather(in, out);
  }
  void reduce_scatter(std::span<const T> in, std::span<T> out) override {
    const auto on = c.on_stream(this->stream);
    c.reduce_scatter(in, out, comm::Reduce::sum);
  }
  C& c;
};

}  // namespace detail

//! The tensor-parallel group of Tp::size ranks as layers see it, on any communicator, counting what it issues. A
//! group of one (Tp::size == 1) needs no communicator, and every operator is the identity at compile time.
template <class T, class Tp>
class TpGroup {
  static_assert(is_tensor_parallel_v<Tp>, "loom: TpGroup<T, Tp> takes a layers::TensorParallel<size, sp>");

 public:
  using acc = loom::acc_t<T>;
  using spec = Tp;
  static constexpr int size() { return Tp::size; }

  TpGroup()
    requires(Tp::size == 1)
  = default;
  //! The group of communicator c, which must have Tp::size ranks.
  template <class C>
  explicit TpGroup(C& c) : rank_(c.rank()), link_(std::make_unique<detail::TpLinkOf<T, C>>(c)) {
    LOOM_CHECK(c.size() == Tp::size, "the tensor-parallel communicator has ", c.size(), " ranks but the layout has tp = ",
               Tp::size);
  }

  int rank() const { return rank_; }

  //! On a device: the collectives the group issues are ordered on the model's CUDA stream `stream` (a
  //! cudaStream_t; null is the legacy default stream): each reads what the kernels queued there before it wrote,
  //! and the kernels queued after it read its result (comm::Op::stream). Nccl orders them by events without the
  //! host waiting; Local and Mpi synchronise the stream first.
  void order_on(void* stream) {
    if (link_) link_->stream = stream;
  }

  //! x = sum over the group of x.
  void all_reduce(T* x, std::size_t n) {
    if constexpr (Tp::size > 1) {
      note(n).all_reduce++;
      link_->all_reduce({x, n});
    }
  }
  //! In the arithmetic type (loss partials), with any reduction.
  void all_reduce_acc(acc* x, std::size_t n, comm::Reduce op) {
    if constexpr (Tp::size > 1) {
      note(n).all_reduce++;
      link_->all_reduce_acc({x, n}, op);
    }
  }
  //! out (size() * n) = the n elements of every rank, in rank order.
  void all_gather(const T* in, T* out, std::size_t n) {
    gather(in, out, n, [&] { link_->all_gather({in, n}, {out, n * Tp::size}); });
  }
  //! all_gather in the arithmetic type (optimizer state).
  void all_gather_acc(const acc* in, acc* out, std::size_t n) {
    gather(in, out, n, [&] { link_->all_gather_acc({in, n}, {out, n * Tp::size}); });
  }
  //! out (n) = block rank() of the sum over the group of in (size() * n).
  void reduce_scatter(const T* in, T* out, std::size_t n) {
    if constexpr (Tp::size == 1) {
      copy(in, out, n);
    } else {
      note(n * Tp::size, 1).reduce_scatter++;
      link_->reduce_scatter({in, n * Tp::size}, {out, n});
    }
  }

  //! While it lives, the collectives this group issues are counted under one phase; the phase before comes back
  //! when it ends (guards nest).
  class PhaseScope {
   public:
    PhaseScope(TpGroup& g, Phase p) : g_(g), before_(g.phase_) { g.phase_ = p; }
    ~PhaseScope() { g_.phase_ = before_; }
    PhaseScope(const PhaseScope&) = delete;
    PhaseScope& operator=(const PhaseScope&) = delete;

   private:
    TpGroup& g_;
    Phase before_;
  };
  //! Counts what is issued under phase p until the returned guard ends.
  [[nodiscard]] PhaseScope counting(Phase p) { return PhaseScope(*this, p); }
  Phase phase() const { return phase_; }
  const CollectiveCounts& counts(Phase p) const { return counts_[static_cast<int>(p)]; }
  void reset_counts() { counts_ = {}; }

 private:
  template <class U, class Issue>
  void gather(const U* in, U* out, std::size_t n, Issue&& issue) {
    if constexpr (Tp::size == 1) {
      copy(in, out, n);
    } else {
      note(n * Tp::size, 1).all_gather++;
      issue();
    }
  }
  //! A group of one's gather or scatter: host memory (the layers' regions copy a device's through their ops).
  template <class U>
  static void copy(const U* in, U* out, std::size_t n) {
    if (in != out) std::copy_n(in, n, out);
  }
  //! Records a collective over a tensor of n elements; an all-reduce sends its data twice.
  CollectiveCounts& note(std::size_t n, int passes = 2) {
    auto& c = counts_[static_cast<int>(phase_)];
    c.volume += passes * static_cast<double>(n) * (Tp::size - 1) / Tp::size;
    return c;
  }

  int rank_ = 0;
  std::unique_ptr<detail::TpLink<T>> link_;
  Phase phase_ = Phase::other;  // the phase counts are recorded under (PhaseScope)
  std::array<CollectiveCounts, 4> counts_{};
};

//! The edges of a tensor-parallel region over N tokens of C features. Outside the region a rank holds rows()
//! tokens: all N, or with sequence parallelism (Tp::sequence_parallel) its N / t consecutive ones, starting at
//! first_row(). The layers of the region compute on Dev through ops; on a device the group's collectives take device
//! memory, ordered on the model's stream (TpGroup::order_on).
template <class T, class Dev = Host, class Tp = TensorParallel<1>>
struct Region {
  static constexpr bool sequence_parallel = Tp::sequence_parallel;
  TpGroup<T, Tp>* tp;
  int N, C;
  kernels::Ops<Dev> ops{};

  int rows() const { return sequence_parallel ? N / Tp::size : N; }
  int first_row() const { return sequence_parallel ? tp->rank() * rows() : 0; }

  //! out (size() * n) = the n elements of every rank, in rank order: a group of one's is a copy on Dev's memory
  //! (TpGroup's copies are the host's).
  void all_gather(const T* in, T* out, std::size_t n) const {
    if constexpr (Tp::size > 1) tp->all_gather(in, out, n);
    else ops.copy(in, out, n);
  }
  //! Entering, forward: full (N x C) from this rank's rows of x. Without sequence parallelism full may be x.
  void enter_forward(const T* x, T* full) const {
    if constexpr (sequence_parallel) all_gather(x, full, std::size_t(rows()) * C);
    else ops.copy(x, full, std::size_t(N) * C);
  }
  //! Entering, backward: dx (this rank's rows) from the partial gradients (N x C) of every rank; may be in place.
  void enter_backward(T* dfull, T* dx) const {
    if constexpr (sequence_parallel && Tp::size > 1) {
      tp->reduce_scatter(dfull, dx, std::size_t(rows()) * C);
    } else {
      tp->all_reduce(dfull, std::size_t(N) * C);
      ops.copy(dfull, dx, std::size_t(N) * C);
    }
  }
  //! Leaving, forward: this rank's rows of the sum of every rank's partial output (N x C); may be in place.
  void exit_forward(T* partial, T* y) const { enter_backward(partial, y); }
  //! Leaving, backward: the gradient of the full output (N x C) from this rank's rows of it.
  void exit_backward(const T* dy, T* dfull) const { enter_forward(dy, dfull); }
};

}  // namespace loom::layers

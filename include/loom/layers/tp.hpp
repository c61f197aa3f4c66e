// The tensor-parallel group as layers see it, and the conjugate operators at the edges of a tensor-parallel region.
//
// A region (the column-parallel then row-parallel pair of an attention or MLP block) starts with an operator that
// is the identity in forward and an all-reduce in backward, and ends with its conjugate: an all-reduce in forward,
// the identity in backward. With sequence parallelism the activations outside the region are split along the
// tokens, and the pair becomes an all-gather entering the region (a reduce-scatter in backward) and a
// reduce-scatter leaving it (an all-gather in backward): the same bytes, without the redundant work on replicas.
#pragma once

#include <loom/comm/types.hpp>
#include <loom/kernels/ops.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
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

//! A tensor-parallel group of any communicator, behind one interface, counting what it issues. Default-constructed
//! it is a group of one rank, where every operator is the identity.
template <class T>
class TpGroup {
 public:
  using acc = loom::acc_t<T>;

  TpGroup() = default;
  template <class C>
  explicit TpGroup(C& c) : size_(c.size()), rank_(c.rank()) {
    all_reduce_ = [&c](std::span<T> x) { c.all_reduce(x, comm::Reduce::sum); };
    all_reduce_acc_ = [&c](std::span<acc> x, comm::Reduce op) { c.all_reduce(x, op); };
    all_gather_ = [&c](std::span<const T> in, std::span<T> out) { c.all_gather(in, out); };
    all_gather_acc_ = [&c](std::span<const acc> in, std::span<acc> out) { c.all_gather(in, out); };
    reduce_scatter_ = [&c](std::span<const T> in, std::span<T> out) { c.reduce_scatter(in, out, comm::Reduce::sum); };
  }

  int size() const { return size_; }
  int rank() const { return rank_; }

  //! x = sum over the group of x.
  void all_reduce(T* x, std::size_t n) {
    if (size_ == 1) return;
    note(n).all_reduce++;
    all_reduce_({x, n});
  }
  //! In the arithmetic type (loss partials), with any reduction.
  void all_reduce_acc(acc* x, std::size_t n, comm::Reduce op) {
    if (size_ == 1) return;
    note(n).all_reduce++;
    all_reduce_acc_({x, n}, op);
  }
  //! out (size() * n) = the n elements of every rank, in rank order.
  void all_gather(const T* in, T* out, std::size_t n) {
    if (size_ == 1) return copy(in, out, n);
    note(n * size_, 1).all_gather++;
    all_gather_({in, n}, {out, n * size_});
  }
  //! all_gather in the arithmetic type (optimizer state).
  void all_gather_acc(const acc* in, acc* out, std::size_t n) {
    if (size_ == 1) return copy(in, out, n);
    note(n * size_, 1).all_gather++;
    all_gather_acc_({in, n}, {out, n * size_});
  }
  //! out (n) = block rank() of the sum over the group of in (size() * n).
  void reduce_scatter(const T* in, T* out, std::size_t n) {
    if (size_ == 1) return copy(in, out, n);
    note(n * size_, 1).reduce_scatter++;
    reduce_scatter_({in, n * size_}, {out, n});
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
  template <class U>
  static void copy(const U* in, U* out, std::size_t n) {
    if (in != out) std::copy_n(in, n, out);
  }
  //! Records a collective over a tensor of n elements; an all-reduce sends its data twice.
  CollectiveCounts& note(std::size_t n, int passes = 2) {
    auto& c = counts_[static_cast<int>(phase_)];
    c.volume += passes * static_cast<double>(n) * (size_ - 1) / size_;
    return c;
  }

  int size_ = 1, rank_ = 0;
  Phase phase_ = Phase::other;  // the phase counts are recorded under (PhaseScope)
  std::function<void(std::span<T>)> all_reduce_;
  std::function<void(std::span<acc>, comm::Reduce)> all_reduce_acc_;
  std::function<void(std::span<const T>, std::span<T>)> all_gather_, reduce_scatter_;
  std::function<void(std::span<const acc>, std::span<acc>)> all_gather_acc_;
  std::array<CollectiveCounts, 4> counts_{};
};

//! The edges of a tensor-parallel region over N tokens of C features. Outside the region a rank holds rows()
//! tokens: all N, or with sequence parallelism its N / t consecutive ones, starting at first_row(). The layers of
//! the region compute on Dev through ops; on a device the model allows only a group of one, which issues no
//! collective (models::DeviceRules).
template <class T, class Dev = Host>
struct Region {
  TpGroup<T>* tp;
  bool sequence_parallel;
  int N, C;
  kernels::Ops<Dev> ops{};

  int rows() const { return sequence_parallel ? N / tp->size() : N; }
  int first_row() const { return sequence_parallel ? tp->rank() * rows() : 0; }

  //! Entering, forward: full (N x C) from this rank's rows of x. Without sequence parallelism full may be x.
  void enter_forward(const T* x, T* full) const {
    if (sequence_parallel) tp->all_gather(x, full, std::size_t(rows()) * C);
    else ops.copy(x, full, std::size_t(N) * C);
  }
  //! Entering, backward: dx (this rank's rows) from the partial gradients (N x C) of every rank; may be in place.
  void enter_backward(T* dfull, T* dx) const {
    if (sequence_parallel) return tp->reduce_scatter(dfull, dx, std::size_t(rows()) * C);
    tp->all_reduce(dfull, std::size_t(N) * C);
    ops.copy(dfull, dx, std::size_t(N) * C);
  }
  //! Leaving, forward: this rank's rows of the sum of every rank's partial output (N x C); may be in place.
  void exit_forward(T* partial, T* y) const { enter_backward(partial, y); }
  //! Leaving, backward: the gradient of the full output (N x C) from this rank's rows of it.
  void exit_backward(const T* dy, T* dfull) const { enter_forward(dy, dfull); }
};

}  // namespace loom::layers

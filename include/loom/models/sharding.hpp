// A model's parameters as the tensor-parallel group holds them: gathered into the single-rank layout and scattered
// back (for checkpoints and tests), and the gradients that several ranks of the group hold, summed over it once
// per step.
#pragma once

#include <loom/kernels/ops.hpp>
#include <loom/layers/param.hpp>
#include <loom/layers/tp.hpp>
#include <loom/tensor/tensor.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace loom::models {

//! The whole model's buffer in the single-rank layout (`global`, `total` elements) from this rank's part `local`
//! (laid out by `specs`, in host memory) and its peers': an all-gather over tp, whose every rank receives the
//! result. A part of the model fills only its own parameters (the others are 0). U is the parameters' type or the
//! arithmetic type (an optimizer's moments).
template <class U, class T, class Tp>
std::vector<U> gather_params(layers::TpGroup<T, Tp>& tp, const std::vector<layers::ParamSpec>& specs,
                             const std::vector<layers::ParamSpec>& global, std::int64_t total, const U* local) {
  static_assert(std::is_same_v<U, T> || std::is_same_v<U, acc_t<T>>, "loom: gather() takes parameters or moments");
  std::vector<U> out(static_cast<std::size_t>(total));
  if (tp.size() == 1 && specs.size() == global.size()) {
    std::copy_n(local, out.size(), out.data());
    return out;
  }
  const int t = tp.size();
  std::vector<std::int64_t> at(specs.size() + 1, 0);
  for (std::size_t p = 0; p < specs.size(); ++p) {
    std::int64_t width = 0;
    for (int r = 0; r < t; ++r) width = std::max(width, specs[p].layout.for_rank(r).local_numel());
    at[p + 1] = at[p] + width;
  }
  std::vector<U> send(static_cast<std::size_t>(at.back()), U(0)), recv(send.size() * t);
  for (std::size_t p = 0; p < specs.size(); ++p)
    std::copy_n(local + specs[p].offset, numel_of(specs[p].shape), send.data() + at[p]);
  {
    auto counted = tp.counting(layers::Phase::other);
    if constexpr (std::is_same_v<U, T>) tp.all_gather(send.data(), recv.data(), send.size());
    else tp.all_gather_acc(send.data(), recv.data(), send.size());
  }
  for (std::size_t p = 0; p < specs.size(); ++p)
    for (int r = 0; r < t; ++r)
      specs[p].layout.for_rank(r).place(recv.data() + r * send.size() + at[p],
                                        out.data() + global[specs[p].index].offset);
  return out;
}

//! This rank's part (laid out by `specs`) of a buffer in the single-rank layout (`global`), both in host memory;
//! no communication.
template <class U>
void scatter_params(const std::vector<layers::ParamSpec>& specs, const std::vector<layers::ParamSpec>& global,
                    const U* global_buffer, U* local) {
  for (std::size_t p = 0; p < specs.size(); ++p)
    specs[p].layout.scatter(global_buffer + global[specs[p].index].offset, local + specs[p].offset);
}

//! The gradients that several ranks of a tensor-parallel group Tp hold, of the parameters of one part: with sequence
//! parallelism the replicated ones (each rank saw its own tokens), and the key/value heads that ranks share when
//! kv_heads < TP. A backward keeps them (keep) before it adds to them, and sums what it added over the group once
//! it is done (sum), in one all-reduce for all: gradients accumulated over micro-batches are summed once. The
//! gradients are in Dev's memory, and so is what it packs them into (on the host a std::vector, which the memory
//! ledger does not count; on a device a tensor, moved by the model's ops).
template <class T, class Tp, class Dev = Host>
class SharedGradients {
  static constexpr bool on_host = kernels::is_host_v<Dev>;
  using Buf = std::conditional_t<on_host, std::vector<T>, Tensor<T, Dev>>;

 public:
  explicit SharedGradients(const std::vector<layers::ParamSpec>& specs) : specs_(specs) {}

  //! Remembers the shared gradients of parameters [first, last) before a backward adds to them.
  void keep(const T* grads, std::size_t first, std::size_t last, const kernels::Ops<Dev>& ops) {
    pack(grads, first, last, before_, ops);
  }

  //! Sums over tp what the backward added to the shared gradients of [first, last) since keep(first, last).
  void sum(layers::TpGroup<T, Tp>& tp, T* grads, std::size_t first, std::size_t last, const kernels::Ops<Dev>& ops) {
    if constexpr (Tp::size == 1) return;
    Buf buf;
    if (!pack(grads, first, last, buf, ops)) return;
    const std::size_t n = size(buf);
    LOOM_CHECK(n == size(before_), "the shared gradients were summed without being kept");
    if constexpr (on_host) {
      for (std::size_t i = 0; i < n; ++i) buf[i] -= before_[i];
    } else {  // buf += -before, before left as it was
      ops.scale(before_.data(), n, -1), ops.accumulate(before_.data(), buf.data(), n), ops.scale(before_.data(), n, -1);
    }
    {
      auto counted = tp.counting(layers::Phase::grads);
      tp.all_reduce(buf.data(), n);
    }
    if constexpr (on_host) {
      for (std::size_t i = 0; i < n; ++i) buf[i] += before_[i];
    } else {
      ops.accumulate(before_.data(), buf.data(), n);
    }
    each(grads, first, last, buf, [&](T* g, T* b, std::int64_t len) { copy(ops, b, g, len); });
  }

 private:
  bool shared(const layers::ParamSpec& s) const {
    return s.layout.shared_numel() > 0 && (!s.replicated || Tp::sequence_parallel);
  }
  static std::size_t size(const Buf& b) {
    if constexpr (on_host) return b.size();
    else return b.defined() ? static_cast<std::size_t>(b.numel()) : 0;
  }
  static void copy(const kernels::Ops<Dev>& ops, const T* from, T* to, std::int64_t len) {
    if constexpr (on_host) std::copy_n(from, len, to);
    else ops.copy(from, to, static_cast<std::size_t>(len));
  }
  //! The shared gradients of [first, last) in one buffer laid out alike on every rank (zero where this rank holds
  //! nothing); false when there are none.
  bool pack(const T* grads, std::size_t first, std::size_t last, Buf& buf, const kernels::Ops<Dev>& ops) const {
    std::int64_t n = 0;
    for (std::size_t p = first; p < last; ++p)
      if (shared(specs_[p])) n += specs_[p].layout.shared_numel();
    if (n == 0) {
      buf = Buf();
      return false;
    }
    if constexpr (on_host) {
      buf.assign(static_cast<std::size_t>(n), T(0));
    } else {
      buf = Buf({n});
      ops.fill(buf.data(), static_cast<std::size_t>(n), T(0));
    }
    each(const_cast<T*>(grads), first, last, buf, [&](T* g, T* b, std::int64_t len) { copy(ops, g, b, len); });
    return true;
  }
  //! f(gradient piece, its place in the packed buffer, length) over the shared pieces of [first, last).
  template <class F>
  void each(T* grads, std::size_t first, std::size_t last, Buf& buf, F&& f) const {
    std::int64_t at = 0;
    for (std::size_t p = first; p < last; ++p) {
      const auto& s = specs_[p];
      if (!shared(s)) continue;
      s.layout.for_each_shared_piece([&](std::int64_t lo, std::int64_t sh, std::int64_t len) {
        f(grads + s.offset + lo, buf.data() + at + sh, len);
      });
      at += s.layout.shared_numel();
    }
  }

  const std::vector<layers::ParamSpec>& specs_;
  Buf before_;
};

}  // namespace loom::models

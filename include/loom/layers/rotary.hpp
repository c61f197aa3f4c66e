// Rotary position embedding (RoPE) as a part of attention: the cos and sin tables of every position and plane,
// made once from the planes' frequencies, and the rotation of a buffer's query and key heads by each row's
// position (its backward: the rotation by the opposite angle). Positions are global: with context parallelism a
// rank's rows are its zigzag chunks of each sequence, rotated by the positions they have in the whole sequence.
#pragma once

#include <loom/kernels/ops.hpp>
#include <loom/tensor/tensor.hpp>

#include <cmath>
#include <vector>

namespace loom::layers {

template <class T, class Dev = Host>
class Rotary {
 public:
  using acc = loom::acc_t<T>;

  //! Tables for positions 0 .. positions - 1 of heads of head_dim elements, plane j turning by inv_freq[j] per
  //! position (head_dim / 2 frequencies); the angles are computed in double.
  Rotary(int head_dim, int positions, const std::vector<double>& inv_freq, kernels::Ops<Dev> ops = {})
      : hd_(head_dim), ops_(ops) {
    LOOM_CHECK(head_dim % 2 == 0 && static_cast<int>(inv_freq.size()) == head_dim / 2, "rotary positions take ",
               head_dim / 2, " frequencies for heads of ", head_dim, ", got ", inv_freq.size());
    const std::size_t n = std::size_t(positions) * (head_dim / 2);
    std::vector<acc> c(n), s(n);
    for (int t = 0; t < positions; ++t)
      for (int j = 0; j < head_dim / 2; ++j) {
        const double angle = static_cast<double>(t) * inv_freq[std::size_t(j)];
        c[std::size_t(t) * (head_dim / 2) + j] = static_cast<acc>(std::cos(angle));
        s[std::size_t(t) * (head_dim / 2) + j] = static_cast<acc>(std::sin(angle));
      }
    cos_ = Tensor<acc, Dev>({static_cast<std::int64_t>(n)});
    sin_ = Tensor<acc, Dev>({static_cast<std::int64_t>(n)});
    ops_.from_host(c.data(), cos_.data(), n);
    ops_.from_host(s.data(), sin_.data(), n);
  }

  int head_dim() const { return hd_; }
  //! Rotates `heads` consecutive heads at the start of each of n rows (row i at x + i ld) by the angles of
  //! positions t0 .. t0 + n - 1; inverse: backward.
  void rotate(T* x, int n, int ld, int heads, int t0, bool inverse) const {
    ops_.rope_rotate(x, cos_.data(), sin_.data(), n, ld, heads, hd_, t0, inverse);
  }

 private:
  int hd_;
  kernels::Ops<Dev> ops_;
  Tensor<acc, Dev> cos_, sin_;
};

}  // namespace loom::layers

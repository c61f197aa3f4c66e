// Rotary position embedding (RoPE) in the rotate-half form of Llama and Hugging Face: each head's first and second
// halves are the two coordinates of hd/2 planes, each rotated by its position's angle. Include
// <loom/kernels/cpu/ops.hpp> instead.
#pragma once

#include <loom/kernels/cpu/detail/common.hpp>

namespace loom::kernels::cpu {

template <class T>
void rope_rotate(T* x, const acc_t<T>* cos, const acc_t<T>* sin, int n, int ld, int heads, int hd, int t0,
                 bool inverse) {
  detail::check_type<T>();
  using A = acc_t<T>;
  const int h = hd / 2;
  const A sign = inverse ? A(-1) : A(1);
  for (int i = 0; i < n; ++i) {
    const A* c = cos + std::ptrdiff_t(t0 + i) * h;
    const A* s = sin + std::ptrdiff_t(t0 + i) * h;
    for (int head = 0; head < heads; ++head) {
      T* v = x + std::ptrdiff_t(i) * ld + std::ptrdiff_t(head) * hd;
      for (int j = 0; j < h; ++j) {
        const A a = static_cast<A>(v[j]), b = static_cast<A>(v[j + h]), sj = sign * s[j];
        v[j] = static_cast<T>(a * c[j] - b * sj);
        v[j + h] = static_cast<T>(b * c[j] + a * sj);
      }
    }
  }
}

}  // namespace loom::kernels::cpu

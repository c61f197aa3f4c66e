// Element-wise kernels: bias, sums, GELU, SwiGLU. Eigen array expressions, so that float and double vectorise; bf16/fp16
// go through float chunks. Include <loom/kernels/cpu/ops.hpp> instead.
#pragma once

#include <loom/kernels/cpu/detail/common.hpp>

#include <cmath>

namespace loom::kernels::cpu::detail {

// With u = s (x + c x^3) and E = exp(2u): 0.5 (1 + tanh u) = E / (E + 1) and 1 - tanh^2 u = 4 E / (E + 1)^2.
// These forms have no cancellation in either tail (1 - tanh u near u >> 0, 1 + tanh u near u << 0), and exp is
// vectorised to about 1 ulp where Eigen's float tanh is off by up to 4e-7.
template <class A>
struct Gelu {
  static constexpr A s = A(0.7978845608028654);  // sqrt(2 / pi)
  static constexpr A c = A(0.044715);
  static constexpr A two_u_max = A(80);  // tanh(40) is 1 in double; exp(80) is finite in float

  template <class X>
  static auto exp_2u(const X& x) {
    return (A(2) * s * (x + c * x.cube())).min(two_u_max).max(-two_u_max).exp();
  }
};

template <class A>
void gelu_forward_acc(const A* x, A* out, std::size_t n) {
  constexpr std::size_t chunk = 256;
  // Aligned to the widest packet: Eigen would otherwise compute the first elements up to an aligned address with
  // the scalar exp, which rounds differently from the packet one, so that results would depend on the stack.
  alignas(64) A e_buf[chunk];
  for (std::size_t i0 = 0; i0 < n; i0 += chunk) {
    const std::size_t m = std::min(chunk, n - i0);
    const auto X = arr(x + i0, m);
    auto E = arr(e_buf, m);
    E = Gelu<A>::exp_2u(X);
    arr(out + i0, m) = X * (E / (E + A(1)));
  }
}

// GELU'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) s (1 + 3 c x^2) = E d + 2 s x (1 + 3 c x^2) E d^2, d = 1/(E+1).
template <class A>
void gelu_backward_acc(const A* x, const A* dout, A* dx, std::size_t n) {
  using G = Gelu<A>;
  constexpr std::size_t chunk = 256;
  alignas(64) A e_buf[chunk], d_buf[chunk];  // aligned, as in gelu_forward_acc
  for (std::size_t i0 = 0; i0 < n; i0 += chunk) {
    const std::size_t m = std::min(chunk, n - i0);
    const auto X = arr(x + i0, m);
    auto E = arr(e_buf, m);
    auto Dn = arr(d_buf, m);
    E = G::exp_2u(X);
    Dn = A(1) / (E + A(1));
    arr(dx + i0, m) =
        arr(dout + i0, m) * (E * Dn * (A(1) + A(2) * G::s * X * (A(1) + A(3) * G::c * X.square()) * Dn));
  }
}

}  // namespace loom::kernels::cpu::detail

namespace loom::kernels::cpu {

template <class T>
void bias_add(const T* x, const T* bias, T* out, int R, int C) {
  detail::check_type<T>();
  std::vector<acc_t<T>> bbuf;
  const auto b = detail::arr(detail::load(bias, std::size_t(C), bbuf), std::size_t(C));
  for (int r = 0; r < R; ++r) {
    const std::ptrdiff_t o = std::ptrdiff_t(r) * C;
    detail::map_elements<T, 1>({x + o}, out + o, std::size_t(C), [&](const auto& in, auto* res, std::size_t m,
                                                                       std::size_t off) {
      detail::arr(res, m) = detail::arr(in[0], m) + b.segment(Eigen::Index(off), Eigen::Index(m));
    });
  }
}

template <class T>
void bias_backward(const T* dout, T* dbias, int R, int C) {
  detail::check_type<T>();
  using A = acc_t<T>;
  const std::size_t n = std::size_t(C);
  std::vector<A> sum(n, A(0)), row;
  auto s = detail::arr(sum.data(), n);
  for (int r = 0; r < R; ++r) s += detail::arr(detail::load(dout + std::ptrdiff_t(r) * C, n, row), n);
  for (std::size_t c = 0; c < n; ++c) dbias[c] = static_cast<T>(static_cast<A>(dbias[c]) + sum[c]);
}

template <class T>
void add(const T* a, const T* b, T* out, std::size_t n) {
  detail::check_type<T>();
  detail::map_elements<T, 2>({a, b}, out, n, [](const auto& in, auto* res, std::size_t m, std::size_t) {
    detail::arr(res, m) = detail::arr(in[0], m) + detail::arr(in[1], m);
  });
}

template <class T>
void accumulate(const T* x, T* y, std::size_t n) {
  add<T>(x, y, y, n);
}

template <class T>
void gelu_forward(const T* x, T* out, std::size_t n) {
  detail::check_type<T>();
  detail::map_elements<T, 1>({x}, out, n, [](const auto& in, auto* res, std::size_t m, std::size_t) {
    detail::gelu_forward_acc(in[0], res, m);
  });
}

template <class T>
void gelu_backward(const T* x, const T* dout, T* dx, std::size_t n) {
  detail::check_type<T>();
  detail::map_elements<T, 2>({x, dout}, dx, n, [](const auto& in, auto* res, std::size_t m, std::size_t) {
    detail::gelu_backward_acc(in[0], in[1], res, m);
  });
}

// SwiGLU on rows [gate | up] of 2F: out = silu(gate) up, silu(g) = g sigmoid(g); computed row by row in acc_t<T>.
template <class T>
void swiglu_forward(const T* h, T* out, int R, int F) {
  detail::check_type<T>();
  using A = acc_t<T>;
  for (int r = 0; r < R; ++r) {
    const T* gate = h + std::ptrdiff_t(r) * 2 * F;
    const T* up = gate + F;
    T* o = out + std::ptrdiff_t(r) * F;
    for (int c = 0; c < F; ++c) {
      const A g = static_cast<A>(gate[c]);
      o[c] = static_cast<T>(g / (A(1) + std::exp(-g)) * static_cast<A>(up[c]));
    }
  }
}

// d gate = dout up s (1 + g (1 - s)), d up = dout g s, with s = sigmoid(g).
template <class T>
void swiglu_backward(const T* h, const T* dout, T* dh, int R, int F) {
  detail::check_type<T>();
  using A = acc_t<T>;
  for (int r = 0; r < R; ++r) {
    const T* gate = h + std::ptrdiff_t(r) * 2 * F;
    const T* up = gate + F;
    const T* d = dout + std::ptrdiff_t(r) * F;
    T* dg = dh + std::ptrdiff_t(r) * 2 * F;
    T* du = dg + F;
    for (int c = 0; c < F; ++c) {
      const A g = static_cast<A>(gate[c]), u = static_cast<A>(up[c]), dy = static_cast<A>(d[c]);
      const A s = A(1) / (A(1) + std::exp(-g));
      dg[c] = static_cast<T>(dy * u * s * (A(1) + g * (A(1) - s)));
      du[c] = static_cast<T>(dy * g * s);
    }
  }
}

}  // namespace loom::kernels::cpu

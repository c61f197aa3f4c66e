// Rotary position embedding on the device, in place: one thread per rotated plane (row, head, pair), the tables of
// cos and sin in acc_t<T> on the device.
#pragma once

#include <loom/kernels/cuda/device.cuh>

namespace loom::kernels::cuda {

namespace detail {

template <class T>
__global__ void rope_rotate_kernel(T* x, const acc_t<T>* cos, const acc_t<T>* sin, int n, int ld, int heads, int hd,
                                   int t0, acc_t<T> sign) {
  using A = acc_t<T>;
  const int h = hd / 2;
  const std::size_t planes = std::size_t(n) * heads * h;
  for (std::size_t p = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; p < planes;
       p += std::size_t(gridDim.x) * blockDim.x) {
    const int j = static_cast<int>(p % h), head = static_cast<int>(p / h % heads), i = static_cast<int>(p / h / heads);
    T* v = x + std::size_t(i) * ld + std::size_t(head) * hd;
    const A c = cos[std::size_t(t0 + i) * h + j], s = sign * sin[std::size_t(t0 + i) * h + j];
    const A a = widen(v[j]), b = widen(v[j + h]);
    v[j] = narrow<T>(a * c - b * s);
    v[j + h] = narrow<T>(b * c + a * s);
  }
}

}  // namespace detail

//! Rotates in place `heads` heads of hd elements in each of n rows (row i at x + i ld) by the angles of position
//! t0 + i, as kernels::cpu::rope_rotate; cos and sin are [positions, hd/2] tables in device memory.
template <Floating T>
void rope_rotate(T* x, const acc_t<T>* cos, const acc_t<T>* sin, int n, int ld, int heads, int hd, int t0,
                 bool inverse, cudaStream_t stream) {
  const std::size_t planes = std::size_t(n) * heads * (hd / 2);
  if (planes == 0) return;
  const int blocks = static_cast<int>(std::min<std::size_t>((planes + 255) / 256, 65535));
  detail::rope_rotate_kernel<device_t<T>><<<blocks, 256, 0, stream>>>(detail::dev(x), cos, sin, n, ld, heads, hd,
                                                                      t0, inverse ? acc_t<T>(-1) : acc_t<T>(1));
  detail::check_launch("rope_rotate");
}

}  // namespace loom::kernels::cuda

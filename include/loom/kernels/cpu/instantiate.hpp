// The CPU kernels' explicit instantiations for every storage type (float, double, bf16, fp16), as one list: with
// LOOM_EXTERN_KERNELS defined, <loom/kernels/cpu/ops.hpp> declares them `extern`, so that a translation unit that
// uses the kernels does not instantiate them (and Eigen's products) again; they are instantiated once, by
// src/cpu_kernels_*.cpp (CMake: link loom::cpu_kernels).
#pragma once

#include <cstddef>
#include <cstdint>

// LOOM_CPU_KERNELS_FOR(prefix, T): every kernel of <loom/kernels/cpu/ops.hpp> for storage type T, each declaration
// preceded by `prefix template` (prefix: extern, or nothing for the definitions).
#define LOOM_CPU_KERNELS_FOR(prefix, T)                                                                               \
  prefix template void matmul<T>(const T*, const T*, T*, int, int, int, bool, bool, float, float, int,              \
                                 std::ptrdiff_t, std::ptrdiff_t, std::ptrdiff_t);                                   \
  prefix template void matmul_ld<T>(const T*, std::ptrdiff_t, const T*, std::ptrdiff_t, T*, std::ptrdiff_t, int, int, \
                                    int, bool, bool, float, float);                                                 \
  prefix template void bias_add<T>(const T*, const T*, T*, int, int);                                               \
  prefix template void bias_backward<T>(const T*, T*, int, int);                                                    \
  prefix template void add<T>(const T*, const T*, T*, std::size_t);                                                 \
  prefix template void accumulate<T>(const T*, T*, std::size_t);                                                    \
  prefix template void gelu_forward<T>(const T*, T*, std::size_t);                                                 \
  prefix template void gelu_backward<T>(const T*, const T*, T*, std::size_t);                                      \
  prefix template void swiglu_forward<T>(const T*, T*, int, int);                                                  \
  prefix template void swiglu_backward<T>(const T*, const T*, T*, int, int);                                       \
  prefix template void rmsnorm_forward<T>(const T*, const T*, T*, acc_t<T>*, int, int, double);                    \
  prefix template void rmsnorm_backward_input<T>(const T*, const T*, const T*, const acc_t<T>*, T*, int, int,      \
                                                 const T*);                                                       \
  prefix template void rmsnorm_backward_weight<T>(const T*, const T*, const acc_t<T>*, T*, int, int);              \
  prefix template void rope_rotate<T>(T*, const acc_t<T>*, const acc_t<T>*, int, int, int, int, int, bool);        \
  prefix template void layernorm_forward<T>(const T*, const T*, const T*, T*, acc_t<T>*, acc_t<T>*, int, int,       \
                                            double);                                                                \
  prefix template void layernorm_backward_input<T>(const T*, const T*, const T*, const acc_t<T>*, const acc_t<T>*, \
                                                   T*, int, int, const T*);                                         \
  prefix template void layernorm_backward_weight<T>(const T*, const T*, const acc_t<T>*, const acc_t<T>*, T*, T*,  \
                                                    int, int);                                                      \
  prefix template void ce_partials<T>(const T*, acc_t<T>*, acc_t<T>*, int, int, std::ptrdiff_t);                    \
  prefix template void ce_rescale<T>(const acc_t<T>*, const acc_t<T>*, acc_t<T>*, int);                            \
  prefix template void ce_target_logit<T>(const T*, const std::int32_t*, acc_t<T>*, int, int, int, std::ptrdiff_t); \
  prefix template void ce_losses<T>(const acc_t<T>*, const acc_t<T>*, const acc_t<T>*, T*, int);                    \
  prefix template void ce_backward<T>(const T*, const std::int32_t*, const acc_t<T>*, const acc_t<T>*, const T*,   \
                                      T*, int, int, int, std::ptrdiff_t);                                           \
  prefix template void cross_entropy_forward<T>(const T*, const std::int32_t*, T*, acc_t<T>*, acc_t<T>*, int, int); \
  prefix template void embedding_forward<T>(const std::int32_t*, const T*, T*, int, int, int, int);                 \
  prefix template void embedding_backward<T>(const std::int32_t*, const T*, T*, int, int, int, int);                \
  prefix template void add_positions<T>(const T*, T*, int, int, int, int);                                          \
  prefix template void positions_backward<T>(const T*, T*, int, int, int, int);                                     \
  prefix template void dropout_forward<T>(const T*, T*, std::size_t, float, std::uint64_t, std::uint64_t);          \
  prefix template void dropout_backward<T>(const T*, T*, std::size_t, float, std::uint64_t, std::uint64_t);         \
  prefix template void attention_forward<T>(const T*, const T*, const T*, T*, acc_t<T>*, const AttentionShape&);   \
  prefix template void attention_backward<T>(const T*, const T*, const T*, const T*, const T*, const acc_t<T>*, T*, \
                                             T*, T*, const AttentionShape&);                                        \
  prefix template void adamw_step<T>(T*, const T*, acc_t<T>*, acc_t<T>*, std::size_t, double, double, double,      \
                                     double, double, int, acc_t<T>*);                                               \
  prefix template void sgd_step<T>(T*, const T*, acc_t<T>*, std::size_t, double, double, double, bool, acc_t<T>*);

#define LOOM_CPU_KERNELS(prefix)             \
  LOOM_CPU_KERNELS_FOR(prefix, float)        \
  LOOM_CPU_KERNELS_FOR(prefix, double)       \
  LOOM_CPU_KERNELS_FOR(prefix, ::loom::bf16) \
  LOOM_CPU_KERNELS_FOR(prefix, ::loom::fp16)

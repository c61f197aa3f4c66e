// loom::cpu_kernels: the routed experts of the mixture-of-experts layer (layers::RoutedExperts: routing, dispatch,
// the local experts and the combine) instantiated for every element type, for programs built with
// LOOM_EXTERN_KERNELS, which declares them extern in <loom/layers/moe.hpp>. The kernels they call are the other
// objects' (this file is built with LOOM_EXTERN_KERNELS too).
#define LOOM_EXTERN_KERNELS 1
#include <loom/layers/moe.hpp>

namespace loom::layers {
template class RoutedExperts<float>;
template class RoutedExperts<double>;
template class RoutedExperts<::loom::bf16>;
template class RoutedExperts<::loom::fp16>;
}  // namespace loom::layers

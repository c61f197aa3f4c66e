// expect: loom: the loss's gradient in its forward needs the whole vocabulary on the rank
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
using Tp = loom::layers::TensorParallel<2>;  // each rank holds half the vocabulary: its rows' sums are partial
#else
using Tp = loom::layers::TensorParallel<1>;
#endif
int main() {
  const loom::layers::VocabParallelCrossEntropy<float, loom::Host, Tp> ce{nullptr, 0, {0, 0}};
  ce.forward_with_gradient(nullptr, nullptr, nullptr, nullptr, nullptr);
}

// expect: loom: Ops<Cuda>::transpose takes the accumulation types, float and double
#include <loom/kernels/cuda/device_ops.hpp>

int main() {
  const loom::kernels::Ops<loom::Cuda> ops;
#ifdef LOOM_FAIL
  const loom::bf16* src = nullptr;  // a storage type: the log-sum-exps it moves are kept in float
  loom::bf16* dst = nullptr;
#else
  const float* src = nullptr;
  float* dst = nullptr;
#endif
  ops.transpose(src, dst, 1, 2, 3);
}

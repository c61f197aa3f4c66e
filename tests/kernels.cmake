# Tests of include/loom/kernels/cpu/: every kernel against a reference in double, backward against finite
# differences, bf16/fp16/float against double, the optimizers against torch.optim's values.
loom_add_test(test_kernels_cpu
  test_kernels_cpu_matmul.cpp
  test_kernels_cpu_elementwise.cpp
  test_kernels_cpu_cross_entropy.cpp
  test_kernels_cpu_attention.cpp
  LABELS kernels)

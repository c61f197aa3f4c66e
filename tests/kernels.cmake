# Tests of include/loom/kernels/cpu/: every kernel against a reference in double, backward against finite
# differences, bf16/fp16/float against double, the optimizers against torch.optim's values.
loom_add_test(test_kernels_cpu
  test_kernels_cpu_matmul.cpp
  test_kernels_cpu_elementwise.cpp
  test_kernels_cpu_cross_entropy.cpp
  test_kernels_cpu_attention.cpp
  LABELS kernels)

# Ring attention over cp ranks (threads) against the one-rank attention: forward, backward, traffic.
loom_add_test(test_ring_attention test_ring_attention.cpp LABELS "kernels;cp")

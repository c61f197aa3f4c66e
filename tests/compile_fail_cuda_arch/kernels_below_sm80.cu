// expect: loom: the CUDA kernels need compute capability 8.0 or newer
// The device kernels for an architecture older than Ampere: refused by the preprocessor, naming the rule.
#include <loom/kernels/cuda/entry.cuh>

int main() {}

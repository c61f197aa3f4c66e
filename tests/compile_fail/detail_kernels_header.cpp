// expect: loom: kernels/cpu/detail/ is private: include <loom/kernels/cpu/ops.hpp>
#ifdef LOOM_FAIL
#include <loom/kernels/cpu/detail/matmul.hpp>
#else
#include <loom/kernels/cpu/ops.hpp>
#endif
int main() {}

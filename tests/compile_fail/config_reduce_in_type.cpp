// expect: loom: ReduceIn<T> takes float (the default for bf16 gradients) or bf16
#include <loom/config.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::DP<4, loom::ZeRO<1>, loom::ReduceIn<double>>>;
#else
using Cfg = loom::Parallel<loom::DP<4, loom::ZeRO<1>, loom::ReduceIn<loom::bf16>>>;
#endif
static_assert(Cfg::reduce_in_storage_type && Cfg::name() == "dp4.zero1.reduce-bf16");
int main() {}

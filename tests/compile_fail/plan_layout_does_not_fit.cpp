// expect: loom: the layout does not fit the device's memory
#include <loom/plan/fits.hpp>
constexpr loom::plan::Run run{64, 8192, 8, loom::plan::Dtype::bf16};
#ifdef LOOM_FAIL
using C = loom::LayoutOf<"dp8">;  // every rank holds 8B parameters' 16 bytes of training state: 120 GiB
#else
using C = loom::LayoutOf<"tp8.pp2.dp4.zero1">;
#endif
static_assert(loom::plan::CheckFits<C, *loom::plan::model_named("llama3-8b"), loom::plan::devices::H100_80GB, run>::ok);
int main() {}

// expect: loom: CP<n, Ring> and CP<n, Ulysses> (context-parallel attention) are not implemented yet
#include <loom/models/gpt.hpp>

#ifdef LOOM_FAIL
using Cfg = loom::Parallel<loom::CP<1, loom::Ulysses>>;
#else
using Cfg = loom::Parallel<loom::DP<2>>;
#endif
// The model part of the layout, which trainers declare their models with.
static_assert(std::is_same_v<loom::models::ModelLayout<Cfg>, loom::Parallel<>>);
int main() {}

// expect: loom: EP<n> (n > 1) needs a mixture-of-experts model
#include <loom/models/gpt.hpp>
#include <loom/train/trainer.hpp>

constexpr loom::models::GptShape dense{1, 2, 2, 8, 16, 8};
constexpr loom::models::GptShape moe{1, 2, 2, 8, 16, 8, 0, 4, 2};
#ifdef LOOM_FAIL
constexpr auto shape = dense;  // no experts to split
#else
constexpr auto shape = moe;
#endif
using Cfg = loom::Parallel<loom::DP<2>, loom::EP<2>>;
using Model = loom::models::Gpt<shape, float, loom::models::ModelLayout<Cfg>>;
static_assert(sizeof(loom::train::Trainer<Cfg, Model, loom::optim::AdamW<float>>) > 0);
int main() {}

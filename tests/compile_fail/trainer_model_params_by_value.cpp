// expect: loom: the model's specs(), params(), grads() and ops() must return references to what it holds, not values: the trainer keeps them (train::TrainableModel)
#include <loom/models/gpt.hpp>
#include <loom/train/trainer.hpp>

using Optimizer = loom::optim::AdamW<double>;
#ifdef LOOM_FAIL
struct Model : loom::models::Gpt<loom::models::tiny, double> {  // a model that hands out a copy of its parameters
  using Gpt::Gpt;
  loom::Tensor<double> params() const { return Gpt::params(); }
};
#else
using Model = loom::models::Gpt<loom::models::tiny, double>;
#endif

static_assert(sizeof(loom::train::TrainerOf<Model, Optimizer>) > 0);
int main() {}

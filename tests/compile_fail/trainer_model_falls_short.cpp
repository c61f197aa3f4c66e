// expect: loom: the model's backward_chunk(slot, chunk, scale) must return the ParamRange whose gradients it completed, and backward_chunks() their count (train::TrainableModel)
#include <loom/models/gpt.hpp>
#include <loom/train/trainer.hpp>

using Optimizer = loom::optim::AdamW<double>;
#ifdef LOOM_FAIL
struct Model : loom::models::Gpt<loom::models::tiny, double> {  // a model whose backward_chunk returns nothing
  using Gpt::Gpt;
  void backward_chunk(int, int, double) {}
};
#else
using Model = loom::models::Gpt<loom::models::tiny, double>;
#endif

static_assert(sizeof(loom::train::TrainerOf<Model, Optimizer>) > 0);
int main() {}

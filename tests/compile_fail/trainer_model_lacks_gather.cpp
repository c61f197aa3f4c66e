// expect: loom: the model has no gather(local) or scatter(whole, local): a buffer laid out as the part's parameters to and from the whole model's layout (train::TrainableModel)
#include <loom/models/gpt.hpp>
#include <loom/train/trainer.hpp>

using Optimizer = loom::optim::AdamW<double>;
#ifdef LOOM_FAIL
struct Model : loom::models::Gpt<loom::models::tiny, double> {  // a model that cannot gather its parameters
  using Gpt::Gpt;
  template <class U>
  std::vector<U> gather(const U*) = delete;
};
#else
using Model = loom::models::Gpt<loom::models::tiny, double>;
#endif

static_assert(sizeof(loom::train::TrainerOf<Model, Optimizer>) > 0);
int main() {}

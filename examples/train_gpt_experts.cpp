// train_gpt's layouts: expert parallelism for the mixture-of-experts models (--model tiny-moe, small-moe), the
// experts split over ranks carved out of dp x cp, alone and with ZeRO-1, tensor, context and pipeline parallelism,
// up to 8 ranks.
#include "train_gpt.hpp"

namespace train_gpt {

using Layouts = Family<Parallel<DP<2>, EP<2>>, Parallel<DP<4>, EP<2>>, Parallel<DP<4>, EP<4>>, Parallel<DP<8>, EP<8>>,
                       Parallel<TP<2>, DP<2>, EP<2>>, Parallel<PP<2>, DP<2>, EP<2>>,
                       Parallel<DP<4, ZeRO<1>>, EP<2>>, Parallel<CP<2>, DP<2>, EP<4>>>;

std::optional<int> run_expert_parallel(const std::string& layout, const Args& a, int& argc, char**& argv) {
  return Layouts::run(layout, a, argc, argv);
}
std::vector<std::string> expert_parallel_layouts() { return Layouts::names(); }

}  // namespace train_gpt

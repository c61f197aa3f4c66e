// train_gpt's layouts: Tensor parallelism, alone and with data parallelism, up to 8 ranks.
#include "train_gpt.hpp"

namespace train_gpt {

using Layouts = Family<Parallel<TP<2>>, Parallel<TP<4>>, Parallel<TP<8>>, Parallel<TP<2>, DP<2>>,
                       Parallel<TP<2>, DP<4>>, Parallel<TP<4>, DP<2>>, Parallel<TP<2>, DP<2, ZeRO<1>>>,
                       Parallel<TP<2>, DP<4, ZeRO<1>>>>;

std::optional<int> run_tensor_parallel(const std::string& layout, const Args& a, int& argc, char**& argv) {
  return Layouts::run(layout, a, argc, argv);
}
std::vector<std::string> tensor_parallel_layouts() { return Layouts::names(); }

}  // namespace train_gpt

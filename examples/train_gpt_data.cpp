// train_gpt's layouts: Data parallelism (and one rank).
#include "train_gpt.hpp"

namespace train_gpt {

using Layouts = Family<Parallel<>, Parallel<DP<2>>, Parallel<DP<4>>, Parallel<DP<8>>, Parallel<DP<2, ZeRO<1>>>,
                       Parallel<DP<4, ZeRO<1>>>, Parallel<DP<8, ZeRO<1>>>, Parallel<DP<2, ZeRO<2>>>,
                       Parallel<DP<4, ZeRO<2>>>, Parallel<DP<8, ZeRO<2>>>, Parallel<DP<2, ZeRO<3>>>,
                       Parallel<DP<4, ZeRO<3>>>, Parallel<DP<8, ZeRO<3>>>, Parallel<DP<4, ZeRO<3>, KeepGathered>>,
                       Parallel<DP<8, ZeRO<3>, KeepGathered>>, Parallel<DP<4, ZeRO<3>, HybridShard<2>>>,
                       Parallel<DP<8, ZeRO<3>, HybridShard<4>>>>;

std::optional<int> run_data_parallel(const std::string& layout, const Args& a, int& argc, char**& argv) {
  return Layouts::run(layout, a, argc, argv);
}
std::vector<std::string> data_parallel_layouts() { return Layouts::names(); }

}  // namespace train_gpt

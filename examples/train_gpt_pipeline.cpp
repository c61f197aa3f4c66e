// train_gpt's layouts: pipeline parallelism, alone and with tensor (and sequence) and data parallelism, up to 8
// ranks; the schedule (--schedule) and the chunks per stage (--parallel vN) are chosen at run time.
#include "train_gpt.hpp"

namespace train_gpt {

using Layouts = Family<Parallel<PP<2>>, Parallel<PP<4>>, Parallel<PP<2>, DP<2>>, Parallel<PP<2>, DP<4>>,
                       Parallel<PP<4>, DP<2>>, Parallel<TP<2>, PP<2>>, Parallel<TP<2>, PP<2>, DP<2>>,
                       Parallel<TP<2, SequenceParallel>, PP<2>, DP<2>>, Parallel<TP<2>, PP<4>>, Parallel<TP<4>, PP<2>>>;

std::optional<int> run_pipeline_parallel(const std::string& layout, const Args& a, int& argc, char**& argv) {
  return Layouts::run(layout, a, argc, argv);
}
std::vector<std::string> pipeline_parallel_layouts() { return Layouts::names(); }

}  // namespace train_gpt

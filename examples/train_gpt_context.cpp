// train_gpt's layouts: context parallelism (ring attention, and Ulysses with cpN,ulysses), alone and with tensor (and
// sequence), data (and ZeRO-1), pipeline and expert parallelism, up to 8 ranks.
#include "train_gpt.hpp"

namespace train_gpt {

using Layouts = Family<Parallel<CP<2>>, Parallel<CP<4>>, Parallel<CP<8>>, Parallel<CP<2, Ulysses>>,
                       Parallel<CP<4, Ulysses>>, Parallel<CP<8, Ulysses>>, Parallel<TP<2>, CP<2>>,
                       Parallel<TP<2, SequenceParallel>, CP<2>>, Parallel<CP<2>, DP<2>>,
                       Parallel<CP<2>, DP<2, ZeRO<1>>>, Parallel<CP<4>, DP<2>>, Parallel<CP<2>, PP<2>>,
                       Parallel<TP<2>, CP<2>, PP<2>>, Parallel<CP<2>, DP<2>, EP<4>>>;

std::optional<int> run_context_parallel(const std::string& layout, const Args& a, int& argc, char**& argv) {
  return Layouts::run(layout, a, argc, argv);
}
std::vector<std::string> context_parallel_layouts() { return Layouts::names(); }

}  // namespace train_gpt

// train_gpt's layouts: pipeline parallelism with tensor (and sequence) parallelism, and with data parallelism, up to
// 8 ranks, each under every schedule (--schedule, --parallel vN).
#include "train_gpt.hpp"

namespace train_gpt {

namespace {
template <class Pp>
using Tp2 = Parallel<TP<2>, Pp>;
template <class Pp>
using Tp2Dp2 = Parallel<TP<2>, Pp, DP<2>>;
template <class Pp>
using Tp2SpDp2 = Parallel<TP<2, SequenceParallel>, Pp, DP<2>>;
template <class Pp>
using Tp4 = Parallel<TP<4>, Pp>;

using Layouts = FamilyOf<EverySchedule<Tp2, 2>, EverySchedule<Tp2Dp2, 2>, EverySchedule<Tp2SpDp2, 2>,
                         EverySchedule<Tp2, 4>, EverySchedule<Tp4, 2>>;
}  // namespace

std::optional<int> run_pipeline_tensor_parallel(const std::string& layout, const Args& a, int& argc, char**& argv) {
  return Layouts::run(layout, a, argc, argv);
}
std::vector<std::string> pipeline_tensor_parallel_layouts() { return Layouts::names(); }

}  // namespace train_gpt

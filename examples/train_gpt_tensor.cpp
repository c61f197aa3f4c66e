// train_gpt's layouts whose model is split over a tensor-parallel group: tensor parallelism, with and without
// sequence parallelism, alone and with data parallelism (and ZeRO-1 or ZeRO-3), pipeline parallelism under every schedule
// (--schedule, --parallel vN) and expert parallelism, up to 8 ranks.
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

using TpLayouts = LayoutList<Parallel<TP<2>>, Parallel<TP<4>>, Parallel<TP<8>>, Parallel<TP<2>, DP<2>>,
                                  Parallel<TP<2>, DP<4>>, Parallel<TP<4>, DP<2>>, Parallel<TP<2>, DP<2, ZeRO<1>>>,
                                  Parallel<TP<2>, DP<4, ZeRO<1>>>, Parallel<TP<2>, DP<2, ZeRO<3>>>,
                                  Parallel<TP<2>, DP<2>, EP<2>>>;
using SpLayouts =
    LayoutList<Parallel<TP<2, SequenceParallel>>, Parallel<TP<4, SequenceParallel>>, Parallel<TP<8, SequenceParallel>>,
               Parallel<TP<2, SequenceParallel>, DP<2>>, Parallel<TP<2, SequenceParallel>, DP<4>>,
               Parallel<TP<4, SequenceParallel>, DP<2>>>;

}  // namespace

using Layouts = FamilyOf<TpLayouts, SpLayouts, EverySchedule<Tp2, 2>, EverySchedule<Tp2Dp2, 2>,
                         EverySchedule<Tp2SpDp2, 2>, EverySchedule<Tp2, 4>, EverySchedule<Tp4, 2>>;

std::optional<int> run_tensor_parallel(const std::string& layout, const Args& a, int& argc, char**& argv) {
  return Layouts::run(layout, a, argc, argv);
}
std::vector<std::string> tensor_parallel_layouts() { return Layouts::names(); }

}  // namespace train_gpt

// train_gpt's layouts: pipeline parallelism, alone and with data parallelism, up to 8 ranks, each under every
// schedule (--schedule, --parallel vN): the layouts whose model is the single-rank one.
#include "train_gpt.hpp"

namespace train_gpt {

namespace {
template <class Pp>
using Alone = Parallel<Pp>;
template <class Pp>
using WithDp2 = Parallel<Pp, DP<2>>;
template <class Pp>
using WithDp4 = Parallel<Pp, DP<4>>;
template <class Pp>
using WithDp2Zero1 = Parallel<Pp, DP<2, ZeRO<1>>>;
template <class Pp>
using WithDp2Zero2 = Parallel<Pp, DP<2, ZeRO<2>>>;
template <class Pp>
using WithDp2Zero3 = Parallel<Pp, DP<2, ZeRO<3>, KeepGathered>>;

using Layouts = FamilyOf<EverySchedule<Alone, 2>, EverySchedule<Alone, 4>, EverySchedule<WithDp2, 2>,
                         EverySchedule<WithDp4, 2>, EverySchedule<WithDp2, 4>, EverySchedule<WithDp2Zero1, 2>,
                         EverySchedule<WithDp2Zero2, 2>, EverySchedule<WithDp2Zero3, 2>>;
}  // namespace

std::optional<int> run_pipeline_parallel(const std::string& layout, const Args& a, int& argc, char**& argv) {
  return Layouts::run(layout, a, argc, argv);
}
std::vector<std::string> pipeline_parallel_layouts() { return Layouts::names(); }

}  // namespace train_gpt

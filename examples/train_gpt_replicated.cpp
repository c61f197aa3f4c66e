// train_gpt's layouts whose model is the single-rank one, every rank holding it whole (or, with expert parallelism,
// its share of the experts): data parallelism (and ZeRO 1, 2 and 3, hybrid sharding), pipeline parallelism alone and
// with data parallelism under every schedule (--schedule, --parallel vN), and expert parallelism for the
// mixture-of-experts models (--model tiny-moe, small-moe; with ZeRO-1 and 3 too), up to 8 ranks. One model layout,
// so the model and each trainer kind are compiled once here.
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

using DpLayouts =
    LayoutList<Parallel<>, Parallel<DP<2>>, Parallel<DP<4>>, Parallel<DP<8>>, Parallel<DP<2, ZeRO<1>>>,
               Parallel<DP<4, ZeRO<1>>>, Parallel<DP<8, ZeRO<1>>>, Parallel<DP<2, ZeRO<2>>>, Parallel<DP<4, ZeRO<2>>>,
               Parallel<DP<8, ZeRO<2>>>, Parallel<DP<2, ZeRO<3>>>, Parallel<DP<4, ZeRO<3>>>, Parallel<DP<8, ZeRO<3>>>,
               Parallel<DP<4, ZeRO<3>, KeepGathered>>, Parallel<DP<8, ZeRO<3>, KeepGathered>>,
               Parallel<DP<4, ZeRO<3>, HybridShard<2>>>, Parallel<DP<8, ZeRO<3>, HybridShard<4>>>>;
// The experts split over ranks carved out of dp: the model's code is the single-rank model's.
using EpLayouts = LayoutList<Parallel<DP<2>, EP<2>>, Parallel<DP<4>, EP<2>>, Parallel<DP<4>, EP<4>>,
                             Parallel<DP<8>, EP<8>>, Parallel<PP<2>, DP<2>, EP<2>>,
                             Parallel<DP<4, ZeRO<1>>, EP<2>>, Parallel<DP<4, ZeRO<3>>, EP<2>>>;

}  // namespace

using Layouts = FamilyOf<DpLayouts, EverySchedule<Alone, 2>, EverySchedule<Alone, 4>, EverySchedule<WithDp2, 2>,
                         EverySchedule<WithDp4, 2>, EverySchedule<WithDp2, 4>, EverySchedule<WithDp2Zero1, 2>,
                         EverySchedule<WithDp2Zero2, 2>, EverySchedule<WithDp2Zero3, 2>, EpLayouts>;

std::optional<int> run_replicated(const std::string& layout, const Args& a, int& argc, char**& argv) {
  return Layouts::run(layout, a, argc, argv);
}
std::vector<std::string> replicated_layouts() { return Layouts::names(); }

}  // namespace train_gpt

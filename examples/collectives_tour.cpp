// The main example for now: 8 ranks as threads of this process, laid out as TP2 x PP2 x DP2, run a tour of
// collectives over their mesh groups and print what each did.
#include <loom/comm/local.hpp>
#include <loom/core/half.hpp>  // bf16 values
#include <loom/config.hpp>

#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

using Layout = loom::Parallel<loom::TP<2>, loom::PP<2>, loom::DP<2>>;

int main() {
  std::vector<std::vector<std::string>> log(Layout::world_size);  // one per rank thread: printed in order at the end
  auto say = [&](int rank, const std::string& s) { log[rank].push_back(s); };
  auto show = [](const auto& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i) s += ' ';
      s += std::to_string(static_cast<double>(v[i])).substr(0, 4);
    }
    return s + "]";
  };

  std::printf("layout %s: %d ranks; rank = tp + 2*(dp + 2*pp)\n", std::string(Layout::name()).c_str(),
              Layout::world_size);
  try {
    loom::run_local<Layout>([&](auto& ctx) {
      using loom::Axis;
      const int r = ctx.rank();
      const auto c = Layout::coords(r);
      say(r, "coords tp=" + std::to_string(c.tp) + " dp=" + std::to_string(c.dp) + " pp=" + std::to_string(c.pp));

      // Data parallel: average a gradient over the dp group.
      std::vector<float> grad(4, static_cast<float>(r));
      ctx.template comm<Axis::dp>().all_reduce(grad, loom::comm::Reduce::avg);
      say(r, "dp all_reduce(avg) of my rank -> " + show(grad));

      // Tensor parallel: gather each rank's shard of an activation over the tp group.
      std::vector<double> shard{r * 10.0, r * 10.0 + 1}, full(4);
      ctx.template comm<Axis::tp>().all_gather(shard, full);
      say(r, "tp all_gather of {10r, 10r+1} -> " + show(full));

      // Pipeline: stage 0 sends an activation to stage 1 with the same tp and dp coordinates.
      auto& pp = ctx.template comm<Axis::pp>();
      std::vector<loom::bf16> act(3, loom::bf16(0.0f));
      if (pp.rank() == 0) {
        for (std::size_t i = 0; i < act.size(); ++i) act[i] = loom::bf16(static_cast<float>(r) + 0.5f * i);
        pp.send(act, 1);
        say(r, "pp send to global rank " + std::to_string(pp.group().ranks[1]) + " " + show(act));
      } else {
        pp.recv(act, 0);
        say(r, "pp recv from global rank " + std::to_string(pp.group().ranks[0]) + " " + show(act));
      }

      // Everyone: the largest rank id, asynchronously, while other work could run.
      std::vector<std::int64_t> top{r};
      auto h = ctx.world().all_reduce_async(top, loom::comm::Reduce::max);
      h.wait();
      say(r, "world all_reduce(max) -> " + std::to_string(top[0]));
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  for (int r = 0; r < Layout::world_size; ++r)
    for (const auto& line : log[r]) std::printf("rank %d: %s\n", r, line.c_str());
}

// Uses loom from outside its source tree: a layout, its groups, and an all_reduce over threads.
#include <loom/comm/local.hpp>
#include <loom/config.hpp>

#include <cstdio>

int main() {
  using C = loom::Parallel<loom::TP<2>, loom::DP<2>>;
  static_assert(C::world_size == 4 && C::group<loom::Axis::dp>(1)[1] == 3);
  int bad = 0;
  loom::run_local<C>([&](auto& ctx) {
    std::vector<int> v{ctx.rank()};
    ctx.world().all_reduce(v);
    if (v[0] != 0 + 1 + 2 + 3) bad = 1;
  });
  std::printf("consumer: %s\n", bad ? "wrong sum" : "ok");
  return bad;
}

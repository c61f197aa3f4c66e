// expect: loom: send and recv must have the same element type
#include <loom/comm/local.hpp>
#include <loom/config.hpp>

int main() {
  loom::run_local<loom::Parallel<loom::DP<2>>>([](auto& ctx) {
    std::vector<float> send(4);
#ifdef LOOM_FAIL
    std::vector<double> recv(4);
#else
    std::vector<float> recv(4);
#endif
    ctx.world().all_reduce(send, recv);
  });
}

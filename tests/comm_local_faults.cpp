// Ranks as threads that fail while their peers are inside collectives, run as a program so that a test sees its
// exit status: every scenario must end with exit 1 and every other rank told which rank failed, never with a
// signal. scripts/sanitize runs it under AddressSanitizer, which also catches a peer's freed buffer being read.
//   comm_local_faults mid-collective ring|halving_doubling|direct [elements]
//   comm_local_faults straggler
//   comm_local_faults send-recv
#include <loom/comm/local.hpp>
#include <loom/config.hpp>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

using namespace loom;
using namespace std::chrono_literals;

namespace {

//! Prints every rank's message and how many of the others were told that `failed` failed; returns 1 when all of
//! them were and `failed` is the rank reported, 3 otherwise.
int report(const RankFailure& f, int failed) {
  int told = 0;
  const std::string want = "abandoned because rank " + std::to_string(failed) + " failed";
  for (std::size_t r = 0; r < f.messages.size(); ++r) {
    std::printf("rank %zu: %s\n", r, f.messages[r].c_str());
    if (static_cast<int>(r) != failed && f.messages[r].find(want) != std::string::npos) ++told;
  }
  std::printf("%s\n", f.what());
  std::printf("%d of %zu other ranks were told: %s\n", told, f.messages.size() - 1, want.c_str());
  return told + 1 == static_cast<int>(f.messages.size()) && f.rank == failed ? 1 : 3;
}

//! One run of mid_collective (below).
int mid_collective_once(comm::Algorithm algo, std::size_t n) {
  comm::LocalOptions o;
  o.algorithm = algo;
  o.timeout = 20s;
  try {
    run_local<Parallel<TP<2>, DP<4>>>(
        [n](auto& ctx) {
          auto& dp = ctx.template comm<Axis::dp>();
          std::vector<float> send(n, 1.0f), recv(n);
          const auto until = std::chrono::steady_clock::now() + 30ms;
          for (int i = 0;; ++i) {
            if (ctx.rank() == 1 && std::chrono::steady_clock::now() >= until)
              throw std::runtime_error("rank 1 gives up at all_reduce " + std::to_string(i));
            dp.all_reduce(send, recv);
          }
        },
        o);
  } catch (const RankFailure& f) {
    return report(f, 1);
  }
  std::printf("no rank failed\n");
  return 2;
}

//! Parallel<TP<2>, DP<4>>: every rank runs data-parallel all_reduces of `n` floats in a loop; rank 1 throws while
//! the others are inside one, so that peers leave it at different points of reading each other's buffers. Where
//! they leave is up to the threads, so the run is repeated: each repetition must end the same way.
int mid_collective(comm::Algorithm algo, std::size_t n) {
  for (int rep = 1; rep < 4; ++rep)
    if (mid_collective_once(algo, n) != 1) return 2;
  return mid_collective_once(algo, n);
}

//! Parallel<DP<2>>, timeout 1 s: rank 1 sleeps 1.5 s between two all_reduces, so rank 0 times out inside the second
//! and leaves; rank 1 then enters it and must be told, touching nothing that rank 0 owned.
int straggler() {
  comm::LocalOptions o;
  o.timeout = 1s;
  try {
    run_local<Parallel<DP<2>>>(
        [](auto& ctx) {
          std::vector<double> v(1000, 1.0);
          ctx.world().all_reduce(v);
          if (ctx.rank() == 1) std::this_thread::sleep_for(1500ms);
          ctx.world().all_reduce(v);
        },
        o);
  } catch (const RankFailure& f) {
    return report(f, 0);
  }
  std::printf("no rank failed\n");
  return 2;
}

//! Parallel<DP<3>>: ranks 0 and 1 exchange large messages in a loop (each copies from the other's buffer); rank 2
//! throws meanwhile.
int send_recv(std::size_t n) {
  comm::LocalOptions o;
  o.timeout = 20s;
  try {
    run_local<Parallel<DP<3>>>(
        [n](auto& ctx) {
          auto& w = ctx.world();
          if (ctx.rank() == 2) {
            std::this_thread::sleep_for(30ms);
            throw std::runtime_error("rank 2 gives up");
          }
          std::vector<float> out(n, 1.0f), in(n);
          const int peer = 1 - ctx.rank();
          for (;;) w.exchange({comm::send_op(out, peer), comm::recv_op(in, peer)});
        },
        o);
  } catch (const RankFailure& f) {
    return report(f, 2);
  }
  std::printf("no rank failed\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  const std::size_t n = argc > 3 ? std::stoul(argv[3]) : std::size_t{1} << 22;
  if (what == "straggler") return straggler();
  if (what == "send-recv") return send_recv(argc > 2 ? std::stoul(argv[2]) : n);
  if (what == "mid-collective" && argc > 2) {
    for (auto a : {comm::Algorithm::ring, comm::Algorithm::halving_doubling, comm::Algorithm::direct})
      if (name_of(a) == argv[2]) return mid_collective(a, n);
  }
  std::fprintf(stderr, "usage: comm_local_faults mid-collective ring|halving_doubling|direct [elements] | "
                       "straggler | send-recv [elements]\n");
  return 2;
}

// The Mpi backend under mpirun: the same collective cases as the Local backend (tests/comm_cases.hpp), on every
// group of a layout chosen by the process count, plus the failure paths selected by the first argument.
//   mpirun -np 4 test_comm_mpi cases | wrong-size | throw | missing | no-group
#include "comm_cases.hpp"

#include <loom/comm/mpi.hpp>

#include <cstdio>
#include <cstring>
#include <thread>

using namespace loom;

template <class Cfg>
int cases(int& argc, char**& argv) {
  return run_mpi<Cfg>(argc, argv, [](auto& ctx) {
    test::all_groups(ctx);
    // Asynchronous operations on two groups at once.
    std::vector<double> a(1000, ctx.rank()), b(10, 1.0);
    auto h1 = ctx.template comm<Axis::tp>().all_reduce_async(a);
    auto h2 = ctx.template comm<Axis::dp>().all_reduce_async(b, comm::Reduce::avg);
    h1.wait();
    h2.wait();
    test::expect(b[9] == 1.0, "async avg got ", b[9]);
    // MPI error codes become exceptions that carry MPI's own text.
    try {
      comm::detail::mpi_check(MPI_ERR_COUNT, "MPI_Send");
      test::expect(false, "mpi_check did not throw");
    } catch (const BackendError& e) {
      test::expect(std::string(e.what()).find("loom: MPI_Send failed: MPI_ERR_COUNT") == 0, "message: ", e.what());
    }
    if (ctx.rank() == 0) std::printf("test_comm_mpi: every collective on every group of %s passed\n",
                                     std::string(Cfg::name()).c_str());
  });
}

template <class Cfg>
int failure(int& argc, char**& argv, const char* mode) {
  return run_mpi<Cfg>(argc, argv, [mode](auto& ctx) {
    if (std::strcmp(mode, "no-group") == 0 && ctx.rank() == 3) std::this_thread::sleep_for(std::chrono::seconds(60));
    auto& dp = ctx.template comm<Axis::dp>();
    std::vector<float> v(16, 1.0f);
    dp.all_reduce(v);
    dp.all_reduce(v);
    if (ctx.rank() == 3) {
      if (std::strcmp(mode, "throw") == 0) throw std::runtime_error("rank three gives up");
      std::this_thread::sleep_for(std::chrono::seconds(60));  // never enters the third
    }
    dp.all_reduce(v);
    // Ranks 0 and 2 finish; they wait before the final barrier so that the stalled all_reduce is what times out first.
    std::this_thread::sleep_for(std::chrono::seconds(2));
  });
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "cases";
  const char* np = std::getenv("OMPI_COMM_WORLD_SIZE");
  const int size = np ? std::atoi(np) : 1;
  if (std::strcmp(mode, "cases") == 0) {
    if (size == 8) return cases<Parallel<TP<2>, PP<2>, DP<2>>>(argc, argv);
    if (size == 4) return cases<Parallel<TP<2>, DP<2>>>(argc, argv);
    return cases<Parallel<DP<3>>>(argc, argv);
  }
  if (std::strcmp(mode, "wrong-size") == 0) return cases<Parallel<TP<2>, PP<2>, DP<2>>>(argc, argv);
  return failure<Parallel<TP<2>, DP<2>>>(argc, argv, mode);
}

// Collectives benchmark in the manner of nccl-tests: for each collective and backend, sizes from -b to -e bytes by
// factor -f, the time per operation, algbw and busbw (nccl-tests' factors), and a correctness check per size. The
// same run measures raw MPI_Allreduce and this machine's memcpy bandwidth as references; the Mpi rows come from
// this program relaunched under mpirun, so that every row is measured side by side.
//
//   collectives [-g ranks] [-b 8] [-e 256M] [-f 2] [-n iters] [-w warmup] [-c 1] [-o all_reduce,all_gather,...]
//               [--backends local,mpi,nccl] [--algos auto|all|ring,...] [--json FILE]
// nccl needs one GPU per rank (-g 1 on a machine with one GPU).
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#ifdef LOOM_HAS_MPI
#include <loom/comm/mpi.hpp>
#endif
#if defined(LOOM_HAS_MPI) && defined(LOOM_HAS_CUDA)
#include <loom/comm/nccl.hpp>
#endif

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <tuple>
#include <unistd.h>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace loom;
using comm::Algorithm;
using comm::Reduce;
using Clock = std::chrono::steady_clock;

struct Row {
  std::string collective, backend, algorithm;
  int ranks = 0;
  std::size_t bytes = 0;
  double time_us = 0, algbw_gbps = 0, busbw_gbps = 0;
  bool ok = true;
};

//! A row whose bandwidths follow from its time: algbw = S/t, busbw = algbw x nccl-tests' factor.
Row make_row(std::string collective, std::string backend, std::string algorithm, int ranks, std::size_t bytes,
             double time_us, double factor, bool ok) {
  const double algbw = static_cast<double>(bytes) / time_us / 1e3;
  return {std::move(collective), std::move(backend), std::move(algorithm), ranks, bytes, time_us, algbw,
          algbw * factor, ok};
}

void to_json(nlohmann::json& j, const Row& r) {
  j = {{"collective", r.collective}, {"backend", r.backend}, {"algorithm", r.algorithm}, {"ranks", r.ranks},
       {"bytes", r.bytes}, {"time_us", r.time_us}, {"algbw_gbps", r.algbw_gbps}, {"busbw_gbps", r.busbw_gbps},
       {"check", r.ok}};
}
void from_json(const nlohmann::json& j, Row& r) {
  r.collective = j.at("collective"), r.backend = j.at("backend"), r.algorithm = j.at("algorithm");
  r.ranks = j.at("ranks"), r.bytes = j.at("bytes"), r.time_us = j.at("time_us");
  r.algbw_gbps = j.at("algbw_gbps"), r.busbw_gbps = j.at("busbw_gbps"), r.ok = j.at("check");
}

struct BenchOptions {
  int ranks = 8;
  std::size_t min_bytes = 8, max_bytes = std::size_t{256} << 20;
  double factor = 2;
  int iters = 0, warmup = -1;  // 0 / -1: chosen by size
  bool check = true;
  std::vector<std::string> ops{"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"};
  std::vector<std::string> backends{"local", "mpi"};
  std::vector<Algorithm> algos{Algorithm::automatic};
  std::string json, child_out, child_backend = "mpi";
};

std::size_t parse_size(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  switch (*end) {
    case 'K': case 'k': v *= 1024; break;
    case 'M': case 'm': v *= 1024 * 1024; break;
    case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return static_cast<std::size_t>(v);
}
std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(x);
  return out;
}
Algorithm parse_algo(const std::string& s) {
  if (s == "ring") return Algorithm::ring;
  if (s == "halving_doubling" || s == "hd") return Algorithm::halving_doubling;
  if (s == "direct") return Algorithm::direct;
  if (s == "auto") return Algorithm::automatic;
  throw Error("loom: unknown algorithm '" + s + "' (ring, halving_doubling, direct, auto, all)");
}

BenchOptions parse(int argc, char** argv) {
  BenchOptions o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw Error("loom: " + a + " needs a value");
      return argv[++i];
    };
    if (a == "-g") o.ranks = std::stoi(next());
    else if (a == "-b") o.min_bytes = parse_size(next());
    else if (a == "-e") o.max_bytes = parse_size(next());
    else if (a == "-f") o.factor = std::stod(next());
    else if (a == "-n") o.iters = std::stoi(next());
    else if (a == "-w") o.warmup = std::stoi(next());
    else if (a == "-c") o.check = std::stoi(next()) != 0;
    else if (a == "-o") o.ops = split(next());
    else if (a == "--backends") o.backends = split(next());
    else if (a == "--algos") {
      const auto v = next();
      o.algos.clear();
      if (v == "all") o.algos = {Algorithm::automatic, Algorithm::ring, Algorithm::halving_doubling, Algorithm::direct};
      else for (auto& s : split(v)) o.algos.push_back(parse_algo(s));
    } else if (a == "--json") o.json = next();
    else if (a == "--child-out") o.child_out = next();
    else if (a == "--child-backend") o.child_backend = next();
    else if (a == "-h" || a == "--help") {
      std::puts("collectives [-g ranks] [-b minbytes] [-e maxbytes] [-f factor] [-n iters] [-w warmup] [-c check]\n"
                "            [-o ops] [--backends local,mpi,nccl] [--algos auto|all|ring,...] [--json FILE]");
      std::exit(0);
    } else throw Error("loom: unknown flag '" + a + "'");
  }
  LOOM_CHECK(o.factor > 1, "-f must be above 1, got ", o.factor);
  return o;
}

std::vector<std::size_t> sizes(const BenchOptions& o) {
  std::vector<std::size_t> v;
  for (double s = static_cast<double>(o.min_bytes); s <= static_cast<double>(o.max_bytes) * 1.0000001; s *= o.factor)
    v.push_back(static_cast<std::size_t>(s));
  return v;
}
int iters_for(const BenchOptions& o, std::size_t bytes) {
  if (o.iters > 0) return o.iters;
  return static_cast<int>(std::clamp<double>(std::floor(256.0 * (1 << 20) / std::max<std::size_t>(bytes, 1)), 3, 50));
}
int warmup_for(const BenchOptions& o, std::size_t bytes) {
  return o.warmup >= 0 ? o.warmup : (bytes >= (std::size_t{64} << 20) ? 1 : 3);
}

// nccl-tests' bus bandwidth factors; S is the whole array (the buffer for all_reduce, broadcast, reduce; the
// gathered or scattered whole for all_gather, reduce_scatter; one rank's send for all_to_all).
double bus_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "reduce_scatter" || op == "all_gather" || op == "all_to_all") return static_cast<double>(n - 1) / n;
  return 1.0;
}
//! Elements of float per rank buffer for a collective of S bytes on n ranks; 0 when S is too small.
std::size_t elems(const std::string& op, std::size_t bytes, int n) {
  const std::size_t e = bytes / sizeof(float);
  if (op == "all_reduce" || op == "broadcast" || op == "reduce") return e;
  return e / n * n;  // whole arrays of n blocks
}

float value(int rank, std::size_t i) { return static_cast<float>((rank * 3 + i) % 7); }

//! Send and receive buffers in host memory.
struct HostBuffers {
  std::vector<float> s, r;
  explicit HostBuffers(std::size_t n) : s(n), r(n) {}
  std::span<float> send() { return s; }
  std::span<float> recv() { return r; }
  void put(std::span<const float> send_h, std::span<const float> recv_h) {
    std::copy(send_h.begin(), send_h.end(), s.begin());
    std::copy(recv_h.begin(), recv_h.end(), r.begin());
  }
  void get_recv(std::span<float> out) { std::copy_n(r.begin(), out.size(), out.begin()); }
};

#if defined(LOOM_HAS_MPI) && defined(LOOM_HAS_CUDA)
//! Send and receive buffers in the current GPU's memory, filled and read through host copies. The copies and memsets
//! go to the legacy default stream, which the communicator's non-blocking stream does not wait for, and a copy from
//! pageable memory may return before its data lands: each filling waits for the device before the operation runs.
struct DeviceBuffers {
  float* s = nullptr;
  float* r = nullptr;
  std::size_t n;
  explicit DeviceBuffers(std::size_t n_) : n(n_) {
    LOOM_CUDA(cudaMalloc(&s, n * sizeof(float)));
    LOOM_CUDA(cudaMalloc(&r, n * sizeof(float)));
    LOOM_CUDA(cudaMemset(s, 0, n * sizeof(float)));
    LOOM_CUDA(cudaMemset(r, 0, n * sizeof(float)));
    LOOM_CUDA(cudaDeviceSynchronize());
  }
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  ~DeviceBuffers() {
    cudaFree(s);
    cudaFree(r);
  }
  std::span<float> send() { return {s, n}; }
  std::span<float> recv() { return {r, n}; }
  void put(std::span<const float> send_h, std::span<const float> recv_h) {
    LOOM_CUDA(cudaMemcpy(s, send_h.data(), send_h.size_bytes(), cudaMemcpyHostToDevice));
    LOOM_CUDA(cudaMemcpy(r, recv_h.data(), recv_h.size_bytes(), cudaMemcpyHostToDevice));
    LOOM_CUDA(cudaDeviceSynchronize());
  }
  void get_recv(std::span<float> out) {
    LOOM_CUDA(cudaMemcpy(out.data(), r, out.size_bytes(), cudaMemcpyDeviceToHost));
  }
};
#endif

//! One collective on comm over the first `count` floats of the buffers (the whole array, as nccl-tests counts).
template <class Comm>
void issue(Comm& c, const std::string& op, std::span<float> send, std::span<float> recv, std::size_t count) {
  const int n = c.size();
  auto s = send.first(count), r = recv.first(count);
  if (op == "all_reduce") c.all_reduce(s, r);
  else if (op == "reduce_scatter") c.reduce_scatter(s, r.first(count / n));
  else if (op == "all_gather") c.all_gather(s.first(count / n), r);
  else if (op == "broadcast") c.broadcast(r, 0);
  else if (op == "reduce") c.reduce(s, r, Reduce::sum, 0);
  else if (op == "all_to_all") c.all_to_all(s, r);
  else throw Error("loom: unknown collective '" + op + "'");
}

//! Runs op once on known data and checks the result on every rank; true when every rank was right.
template <class Comm, class Buffers>
bool verify(Comm& c, const std::string& op, Buffers& buf, std::size_t count) {
  const int n = c.size(), me = c.rank();
  std::vector<float> send(count), recv(count);
  for (std::size_t i = 0; i < count; ++i) send[i] = value(me, i);
  for (std::size_t i = 0; i < count; ++i) recv[i] = op == "broadcast" ? (me == 0 ? value(0, i) : -1.0f) : -1.0f;
  buf.put(send, recv);
  issue(c, op, buf.send(), buf.recv(), count);
  buf.get_recv(recv);
  auto sum = [&](std::size_t i) {
    float s = 0;
    for (int q = 0; q < n; ++q) s += value(q, i);
    return s;
  };
  const std::size_t b = count / n;
  bool ok = true;
  const std::size_t stride = std::max<std::size_t>(1, count / 4096);  // sample large arrays
  for (std::size_t i = 0; i < count && ok; i += stride) {
    float want;
    if (op == "all_reduce") want = sum(i);
    else if (op == "reduce_scatter") { if (i >= b) break; want = sum(me * b + i); }
    else if (op == "all_gather") want = value(static_cast<int>(i / b), i % b);
    else if (op == "broadcast") want = value(0, i);
    else if (op == "reduce") { if (me != 0) break; want = sum(i); }
    else want = value(static_cast<int>(i / b), me * b + i % b);
    ok = recv[i] == want;
  }
  // Every rank must agree that every rank was right.
  std::vector<float> flag(1, ok ? 1.0f : 0.0f), none(1);
  buf.put(flag, none);
  c.all_reduce(buf.send().first(1), buf.recv().first(1), Reduce::min);
  buf.get_recv(flag);
  return flag[0] == 1.0f;
}

//! Times each collective of o.ops on comm over buffers made by Buffers(elements); rank 0 fills rows.
template <class Buffers = HostBuffers, class Comm>
void run_rows(Comm& c, const BenchOptions& o, const std::string& backend, const std::string& algo, std::vector<Row>& rows) {
  const int n = c.size();
  Buffers buf(o.max_bytes / sizeof(float) + n);
  for (const auto& op : o.ops) {
    if (algo != "auto" && op != "all_reduce") continue;
    for (std::size_t bytes : sizes(o)) {
      const std::size_t count = elems(op, bytes, n);
      if (count == 0) continue;
      const int it = iters_for(o, bytes), wu = warmup_for(o, bytes);
      for (int i = 0; i < wu; ++i) issue(c, op, buf.send(), buf.recv(), count);
      c.barrier();
      const auto t0 = Clock::now();
      for (int i = 0; i < it; ++i) issue(c, op, buf.send(), buf.recv(), count);
      c.barrier();
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / it;
      const bool ok = !o.check || verify(c, op, buf, count);
      if (c.rank() == 0) {
        rows.push_back(make_row(op, backend, algo, n, count * sizeof(float), us, bus_factor(op, n), ok));
      }
    }
  }
}

double memcpy_gbps(std::size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  const int it = static_cast<int>(std::clamp<double>(std::floor(1024.0 * (1 << 20) / bytes), 3, 200));
  std::memcpy(b.data(), a.data(), bytes);
  const auto t0 = Clock::now();
  for (int i = 0; i < it; ++i) {
    std::memcpy(b.data(), a.data(), bytes);
    a[i % bytes] = b[(i * 7) % bytes];
  }
  return static_cast<double>(bytes) * it / std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
}

template <int N>
void run_local_rows(const BenchOptions& o, std::vector<Row>& rows) {
  using Cfg = Parallel<DP<N>>;
  for (Algorithm a : o.algos) {
    comm::LocalOptions lo;
    lo.algorithm = a;
    run_local<Cfg>([&](auto& ctx) { run_rows(ctx.world(), o, "local", std::string(name_of(a)), rows); }, lo);
  }
}

void local_rows(const BenchOptions& o, std::vector<Row>& rows) {
  switch (o.ranks) {
    case 1: return run_local_rows<1>(o, rows);
    case 2: return run_local_rows<2>(o, rows);
    case 4: return run_local_rows<4>(o, rows);
    case 8: return run_local_rows<8>(o, rows);
    case 16: return run_local_rows<16>(o, rows);
    default: throw Error("loom: -g must be 1, 2, 4, 8 or 16, got " + std::to_string(o.ranks));
  }
}

#ifdef LOOM_HAS_MPI
//! Under mpirun: the Mpi backend's rows and raw MPI_Allreduce, interleaved per size for all_reduce.
template <int N>
int mpi_child(int argc, char** argv, const BenchOptions& o) {
  std::vector<Row> rows;
  const int rc = run_mpi<Parallel<DP<N>>>(argc, argv, [&](auto& ctx) {
    auto& c = ctx.world();
    // all_reduce: the Mpi backend and raw MPI_Allreduce alternate on the same buffers, three rounds each, and the
    // best round of each is kept, so that drift on a shared machine does not favour either.
    BenchOptions rest = o;
    std::erase(rest.ops, std::string("all_reduce"));
    run_rows(c, rest, "mpi", "auto", rows);
    if (std::find(o.ops.begin(), o.ops.end(), "all_reduce") == o.ops.end()) return;
    HostBuffers buf(o.max_bytes / sizeof(float));
    auto& send = buf.s;
    auto& recv = buf.r;
    for (std::size_t i = 0; i < send.size(); ++i) send[i] = value(c.rank(), i);
    auto timed = [&](auto&& once, int it) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = Clock::now();
      for (int i = 0; i < it; ++i) once();
      MPI_Barrier(MPI_COMM_WORLD);
      return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / it;
    };
    for (std::size_t bytes : sizes(o)) {
      const std::size_t count = bytes / sizeof(float);
      if (count == 0) continue;
      const int it = iters_for(o, bytes), wu = warmup_for(o, bytes);
      std::span<float> s(send.data(), count), r(recv.data(), count);
      auto ours = [&] { c.all_reduce(s, r); };
      auto raw = [&] {
        MPI_Allreduce(send.data(), recv.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      };
      for (int i = 0; i < wu; ++i) ours(), raw();
      double best_ours = 1e300, best_raw = 1e300;
      for (int round = 0; round < 3; ++round) {
        best_ours = std::min(best_ours, timed(ours, it));
        best_raw = std::min(best_raw, timed(raw, it));
      }
      const bool ok = !o.check || verify(c, "all_reduce", buf, count);
      for (std::size_t i = 0; i < count; ++i) send[i] = value(c.rank(), i);
      if (ctx.rank() == 0) {
        for (auto [backend, algo, us] : {std::tuple{"mpi", "best of 3", best_ours},
                                         std::tuple{"mpi-raw", "MPI_Allreduce", best_raw}}) {
          rows.push_back(make_row("all_reduce", backend, algo, N, count * sizeof(float), us,
                                  bus_factor("all_reduce", N), ok));
        }
      }
    }
    if (ctx.rank() == 0) {
      std::ofstream f(o.child_out);
      f << nlohmann::json(rows).dump();
    }
  });
  return rc;
}
#endif

#if defined(LOOM_HAS_MPI) && defined(LOOM_HAS_CUDA)
//! Under mpirun, one rank per GPU: the Nccl backend's rows over device buffers. Each blocking operation waits for
//! its completion on the host, so small sizes include that round trip.
template <int N>
int nccl_child(int argc, char** argv, const BenchOptions& o) {
  std::vector<Row> rows;
  const int rc = run_nccl<Parallel<DP<N>>>(argc, argv, [&](auto& ctx) {
    run_rows<DeviceBuffers>(ctx.world(), o, "nccl", "auto", rows);
    if (ctx.rank() == 0) {
      std::ofstream f(o.child_out);
      f << nlohmann::json(rows).dump();
    }
  });
  return rc;
}
#endif

void print(const std::vector<Row>& rows) {
  std::printf("%-15s %-8s %-16s %5s %12s %12s %10s %10s %6s\n", "collective", "backend", "algorithm", "ranks", "bytes",
              "time_us", "algbw_GB/s", "busbw_GB/s", "check");
  for (const auto& r : rows)
    std::printf("%-15s %-8s %-16s %5d %12zu %12.2f %10.3f %10.3f %6s\n", r.collective.c_str(), r.backend.c_str(),
                r.algorithm.c_str(), r.ranks, r.bytes, r.time_us, r.algbw_gbps, r.busbw_gbps, r.ok ? "ok" : "FAIL");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    BenchOptions o = parse(argc, argv);
#ifdef LOOM_HAS_MPI
    if (!o.child_out.empty() && o.child_backend == "mpi") {
      switch (o.ranks) {
        case 1: return mpi_child<1>(argc, argv, o);
        case 2: return mpi_child<2>(argc, argv, o);
        case 4: return mpi_child<4>(argc, argv, o);
        case 8: return mpi_child<8>(argc, argv, o);
        case 16: return mpi_child<16>(argc, argv, o);
        default: throw Error("loom: -g must be 1, 2, 4, 8 or 16");
      }
    }
#endif
#if defined(LOOM_HAS_MPI) && defined(LOOM_HAS_CUDA)
    if (!o.child_out.empty() && o.child_backend == "nccl") {
      switch (o.ranks) {
        case 1: return nccl_child<1>(argc, argv, o);
        case 2: return nccl_child<2>(argc, argv, o);
        case 4: return nccl_child<4>(argc, argv, o);
        case 8: return nccl_child<8>(argc, argv, o);
        default: throw Error("loom: -g must be 1, 2, 4 or 8 for nccl");
      }
    }
#endif
    std::vector<Row> rows;
    for (std::size_t bytes : sizes(o)) {
      if (bytes < 4096) continue;
      const double gbps = memcpy_gbps(bytes);
      rows.push_back(make_row("memcpy", "host", "memcpy", 1, bytes, static_cast<double>(bytes) / gbps / 1e3, 1, true));
    }
    for (const auto& b : o.backends) {
      if (b == "local") {
        local_rows(o, rows);
      } else if (b == "mpi" || b == "nccl") {
#ifdef LOOM_HAS_MPI
#ifndef LOOM_HAS_CUDA
        LOOM_CHECK(b != "nccl", "this build has no CUDA (configure with LOOM_WITH_CUDA=ON)");
#endif
        // Relaunch this program under mpirun, one process per rank, for these rows.
        const std::string out = "/tmp/loom-collectives-" + b + "-" + std::to_string(::getpid()) + ".json";
        std::ostringstream cmd;
        cmd << "mpirun --oversubscribe --bind-to none -np " << o.ranks << " " << argv[0] << " --child-out " << out
            << " --child-backend " << b;
        for (int i = 1; i < argc; ++i) {
          const std::string a = argv[i];
          if (a == "--json" || a == "--backends") { ++i; continue; }
          cmd << " '" << a << "'";
        }
        std::fflush(stdout);
        const int rc = std::system(cmd.str().c_str());
        std::ifstream f(out);
        LOOM_CHECK(rc == 0 && f, "the ", b, " part failed (", cmd.str(), " exited with ", rc, ")");
        auto more = nlohmann::json::parse(f).get<std::vector<Row>>();
        rows.insert(rows.end(), more.begin(), more.end());
        std::remove(out.c_str());
#else
        throw Error("loom: this build has no MPI (configure with LOOM_WITH_MPI=ON)");
#endif
      } else {
        throw Error("loom: unknown backend '" + b + "' (local, mpi, nccl)");
      }
    }
    print(rows);
    if (!o.json.empty()) {
      const std::string tmp = o.json + ".tmp";
      {
        std::ofstream f(tmp);
        for (const auto& r : rows) f << nlohmann::json(r).dump() << "\n";
        LOOM_CHECK(f.good(), "cannot write ", tmp);
      }
      LOOM_CHECK(std::rename(tmp.c_str(), o.json.c_str()) == 0, "cannot rename ", tmp, " to ", o.json);
    }
    for (const auto& r : rows)
      if (!r.ok) return 1;
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

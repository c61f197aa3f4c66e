// Typed stages: a pipeline of chunks over two resources overlaps them, records a trace that shows it, reports a
// stage's failure to the caller, runs on workers that persist per rank, and waits for the completions stages return.
#include "catch.hpp"
#include "temp_dir.hpp"

#include <loom/exec/graph.hpp>
#include <loom/exec/pipeline.hpp>

#include <atomic>
#include <memory>
#include <mutex>

#include <chrono>
#include <dirent.h>
#include <filesystem>
#include <fstream>
#include <sys/stat.h>
#include <stdexcept>
#include <thread>

using namespace loom;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

struct ComputeChunk {
  static constexpr const char* name = "compute chunk";
  std::chrono::milliseconds cost;
  double operator()(std::size_t i) const {
    std::this_thread::sleep_for(cost);
    return static_cast<double>(i) * 2;
  }
};
struct ReduceChunk {
  static constexpr const char* name = "reduce chunk";
  std::chrono::milliseconds cost;
  std::vector<double>* out;
  void operator()(double x) const {
    std::this_thread::sleep_for(cost);
    out->push_back(x);
  }
};

int thread_count() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n - 2;  // . and ..
}

}  // namespace

TEST_CASE("two stages on two resources overlap: fill + n * max(stage), not n * sum", "[exec]") {
  std::vector<double> got;
  using P = exec::Pipeline<exec::Stage<exec::Compute, ComputeChunk>, exec::Stage<exec::Comm, ReduceChunk>>;
  P p(ComputeChunk{40ms}, ReduceChunk{40ms, &got});
  const int n = 8;
  const auto t0 = Clock::now();
  p.run(n);
  const auto elapsed = Clock::now() - t0;
  // Serial: 8 * 80 = 640 ms. Overlapped: 40 + 8 * 40 = 360 ms.
  CHECK(elapsed < 520ms);
  CHECK(elapsed >= 360ms);
  REQUIRE(got.size() == n);
  for (int i = 0; i < n; ++i) CHECK(got[i] == 2.0 * i);  // chunks keep their order on a resource
  CHECK(p.result<0>(5) == 10.0);
}

TEST_CASE("stages on one resource run one at a time, in order", "[exec]") {
  std::vector<double> got;
  exec::Pipeline<exec::Stage<exec::Compute, ComputeChunk>, exec::Stage<exec::Compute, ReduceChunk>> p(
      ComputeChunk{20ms}, ReduceChunk{20ms, &got});
  const auto t0 = Clock::now();
  p.run(5);
  CHECK(Clock::now() - t0 >= 200ms);  // 5 * (20 + 20): nothing overlaps on one resource
  CHECK(got == std::vector<double>{0, 2, 4, 6, 8});
}

namespace {
std::string read_file(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
}  // namespace

TEST_CASE("the trace shows the stages of two resources running at once", "[exec][trace]") {
  test::TempDir dir("trace");
  const std::string file = dir / "trace.json";
  trace::clear();
  trace::start(file);
  trace::set_rank(3);
  std::vector<double> got;
  exec::Pipeline<exec::Stage<exec::Compute, ComputeChunk>, exec::Stage<exec::Comm, ReduceChunk>> p(
      ComputeChunk{15ms}, ReduceChunk{15ms, &got});
  p.run(4);
  CHECK(trace::destination() == file);
  CHECK_FALSE(std::filesystem::exists(file));
  trace::stop();  // writes the file, and forgets it: nothing is written at exit
  CHECK(trace::destination().empty());
  REQUIRE(std::filesystem::is_regular_file(file));
  const auto spans = trace::spans();
  REQUIRE(spans.size() == 8);
  int overlaps = 0;
  for (const auto& a : spans)
    for (const auto& b : spans)
      if (a.resource == "compute" && b.resource == "comm" && a.begin_us < b.end_us && b.begin_us < a.end_us) ++overlaps;
  CHECK(overlaps >= 2);
  for (const auto& s : spans) {
    CHECK(s.rank == 3);
    CHECK((s.name == "compute chunk" || s.name == "reduce chunk"));
  }
  for (const std::string& f : {file, dir / "again.json"}) {
    if (f != file) trace::write(f);  // the spans stay until clear()
    const std::string text = read_file(f);
    CHECK(text.find("\"traceEvents\"") != std::string::npos);
    CHECK(text.find("\"name\": \"reduce chunk\", \"cat\": \"comm\", \"pid\": 3") != std::string::npos);
    CHECK(text.find("\"thread_name\", \"pid\": 3") != std::string::npos);
  }
  CHECK_FALSE(std::filesystem::exists(file + ".tmp"));
  trace::clear();
}

TEST_CASE("the trace never replaces what is not a regular file", "[exec][trace]") {
  test::TempDir dir("trace");
  const std::string fifo = dir / "pipe", sub = dir / "sub";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::filesystem::create_directory(sub);
  trace::clear();
  trace::start(fifo);
  trace::record("span", "compute", 0, 1);
  REQUIRE_THROWS_WITH(trace::stop(), "loom: the trace file '" + fifo +
                                         "' exists and is not a regular file; the trace is not written");
  CHECK(trace::destination().empty());
  REQUIRE_THROWS_WITH(trace::write(sub), "loom: the trace file '" + sub +
                                             "' exists and is not a regular file; the trace is not written");
  struct stat st {};
  REQUIRE(::lstat(fifo.c_str(), &st) == 0);
  CHECK(S_ISFIFO(st.st_mode));
  CHECK(std::filesystem::is_directory(sub));
  CHECK_FALSE(std::filesystem::exists(fifo + ".tmp"));
  trace::clear();
}

struct Throws {
  void operator()(std::size_t i) const {
    if (i == 2) throw std::runtime_error("chunk 2 is broken");
  }
};
struct Slow {
  void operator()(std::size_t) const { std::this_thread::sleep_for(5ms); }
};

TEST_CASE("a stage's exception reaches the caller; a rank's workers persist across runs and end with it", "[exec]") {
  const int before = thread_count();
  std::thread rank([&] {
    exec::Pipeline<exec::Stage<exec::Compute, Throws>, exec::Stage<exec::Comm, Slow>> p(Throws{}, Slow{});
    CHECK_THROWS_WITH(p.run(10), "chunk 2 is broken");
    CHECK(thread_count() == before + 3);  // this rank and its Compute and Comm workers
    p.run(2);  // usable again, on the same workers
    exec::Pipeline<exec::Stage<exec::Comm, Slow>, exec::Stage<exec::Compute, Slow>> q(Slow{}, Slow{});
    q.run(3);  // another pipeline of the rank: the same two workers
    CHECK(thread_count() == before + 3);
    CHECK(exec::detail::Workers::of_this_thread().started() == 2);
  });
  rank.join();
  CHECK(thread_count() == before);
}

namespace {
//! A completion that finishes `delay` after it is made, on a thread of its own, and records that it was awaited.
struct Later {
  std::shared_ptr<std::atomic<bool>> finished = std::make_shared<std::atomic<bool>>(false);
  std::thread t;
  explicit Later(std::chrono::milliseconds delay)
      : t([f = finished, delay] { std::this_thread::sleep_for(delay), f->store(true); }) {}
  Later(Later&&) = default;
  ~Later() {
    if (t.joinable()) t.join();
  }
  void wait() {
    if (t.joinable()) t.join();
  }
};
struct Start {
  exec::Pending<std::size_t, Later> operator()(std::size_t i) const { return {i, Later(20ms)}; }
};
struct Use {
  std::vector<int>* seen;
  Later operator()(exec::Pending<std::size_t, Later>& in) const {
    seen->at(in.value) = in.done.finished->load() ? 1 : -1;  // 1: stage 0's work had finished
    return Later(30ms);
  }
};
}  // namespace

TEST_CASE("completions join the dependency graph: the next stage and run() wait for them", "[exec]") {
  std::vector<int> seen(4, 0);
  exec::Pipeline<exec::Stage<exec::Compute, Start>, exec::Stage<exec::Comm, Use>> p(Start{}, Use{&seen});
  p.run(4);
  CHECK(seen == std::vector<int>{1, 1, 1, 1});
  for (std::size_t i = 0; i < 4; ++i) CHECK(p.result<1>(i).finished->load());  // run() waited for the last stage's
}

TEST_CASE("a graph runs tasks on their resources in order, each after the data it reads", "[exec]") {
  // Compute produces a, then b; P2p "sends" a once it exists, leaving the transfer running (a Later); Compute's
  // third task reads what the transfer delivered. The transfer overlaps Compute's second task.
  std::vector<std::string> log;
  std::mutex m;
  auto note = [&](std::string s) {
    std::lock_guard lk(m);
    log.push_back(std::move(s));
  };
  std::shared_ptr<std::atomic<bool>> delivered;
  exec::Graph g;
  const auto a = g.add<exec::Compute>("a", [&] { note("a"); });
  const auto send = g.add<exec::P2p>("send a", [&] {
    note("send a");
    Later t(60ms);
    delivered = t.finished;
    return t;
  }, {a});
  g.add<exec::Compute>("b", [&] { std::this_thread::sleep_for(20ms), note("b"); });
  g.add<exec::Compute>("use a", [&] { note(delivered->load() ? "use a after delivery" : "use a too early"); }, {send});
  const auto t0 = Clock::now();
  g.run();
  CHECK(Clock::now() - t0 < 120ms);  // b ran while a was in flight: 60 ms, not 80
  REQUIRE(log.size() == 4);
  CHECK(log.front() == "a");
  CHECK(log.back() == "use a after delivery");
  CHECK_THROWS_WITH(g.add<exec::Compute>("late", [] {}, {g.size()}),
                    Catch::Contains("a task may depend only on tasks added before it"));
}

TEST_CASE("a graph's failure reaches the caller and stops the tasks that depend on it", "[exec]") {
  exec::Graph g;
  bool ran = false;
  const auto bad = g.add<exec::Comm>("bad", [] { throw std::runtime_error("the exchange failed"); });
  g.add<exec::Compute>("after", [&] { ran = true; }, {bad});
  CHECK_THROWS_WITH(g.run(), "the exchange failed");
  CHECK_FALSE(ran);
}

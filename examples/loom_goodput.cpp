// loom-goodput: how much of a long run's wall time goes to useful steps when its GPUs fail, with checkpoints to disk
// at the Young/Daly interval and with in-memory snapshots on peers. A discrete-event simulation: failures arrive as a
// Poisson process at the job's rate (the GPUs' count over the mean time to failure of one GPU, by default Meta's
// 7.9 hours at 1,024 GPUs); the run works in intervals, each closed by a checkpoint (disk: C seconds, blocking) or a
// snapshot (memory: S seconds); a failure loses the work since the last one closed and costs a restart (R seconds)
// and a reload (C from disk, S from a peer's memory), and a failure during a restart starts it again. Printed beside
// each: the Young/Daly first-order estimate at interval τ, (1 - (τ/2 + C/2 + R + reload)/M)·τ/(τ + C), which at
// τ = sqrt(2CM) is about 1 - sqrt(2C/M) - (R + reload)/M.
//   loom-goodput --gpus N [--mttf-hours H] [--checkpoint-s C] [--restart-s R] [--snapshot-s S] [--interval-s I]
//                [--days D] [--seed S] [--json FILE]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

namespace {

const char* const usage =
    "usage: loom-goodput --gpus N [--mttf-hours H] [--checkpoint-s C] [--restart-s R] [--snapshot-s S]\n"
    "                    [--interval-s I] [--days D] [--seed S] [--json FILE]\n"
    "  --mttf-hours: the job's mean time to failure (default: 7.9 h x 1024 / N, Meta's per-GPU rate)\n"
    "  --checkpoint-s (60), --restart-s (120), --snapshot-s (1): the costs; --interval-s: the disk checkpoints'\n"
    "  interval (default Young/Daly's sqrt(2 C M)); --days (30), --seed (1): the simulated run\n";

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "loom-goodput: %s\n", what.c_str());
  std::exit(1);
}

double number(const std::string& flag, const char* v) {
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (!*v || *end || !std::isfinite(x)) fail(flag + " takes a number, got '" + v + "'");
  if (x < 0) fail(flag + " must not be negative, got " + v);
  return x;
}

struct Outcome {
  double useful = 0, wall = 0;
  long failures = 0;
  double effective() const { return wall > 0 ? useful / wall : 0; }
};

//! A run of `wall` seconds: intervals of `interval` seconds of work, each closed by `close` seconds of saving; a
//! failure costs `restart` + `reload` seconds and the work of the open interval.
Outcome simulate(double wall, double mttf, double interval, double close, double restart, double reload,
                 std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> next_failure(1.0 / mttf);
  Outcome o;
  double t = 0, fail_at = next_failure(rng);
  while (t < wall) {
    // An interval of work and its save, unless a failure comes first.
    const double end = t + interval + close;
    if (fail_at >= std::min(end, wall)) {  // (a failure after the run's end does not count)
      o.useful += std::min(interval, std::max(0.0, wall - t));
      t = end;
      continue;
    }
    // The failure: the open interval is lost; restart and reload, again while failures interrupt them.
    ++o.failures;
    t = fail_at;
    fail_at = t + next_failure(rng);
    while (fail_at < t + restart + reload) {
      ++o.failures;
      t = fail_at;
      fail_at = t + next_failure(rng);
    }
    t += restart + reload;
  }
  o.wall = wall;
  return o;
}

//! Young/Daly's first-order effective fraction at interval tau.
double young_daly(double mttf, double interval, double close, double restart, double reload) {
  return (1 - (interval / 2 + close / 2 + restart + reload) / mttf) * interval / (interval + close);
}

}  // namespace

int main(int argc, char** argv) {
  double gpus = 0, mttf_h = 0, checkpoint = 60, restart = 120, snapshot = 1, interval = 0, days = 30;
  std::uint64_t seed = 1;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "-h" || f == "--help") {
      std::fputs(usage, stdout);
      return 0;
    }
    if (i + 1 >= argc) fail(f + " needs a value\n" + usage);
    const char* v = argv[++i];
    if (f == "--gpus") gpus = number(f, v);
    else if (f == "--mttf-hours") mttf_h = number(f, v);
    else if (f == "--checkpoint-s") checkpoint = number(f, v);
    else if (f == "--restart-s") restart = number(f, v);
    else if (f == "--snapshot-s") snapshot = number(f, v);
    else if (f == "--interval-s") interval = number(f, v);
    else if (f == "--days") days = number(f, v);
    else if (f == "--seed") seed = static_cast<std::uint64_t>(number(f, v));
    else if (f == "--json") json = v;
    else fail("unknown flag " + f + "\n" + usage);
  }
  if (gpus < 1) fail(std::string("--gpus N is required (at least 1)\n") + usage);
  if (days <= 0) fail("--days must be positive");
  if (checkpoint <= 0 && interval <= 0) fail("--checkpoint-s 0 needs --interval-s (Young/Daly's interval is 0)");
  if (snapshot <= 0) fail("--snapshot-s must be positive");
  // Meta (HPCA'25): 7.9 hours between failures at 1,024 GPUs, a rate proportional to the GPUs.
  const double mttf = (mttf_h > 0 ? mttf_h : 7.9 * 1024 / gpus) * 3600;
  const double wall = days * 86400;
  const double disk_tau = interval > 0 ? interval : std::sqrt(2 * checkpoint * mttf);
  const double mem_tau = std::sqrt(2 * snapshot * mttf);
  const Outcome disk = simulate(wall, mttf, disk_tau, checkpoint, restart, checkpoint, seed);
  const Outcome mem = simulate(wall, mttf, mem_tau, snapshot, restart, snapshot, seed);
  const double disk_yd = young_daly(mttf, disk_tau, checkpoint, restart, checkpoint);
  const double mem_yd = young_daly(mttf, mem_tau, snapshot, restart, snapshot);
  std::printf("loom-goodput: %.0f GPUs, job MTTF %.2f h, %.0f days, %ld failures (disk run)\n", gpus, mttf / 3600,
              days, disk.failures);
  std::printf("%-22s %12s %12s %14s %14s\n", "", "interval s", "cost s", "effective", "Young/Daly");
  std::printf("%-22s %12.0f %12.1f %13.2f%% %13.2f%%\n", "checkpoints to disk", disk_tau, checkpoint,
              100 * disk.effective(), 100 * disk_yd);
  std::printf("%-22s %12.0f %12.1f %13.2f%% %13.2f%%\n", "snapshots in memory", mem_tau, snapshot,
              100 * mem.effective(), 100 * mem_yd);
  if (!json.empty()) {
    const std::string tmp = json + ".tmp";
    {
      std::ofstream out(tmp);
      if (!out) fail("cannot write " + tmp);
      out.precision(6);
      out << "{\"gpus\": " << gpus << ", \"mttf_hours\": " << mttf / 3600 << ", \"days\": " << days
          << ", \"failures\": " << disk.failures << ", \"disk_interval_s\": " << disk_tau
          << ", \"memory_interval_s\": " << mem_tau << ", \"effective_disk\": " << disk.effective()
          << ", \"effective_memory\": " << mem.effective() << ", \"young_daly_disk\": " << disk_yd
          << ", \"young_daly_memory\": " << mem_yd << "}\n";
      if (!out) fail("writing " + tmp + " failed");
    }
    std::filesystem::rename(tmp, json);
  }
  return 0;
}

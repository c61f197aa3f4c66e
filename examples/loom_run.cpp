// loom-run: keeps a training job going through failures. It runs the command (train_gpt on threads, or mpirun of
// it) in a process group of its own, with LOOM_HEARTBEAT_DIR naming a folder where every process of the job beats
// (<loom/core/heartbeat.hpp>); when the command exits abnormally, when a process that beat is gone, or when one has
// not beaten for --heartbeat-s seconds (frozen), it ends the whole job and runs the command again, which continues
// from the newest complete checkpoint (train_gpt --save DIR --save-every N --auto-resume). Each failure is logged
// with its cause, the process, the step it was at, the newest complete state's step (a checkpoint or an in-memory
// snapshot, as the processes last reported it) and so the most steps of work lost; once the next attempt reports the
// step it starts from, the steps it does again.
//   loom-run [--max-restarts N] [--heartbeat-s S] [--log FILE] -- COMMAND ARGS...
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

namespace {

namespace fs = std::filesystem;

//! A signal that asks loom-run itself to stop (SIGINT, SIGTERM, SIGHUP): the job is ended with it.
volatile std::sig_atomic_t stop_signal = 0;
extern "C" void on_stop(int sig) { stop_signal = sig; }
using Clock = std::chrono::steady_clock;

const char* const usage =
    "usage: loom-run [--max-restarts N] [--heartbeat-s S] [--log FILE]\n"
    "                [--min-ranks R --ranks-available CMD --fallback-parallel SPEC[;SPEC...]] -- COMMAND ARGS...\n"
    "  runs COMMAND; when a process of it exits abnormally, disappears, or stops beating for S seconds (default\n"
    "  10), ends the job and runs COMMAND again (at most N more times, default 3), which continues from its newest\n"
    "  complete state (train_gpt --save DIR --save-every K [--snapshot-every K] --auto-resume). --log FILE: the\n"
    "  failures as JSON lines. Elastic: before each restart CMD (run by sh) prints how many ranks the machines can\n"
    "  give; with fewer than the job's, COMMAND runs on the first fallback layout that fits, with at least R ranks\n"
    "  (its --parallel, and mpirun's -np, rewritten); with fewer than R, loom-run stops.\n";

struct Options {
  int max_restarts = 3;
  double heartbeat_s = 10;
  std::string log;
  int min_ranks = 0;                    //!< --min-ranks: elastic restarts on no fewer ranks
  std::string ranks_available;          //!< --ranks-available CMD: prints the ranks the machines can give now
  std::vector<std::string> fallbacks;   //!< --fallback-parallel: layouts to restart on, in order of preference
  std::vector<std::string> command;
};

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "loom-run: %s\n", what.c_str());
  std::exit(2);
}

double number(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || !end || *end) fail(flag + " takes a number, got '" + v + "'");
  return x;
}

//! The ranks a train_gpt layout runs on: the product of its tp, cp, pp and dp degrees ("tp2.dp4", "tp2,sp,dp4");
//! 0 where SPEC says none.
int ranks_of(const std::string& spec) {
  int n = 1;
  bool any = false;
  std::string part;
  std::stringstream ss(spec);
  while (std::getline(ss, part, spec.find(',') != std::string::npos ? ',' : '.')) {
    for (const char* axis : {"tp", "cp", "pp", "dp"})
      if (part.rfind(axis, 0) == 0 && part.size() > 2 && std::isdigit(static_cast<unsigned char>(part[2])))
        n *= std::atoi(part.c_str() + 2), any = true;
  }
  return any ? n : 0;
}

//! Where a command says its layout: the index of --parallel's value, and of mpirun's -np (or -n) value (-1: none).
struct Layout {
  int parallel = -1, np = -1;
};
Layout layout_in(const std::vector<std::string>& command) {
  Layout at;
  for (std::size_t i = 0; i + 1 < command.size(); ++i) {
    if (command[i] == "--parallel") at.parallel = int(i + 1);
    if ((command[i] == "-np" || command[i] == "-n") && at.parallel < 0) at.np = int(i + 1);
  }
  return at;
}
//! The ranks the command runs on (0: it does not say).
int job_ranks(const std::vector<std::string>& command) {
  const Layout at = layout_in(command);
  return at.parallel < 0 ? 0 : ranks_of(command[std::size_t(at.parallel)]);
}

Options parse(int argc, char** argv) {
  Options o;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--") {
      ++i;
      break;
    }
    if (f == "-h" || f == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) fail(f + " needs a value\n" + usage);
    const std::string v = argv[++i];
    if (f == "--max-restarts") o.max_restarts = int(number(f, v));
    else if (f == "--heartbeat-s") o.heartbeat_s = number(f, v);
    else if (f == "--log") o.log = v;
    else if (f == "--min-ranks") o.min_ranks = int(number(f, v));
    else if (f == "--ranks-available") o.ranks_available = v;
    else if (f == "--fallback-parallel") {
      std::stringstream ss(v);
      for (std::string spec; std::getline(ss, spec, ';');)
        if (!spec.empty()) o.fallbacks.push_back(spec);
    } else fail("unknown flag " + f + "\n" + usage);
  }
  for (; i < argc; ++i) o.command.emplace_back(argv[i]);
  if (o.command.empty()) fail(std::string("no command to run (give it after --)\n") + usage);
  const bool elastic = o.min_ranks > 0 || !o.ranks_available.empty() || !o.fallbacks.empty();
  if (elastic && (o.min_ranks < 1 || o.ranks_available.empty() || o.fallbacks.empty()))
    fail("an elastic job needs --min-ranks R (at least 1), --ranks-available CMD and --fallback-parallel SPEC");
  for (const auto& spec : o.fallbacks)
    if (ranks_of(spec) < o.min_ranks)
      fail("--fallback-parallel " + spec + " runs on " + std::to_string(ranks_of(spec)) + " ranks, fewer than " +
           "--min-ranks " + std::to_string(o.min_ranks));
  if (elastic && job_ranks(o.command) < 1)
    fail("an elastic job's command must say its layout: train_gpt's --parallel SPEC (and mpirun's -np N)");
  if (o.max_restarts < 0) fail("--max-restarts must not be negative, got " + std::to_string(o.max_restarts));
  if (!(o.heartbeat_s > 0)) fail("--heartbeat-s must be positive");
  return o;
}

//! One process's last beat.
struct Beat {
  int pid = 0, step = -1, saved = -1;
  long long unix_ms = 0;
  std::string ranks = "-";  //!< the world ranks the process runs
};

std::map<int, Beat> read_beats(const fs::path& dir) {
  std::map<int, Beat> beats;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("beat-", 0) != 0 || name.find(".tmp") != std::string::npos) continue;
    std::ifstream f(e.path());
    Beat b;
    if (f >> b.pid >> b.step >> b.saved >> b.unix_ms) {
      if (!(f >> b.ranks)) b.ranks = "-";
      beats[b.pid] = b;
    }
  }
  return beats;
}

long long now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

//! What ended an attempt.
struct Failure {
  std::string cause{};   //!< "exited with status 1", "killed by signal 9", "gone", "frozen"
  int pid = 0;           //!< the process it concerns (the command's own, or a process that beat)
  int step = -1;         //!< the step that process was at (-1: unknown)
  int saved = -1;        //!< the newest complete state any process reported
  double detect_s = -1;  //!< frozen: seconds from its last beat to the decision
  long long detected_ms = 0;  //!< when loom-run saw it (Unix milliseconds)
  std::string ranks{};        //!< the world ranks of the process (empty: not known)
  double step_s = -1;         //!< the attempt's seconds per step, from its beats (-1: not known)
};

//! What the next attempt is told of the failures before it: the furthest step reached, and the last failure's.
struct Before {
  int failed_at = -1;
  long long detected_ms = 0;
  double detect_s = -1, step_s = -1;
};

//! Runs the command once, to its end or its failure. std::nullopt: it succeeded. Once a process of it reports the
//! step it starts from, what the failure before cost is logged: the restart's seconds (from the failure's detection),
//! the steps to be done again, and the time lost in all.
std::optional<Failure> attempt(const Options& o, const std::vector<std::string>& command, const fs::path& dir, int n,
                               const Before& before, std::ofstream& log) {
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir);
  const pid_t child = fork();
  if (child < 0) fail(std::string("fork: ") + std::strerror(errno));
  if (child == 0) {
    setpgid(0, 0);  // the job's own group, so that ending it ends every process it started
    setenv("LOOM_HEARTBEAT_DIR", dir.c_str(), 1);
    setenv("LOOM_HEARTBEAT_INTERVAL_S", std::to_string(std::max(0.05, o.heartbeat_s / 5)).c_str(), 1);
    setenv("LOOM_RUN_ATTEMPT", std::to_string(n).c_str(), 1);
    std::vector<char*> args;
    for (const auto& s : command) args.push_back(const_cast<char*>(s.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    std::fprintf(stderr, "loom-run: cannot run %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(child, child);
  const long long limit_ms = static_cast<long long>(o.heartbeat_s * 1000);
  std::optional<Failure> failure;
  int saved = -1;
  bool resumed = n == 0;
  int first_step = -1, last_step = -1;  // the steps the beats reported first and last, and when
  long long first_ms = 0, last_ms = 0;
  for (;;) {
    int status = 0;
    const pid_t done = waitpid(child, &status, WNOHANG);
    const auto beats = read_beats(dir);
    for (const auto& [pid, b] : beats) {
      saved = std::max(saved, b.saved);
      if (b.step < 0) continue;
      if (first_step < 0) first_step = b.step, first_ms = b.unix_ms;
      if (b.step > last_step) last_step = b.step, last_ms = b.unix_ms;
    }
    for (const auto& [pid, b] : beats) {
      if (resumed || b.step < 0) continue;
      resumed = true;
      const int redone = before.failed_at >= 0 ? std::max(0, before.failed_at - b.step) : -1;
      const double restart = double(now_ms() - before.detected_ms) / 1000;
      std::fprintf(stderr, "loom-run: attempt %d starts at step %d, %.1f s after the failure was seen", n, b.step,
                   restart);
      double lost = restart + std::max(0.0, before.detect_s);
      if (redone >= 0) std::fprintf(stderr, ": %d step%s to do again", redone, redone == 1 ? "" : "s");
      if (redone >= 0 && before.step_s > 0) {
        lost += redone * before.step_s;
        std::fprintf(stderr, ", about %.1f s lost in all", lost);
      }
      std::fprintf(stderr, "\n");
      if (log.is_open())
        log << "{\"attempt\": " << n << ", \"starts_at\": " << b.step << ", \"redone_steps\": " << redone
            << ", \"restart_s\": " << restart << ", \"lost_s\": " << lost << "}\n" << std::flush;
    }
    if (done == child) {
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) break;
      Failure f;
      f.pid = child, f.saved = saved;
      f.cause = WIFEXITED(status) ? "exited with status " + std::to_string(WEXITSTATUS(status))
                                  : "killed by signal " + std::to_string(WTERMSIG(status));
      if (WIFEXITED(status) && WEXITSTATUS(status) == 127 && beats.empty())
        f.cause = "could not be started (exit status 127)";
      if (const auto it = beats.find(child); it != beats.end() && it->second.ranks != "-") f.ranks = it->second.ranks;
      for (const auto& [pid, b] : beats) f.step = std::max(f.step, b.step);
      failure = f;
      break;
    }
    if (stop_signal) {
      failure = Failure{.cause = "stopped: loom-run got signal " + std::to_string(stop_signal), .pid = child,
                        .saved = saved};
      break;
    }
    const long long t = now_ms();
    for (const auto& [pid, b] : beats) {
      // Gone: its process is not there, and its file is (a process that ends normally removes it before it exits).
      if (pid != child && kill(pid, 0) != 0 && errno == ESRCH && fs::exists(dir / ("beat-" + std::to_string(pid)))) {
        failure = Failure{.cause = "gone", .pid = pid, .step = b.step, .saved = saved};
      } else if (t - b.unix_ms > limit_ms) {
        failure = Failure{.cause = "frozen", .pid = pid, .step = b.step, .saved = saved,
                          .detect_s = double(t - b.unix_ms) / 1000};
      }
      if (failure) {
        if (b.ranks != "-") failure->ranks = b.ranks;
        break;
      }
    }
    if (failure) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (failure) {
    failure->detected_ms = now_ms();
    if (last_step > first_step) failure->step_s = double(last_ms - first_ms) / 1000 / (last_step - first_step);
  }
  // End whatever is left of the job: its group, and every process that beat (mpirun's may have groups of their own),
  // and wait until they are gone, so that the next attempt starts on a clean machine (a GPU's memory freed).
  kill(-child, SIGKILL);
  std::vector<int> left;
  for (const auto& [pid, b] : read_beats(dir))
    if (kill(pid, SIGKILL) == 0) left.push_back(pid);
  int status = 0;
  while (waitpid(child, &status, 0) < 0 && errno == EINTR) {  // (ECHILD where the loop reaped it)
  }
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (int pid : left)
    while (kill(pid, 0) == 0 && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  fs::remove_all(dir, ec);
  return failure;
}

//! Elastic restarts: asks --ranks-available how many ranks there are; where fewer than the command's, rewrites it
//! for the first fallback layout that fits (its --parallel, and mpirun's -np). False where none fits.
bool shrink_if_needed(const Options& o, std::vector<std::string>& command, std::ofstream& log) {
  std::string out;
  if (std::FILE* p = popen(o.ranks_available.c_str(), "r")) {
    char buf[256];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    if (pclose(p) != 0) out.clear();
  }
  char* end = nullptr;
  const long available = std::strtol(out.c_str(), &end, 10);
  if (out.empty() || end == out.c_str()) {
    std::fprintf(stderr, "loom-run: --ranks-available '%s' printed no number ('%s'); restarting as before\n",
                 o.ranks_available.c_str(), out.c_str());
    return true;
  }
  const int now = job_ranks(command);
  if (available >= now) return true;
  const Layout at = layout_in(command);
  for (const auto& spec : o.fallbacks) {
    const int n = ranks_of(spec);
    if (n > available || n >= now) continue;
    std::fprintf(stderr, "loom-run: %ld ranks available, the job runs on %d: restarting on --parallel %s (%d ranks)\n",
                 available, now, spec.c_str(), n);
    if (log.is_open()) log << "{\"available\": " << available << ", \"from\": \"" << command[std::size_t(at.parallel)]
                           << "\", \"to\": \"" << spec << "\", \"ranks\": " << n << "}\n" << std::flush;
    command[std::size_t(at.parallel)] = spec;
    if (at.np >= 0) command[std::size_t(at.np)] = std::to_string(n);
    return true;
  }
  std::fprintf(stderr, "loom-run: %ld ranks available, fewer than the job's %d, and no --fallback-parallel layout "
               "runs on at least --min-ranks %d and at most %ld: stopping\n", available, now, o.min_ranks, available);
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const char* tmp = std::getenv("TMPDIR");
  const fs::path base = fs::path(tmp && *tmp ? tmp : "/tmp") / ("loom-run-" + std::to_string(getpid()));
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, on_stop);
  std::ofstream log;
  if (!o.log.empty()) {
    log.open(o.log, std::ios::app);
    if (!log) fail("cannot write --log " + o.log);
  }
  const auto t0 = Clock::now();
  Before before;
  std::vector<std::string> command = o.command;  // an elastic restart changes its layout
  for (int n = 0;; ++n) {
    const auto a0 = Clock::now();
    // A folder per attempt: a late beat of the last one's processes cannot pass for this one's.
    const std::optional<Failure> f = attempt(o, command, base / ("attempt-" + std::to_string(n)), n, before, log);
    const double secs = std::chrono::duration<double>(Clock::now() - a0).count();
    if (!f) {
      std::printf("loom-run: the job finished after %d restart%s (%.1f s)\n", n, n == 1 ? "" : "s",
                  std::chrono::duration<double>(Clock::now() - t0).count());
      return 0;
    }
    std::ostringstream what;
    what << "attempt " << n << " failed after " << std::fixed;
    what.precision(1);
    what << secs << " s: process " << f->pid;
    if (!f->ranks.empty()) what << " (rank" << (f->ranks.find('-') != std::string::npos ? "s " : " ") << f->ranks << ")";
    what << " " << f->cause;
    if (f->detect_s >= 0) what << " (no beat for " << f->detect_s << " s)";
    if (f->step >= 0) what << " at step " << f->step;
    else what << " while starting";
    before = {std::max(before.failed_at, f->step), f->detected_ms, f->detect_s,
              f->step_s > 0 ? f->step_s : before.step_s};
    const int lost = f->step >= 0 ? f->step - std::max(0, f->saved) : -1;
    if (f->saved >= 0) what << "; the newest complete state is step " << f->saved;
    else what << "; no complete state yet";
    if (lost >= 0) what << ": at most " << lost << " step" << (lost == 1 ? "" : "s") << " of work lost";
    std::fprintf(stderr, "loom-run: %s\n", what.str().c_str());
    if (log.is_open()) {
      log << "{\"attempt\": " << n << ", \"seconds\": " << secs << ", \"pid\": " << f->pid << ", \"ranks\": \""
          << f->ranks << "\", \"cause\": \""
          << f->cause << "\", \"step\": " << f->step << ", \"saved\": " << f->saved << ", \"lost_steps\": " << lost
          << ", \"detect_s\": " << f->detect_s << ", \"detected_unix_ms\": " << f->detected_ms << "}\n";
      log.flush();
    }
    if (stop_signal) {
      std::fprintf(stderr, "loom-run: stopped by signal %d; the job was ended\n", int(stop_signal));
      std::error_code ec;
      fs::remove_all(base, ec);
      return 128 + stop_signal;
    }
    if (f->cause.rfind("could not be started", 0) == 0) {  // running it again would not start it either
      std::fprintf(stderr, "loom-run: the command could not be started; not restarting\n");
      return 1;
    }
    if (n >= o.max_restarts) {
      std::fprintf(stderr, "loom-run: giving up after %d restart%s (--max-restarts %d)\n", n, n == 1 ? "" : "s",
                   o.max_restarts);
      return 1;
    }
    if (!o.ranks_available.empty() && !shrink_if_needed(o, command, log)) return 1;
    std::fprintf(stderr, "loom-run: restarting (%d of %d)\n", n + 1, o.max_restarts);
  }
}

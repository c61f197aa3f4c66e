// What the benchmarks' command lines share: flags and their values, lists of sizes, the usage on --help, one line
// on stderr and exit status 1 for a refusal, and JSON records written to a temporary name and then renamed.
#pragma once

#include <loom/core/error.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace bench {

//! Walks argv flag by flag: on(flag) for each; value() gives the argument after the current flag, or refuses the
//! flag that lacks one. parse() prints `usage` and returns false on -h or --help.
class CommandLine {
 public:
  CommandLine(int argc, char** argv) : argc_(argc), argv_(argv) {}
  template <class On>
  bool parse(const char* usage, On&& on) {
    for (i_ = 1; i_ < argc_; ++i_) {
      const std::string flag = argv_[i_];
      if (flag == "-h" || flag == "--help") {
        std::fputs(usage, stdout);
        return false;
      }
      on(flag);
    }
    return true;
  }
  std::string value() {
    LOOM_CHECK(i_ + 1 < argc_, argv_[i_], " needs a value");
    return argv_[++i_];
  }

 private:
  int argc_;
  char** argv_;
  int i_ = 1;
};

//! "1,2,4" as {1, 2, 4}.
inline std::vector<int> int_list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stoi(x));
  return v;
}

//! One JSON record per line, in `path`, written to path.tmp first and renamed.
inline void write_json_lines(const std::string& path, const std::vector<nlohmann::json>& records) {
  {
    std::ofstream f(path + ".tmp");
    for (const auto& r : records) f << r.dump() << "\n";
    LOOM_CHECK(f.good(), "cannot write ", path, ".tmp");
  }
  LOOM_CHECK(std::rename((path + ".tmp").c_str(), path.c_str()) == 0, "cannot rename ", path, ".tmp to ", path);
}

//! The last line of JSON that `command` prints (a reference run: `what` names it in the error when it fails).
inline nlohmann::json run_json(const std::string& command, const std::string& what) {
  FILE* p = popen(command.c_str(), "r");
  LOOM_CHECK(p, "cannot run ", command);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  const int rc = pclose(p);
  LOOM_CHECK(rc == 0 && out.find('{') != std::string::npos, "the ", what, " reference failed (", command, ")");
  return nlohmann::json::parse(out.substr(out.rfind('{')));
}

//! Runs the benchmark's body: a refusal or failure is one line on stderr and exit status 1.
template <class Body>
int guarded(Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

}  // namespace bench

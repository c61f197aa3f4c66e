// A fresh directory under the system's temporary directory for a test's files, removed with everything in it when
// the test ends, so that tests write nowhere else and two runs at once never share a file.
#pragma once

#include <atomic>
#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <string>

#include <unistd.h>

namespace loom::test {

class TempDir {
 public:
  //! Makes <temp>/loom-<tag>-<pid>-<time>-<count>; a name that exists already is skipped.
  explicit TempDir(const std::string& tag = "test") {
    static std::atomic<unsigned> count{0};
    const auto base = std::filesystem::temp_directory_path();
    for (int attempt = 0; attempt < 100; ++attempt) {
      const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
      const auto p = base / ("loom-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(stamp) + "-" +
                             std::to_string(count++));
      if (std::filesystem::create_directory(p)) {
        path_ = p;
        return;
      }
    }
    throw std::runtime_error("cannot make a temporary directory under " + base.string());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  //! The path of `name` inside the directory.
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace loom::test

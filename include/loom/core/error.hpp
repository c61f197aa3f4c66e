// loom's exception types and the run-time check macro; every message starts with "loom:".
#pragma once

#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom {

//! Any failure loom reports at run time.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
//! A collective or point-to-point operation did not complete within the timeout.
struct TimeoutError : Error {
  using Error::Error;
};
//! Ranks of one group called different collectives, counts, dtypes, reductions or roots.
struct MismatchError : Error {
  using Error::Error;
};
//! This rank stopped because another rank failed.
struct AbortedError : Error {
  using Error::Error;
};
//! An error code returned by MPI, NCCL or CUDA.
struct BackendError : Error {
  using Error::Error;
};
//! What a run of ranks as threads throws when ranks failed: "loom: rank N failed: <its message>" for the rank that
//! failed on its own (the lowest-numbered when several did), with what every rank saw.
struct RankFailure : Error {
  RankFailure(int rank_, std::string what, std::vector<std::string> messages_, std::exception_ptr cause_)
      : Error(std::move(what)), rank(rank_), messages(std::move(messages_)), cause(std::move(cause_)) {}
  int rank;                           //!< the rank reported
  std::vector<std::string> messages;  //!< each rank's failure ("" for a rank that returned normally)
  std::exception_ptr cause;           //!< what that rank threw, as it was thrown
};

namespace detail {
template <class... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace loom

//! Throws loom::Error("loom: " + message) when cond is false; the message is streamed: LOOM_CHECK(n > 0, "n=", n).
#define LOOM_CHECK(cond, ...)                                                   \
  do {                                                                          \
    if (!(cond)) throw ::loom::Error(::loom::detail::cat("loom: ", __VA_ARGS__)); \
  } while (0)

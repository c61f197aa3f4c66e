// The vocabulary every communicator shares: reductions, collective kinds, the type-erased operation a backend
// executes, point-to-point operations for batches, groups, and the handle an asynchronous operation returns.
#pragma once

#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/launch.hpp>

#include <array>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <future>
#include <iostream>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace loom::comm {

enum class Reduce : std::uint8_t { sum, avg, max, min, prod };

enum class Collective : std::uint8_t {
  all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all, all_to_all_v, send_recv, barrier
};

constexpr std::string_view name_of(Reduce r) {
  switch (r) {
    case Reduce::sum: return "sum";
    case Reduce::avg: return "avg";
    case Reduce::max: return "max";
    case Reduce::min: return "min";
    case Reduce::prod: return "prod";
  }
  return "?";
}

constexpr std::string_view name_of(Collective c) {
  switch (c) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_gather: return "all_gather";
    case Collective::broadcast: return "broadcast";
    case Collective::reduce: return "reduce";
    case Collective::all_to_all: return "all_to_all";
    case Collective::all_to_all_v: return "all_to_all_v";
    case Collective::send_recv: return "send/recv";
    case Collective::barrier: return "barrier";
  }
  return "?";
}

//! How the Local backend performs all_reduce; the others choose their own.
enum class Algorithm : std::uint8_t {
  automatic,         //!< Local: direct for small groups; else halving_doubling for small buffers, ring above
  ring,              //!< reduce-scatter then all-gather around a ring: 2(n-1) steps
  halving_doubling,  //!< Rabenseifner: recursive halving then doubling, 2 log2(n) steps
  direct             //!< each rank reduces its slice from every peer's buffer, then gathers: 2 steps
};

constexpr std::string_view name_of(Algorithm a) {
  switch (a) {
    case Algorithm::automatic: return "auto";
    case Algorithm::ring: return "ring";
    case Algorithm::halving_doubling: return "halving_doubling";
    case Algorithm::direct: return "direct";
  }
  return "?";
}

//! A contiguous buffer of loom elements: std::vector, std::array, std::span (over host or device memory).
template <class R>
concept Buffer = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
                 Element<std::ranges::range_value_t<R>>;

template <Buffer R>
using element_t = std::remove_cv_t<std::ranges::range_value_t<R>>;

//! One send or receive of a batch; peers are ranks inside the communicator's group.
struct P2P {
  enum class Kind : std::uint8_t { send, recv } kind;
  int peer;
  void* data;  // const for sends
  std::size_t count;
  DType dtype;
};

template <Buffer R>
P2P send_op(const R& data, int peer) {
  return {P2P::Kind::send, peer, const_cast<void*>(static_cast<const void*>(std::ranges::data(data))),
          std::ranges::size(data), dtype_of<element_t<R>>};
}
template <Buffer R>
P2P recv_op(R&& data, int peer) {
  return {P2P::Kind::recv, peer, static_cast<void*>(std::ranges::data(data)), std::ranges::size(data),
          dtype_of<element_t<R>>};
}

//! One operation as a backend sees it. `count` is per rank: all_reduce, broadcast, reduce: the buffer's length;
//! reduce_scatter: the received block (send holds size*count); all_gather: the sent block (recv holds size*count);
//! all_to_all: the block for one peer. all_to_all_v uses the four count/displacement arrays (one entry per peer).
struct Op {
  Collective kind = Collective::barrier;
  DType dtype = DType::f32;
  Reduce reduce = Reduce::sum;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;
  int root = 0;
  std::vector<std::size_t> send_counts, send_displs, recv_counts, recv_displs;
  std::vector<P2P> p2p;
  //! Where the operation is ordered. Empty: on the host, its buffers ready when it is issued and its results when
  //! it completes. Else a CUDA stream of the caller (a cudaStream_t; null is the legacy default stream): the
  //! operation reads what the work queued there before it wrote, and the work queued there once it has completed
  //! (a blocking call returned, an asynchronous one's wait()) reads what it wrote. Nccl orders its own stream by
  //! events and the host does not wait for the device; Local and Mpi synchronise the stream first.
  std::optional<void*> stream;
};

//! What a communicator has issued, counted where each operation starts: the operations of each kind, and the
//! elements this rank sends under the bandwidth-optimal algorithms (ring and its kin), over a group of n:
//! 2c(n-1)/n for an all-reduce of c; c(n-1) for a reduce-scatter that leaves c on each rank, an all-gather that
//! takes c from each, and an all-to-all of blocks of c; c(n-1)/n for a broadcast or reduce of c; what it sends to
//! the others in an all-to-all-v; the elements of its sends. Nothing over a group of one.
struct Traffic {
  std::array<std::int64_t, 9> calls{};  //!< by Collective
  double elements = 0;
  double bytes = 0;  //!< the same elements, each of its operation's element type

  std::int64_t count(Collective k) const { return calls[static_cast<std::size_t>(k)]; }
  //! Counts op, issued by rank `rank` of a group of n.
  void note(const Op& op, int n, int rank) {
    const double before = elements;
    count_elements(op, n, rank);
    const DType t = op.kind == Collective::send_recv && !op.p2p.empty() ? op.p2p.front().dtype : op.dtype;
    bytes += (elements - before) * static_cast<double>(size_of(t));
  }

 private:
  void count_elements(const Op& op, int n, int rank) {
    ++calls[static_cast<std::size_t>(op.kind)];
    if (n == 1) return;
    const double c = static_cast<double>(op.count), m = n - 1;
    switch (op.kind) {
      case Collective::all_reduce: elements += 2 * c * m / n; break;
      case Collective::reduce_scatter:
      case Collective::all_gather:
      case Collective::all_to_all: elements += c * m; break;
      case Collective::broadcast:
      case Collective::reduce: elements += c * m / n; break;
      case Collective::all_to_all_v:
        for (std::size_t q = 0; q < op.send_counts.size(); ++q)
          if (q != static_cast<std::size_t>(rank)) elements += static_cast<double>(op.send_counts[q]);
        break;
      case Collective::send_recv:
        for (const auto& p : op.p2p)
          if (p.kind == P2P::Kind::send) elements += static_cast<double>(p.count);
        break;
      case Collective::barrier: break;
    }
  }
};

//! Members of a group in global ranks, and the name messages use ("dp", "tp.pp", "world").
struct GroupInfo {
  std::string name;
  std::vector<int> ranks;

  std::string describe() const {
    std::string s = name;
    s += '{';
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(ranks[i]);
    }
    s += '}';
    return s;
  }
};

//! A pending asynchronous operation. wait() blocks until it completes and rethrows its failure; a handle dropped
//! without wait() waits in its destructor so that buffers are never freed under a running operation.
class [[nodiscard]] Handle {
 public:
  Handle() = default;
  explicit Handle(std::shared_future<void> done) : done_(std::move(done)) {}
  Handle(Handle&&) noexcept = default;
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      done_ = std::move(o.done_);
      then_ = std::move(o.then_);
    }
    return *this;
  }
  //! f(ok) runs once, on the thread that waits (wait(), or the destructor), after the operation has completed (ok)
  //! or failed: what a backend does there, such as making the caller's CUDA stream wait for an operation ordered on
  //! it (Op::stream) at the point where the caller waits.
  Handle&& then(std::function<void(bool ok)> f) && {
    then_ = std::move(f);
    return std::move(*this);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { finish_quietly(); }

  //! A handle of an operation that already finished (or failed with e).
  static Handle ready(std::exception_ptr e = nullptr) {
    std::promise<void> p;
    if (e) p.set_exception(e); else p.set_value();
    return Handle(p.get_future().share());
  }

  void wait() {
    if (!done_.valid()) return;
    auto d = std::move(done_);
    auto then = std::exchange(then_, nullptr);
    std::exception_ptr failed;
    try {
      d.get();
    } catch (...) {
      failed = std::current_exception();
    }
    if (then) then(failed == nullptr);
    if (failed) std::rethrow_exception(failed);
  }
  //! Another handle on the same operation, to test() it where this one is waited for (both wait when dropped; only
  //! this one runs then()'s function).
  Handle share() const { return Handle(done_); }
  //! True when the operation has finished (wait() then returns at once).
  bool test() const {
    return !done_.valid() || done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  bool pending() const { return done_.valid(); }

 private:
  void finish_quietly() noexcept {
    if (!done_.valid()) return;
    try {
      wait();
    } catch (const std::exception& e) {
      std::cerr << "loom: an operation whose handle was dropped without wait() failed: " << e.what() << "\n";
    } catch (...) {
    }
  }
  std::shared_future<void> done_;
  std::function<void(bool)> then_;
};

//! Several pending operations, completed together: wait() waits for each in order and rethrows the first failure
//! (the others are still waited for, by their destructors).
struct Handles {
  std::vector<Handle> all;
  void wait() {
    for (auto& h : all) h.wait();
  }
};

//! The time a collective may wait for its peers: LOOM_TIMEOUT_S seconds (default 300).
inline std::chrono::milliseconds default_timeout() {
  if (const char* s = std::getenv("LOOM_TIMEOUT_S"); s && *s) {
    char* end = nullptr;
    double v = std::strtod(s, &end);
    if (end != s && v > 0) return std::chrono::milliseconds(static_cast<long long>(v * 1000));
    throw Error(loom::detail::cat("loom: LOOM_TIMEOUT_S='", s, "' is not a positive number of seconds"));
  }
  return std::chrono::seconds(300);
}

//! What a launcher told this process (<loom/core/launch.hpp>): comm::launch() as the communicators' callers spell it.
using loom::Launch;
using loom::launch;

//! The timeout as messages print it: "3 s", or "1500 ms" when it is not a whole number of seconds.
inline std::string describe_timeout(std::chrono::milliseconds t) {
  const auto ms = t.count();
  return ms % 1000 ? loom::detail::cat(ms, " ms") : loom::detail::cat(ms / 1000, " s");
}

//! A short description of an operation for messages: all_reduce(count=8, f32, sum).
inline std::string describe(const Op& op) {
  std::string s = std::string(name_of(op.kind));
  if (op.kind == Collective::barrier) return s;
  if (op.kind == Collective::send_recv) return s + "(" + std::to_string(op.p2p.size()) + " ops)";
  s += "(count=" + std::to_string(op.count) + ", " + std::string(name_of(op.dtype));
  if (op.kind == Collective::all_reduce || op.kind == Collective::reduce_scatter || op.kind == Collective::reduce)
    s += ", " + std::string(name_of(op.reduce));
  if (op.kind == Collective::broadcast || op.kind == Collective::reduce) s += ", root=" + std::to_string(op.root);
  return s + ")";
}

}  // namespace loom::comm

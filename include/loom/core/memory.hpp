// What each rank holds in host memory, by use (parameters, gradients, optimizer state, master weights,
// activations, communication buffers), with the peak of each, and a cap per rank: an allocation beyond it fails
// with a message that names the rank, the use, the bytes asked for and the cap.
//
// A rank's ledger belongs to the threads that work for it: run_local binds one to each rank's thread, run_mpi to the
// process, and a loom::Worker started by a rank's thread takes its ledger. Elsewhere one ledger, rank -1, serves
// the process. What an allocation is for is a property of the thread too: MemoryUseScope sets it while it lives
// (what a model's parameters, an optimizer's state, ... are made under), and it is `other` by default.
#pragma once

#include <loom/core/error.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

namespace loom {

//! What memory is for.
enum class MemoryUse : std::uint8_t {
  parameters, gradients, optimizer_state, master_weights, activations, communication, checkpoint, other
};
inline constexpr std::size_t memory_uses = 8;

constexpr std::string_view name_of(MemoryUse u) {
  switch (u) {
    case MemoryUse::parameters: return "parameters";
    case MemoryUse::gradients: return "gradients";
    case MemoryUse::optimizer_state: return "optimizer state";
    case MemoryUse::master_weights: return "master weights";
    case MemoryUse::activations: return "activations";
    case MemoryUse::communication: return "communication buffers";
    case MemoryUse::checkpoint: return "checkpoint buffers";
    case MemoryUse::other: return "other";
  }
  return "?";
}

//! The cap new ledgers take: set_memory_cap(bytes) where called (train_gpt's --max-bytes), else LOOM_MAX_BYTES from
//! the environment, else none (0). A value that is not a positive integer is refused, naming it.
inline std::atomic<std::size_t>& memory_cap_setting() {
  static std::atomic<std::size_t> cap{0};
  return cap;
}
inline void set_memory_cap(std::size_t bytes) { memory_cap_setting().store(bytes); }
inline std::size_t memory_cap() {
  if (const std::size_t set = memory_cap_setting().load()) return set;
  const char* env = std::getenv("LOOM_MAX_BYTES");
  if (!env || !*env) return 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(env, &end, 10);
  LOOM_CHECK(*end == '\0' && v > 0 && env[0] != '-', "LOOM_MAX_BYTES must be a positive number of bytes, got '",
             env, "'");
  return static_cast<std::size_t>(v);
}

//! One rank's host memory by use: in use and peak, and the cap on their sum (0: none).
class MemoryLedger {
 public:
  MemoryLedger(int rank, std::size_t cap) : rank_(rank), cap_(cap) {}

  //! Records an allocation of b bytes for u; beyond the cap, records nothing and throws.
  void debit(MemoryUse u, std::size_t b) {
    const std::size_t now = total_.fetch_add(b) + b;
    if (cap_ && now > cap_) {
      total_.fetch_sub(b);
      throw Error(loom::detail::cat("loom: rank ", rank_, " cannot allocate ", b, " bytes of ", name_of(u),
                                    ": it would hold ", now, " bytes, over its cap of ", cap_,
                                    " (LOOM_MAX_BYTES); it holds ", describe()));
    }
    raise(total_peak_, now);
    auto& s = by_use_[static_cast<std::size_t>(u)];
    raise(s.peak, s.in_use.fetch_add(b) + b);
  }
  void credit(MemoryUse u, std::size_t b) {
    total_.fetch_sub(b);
    by_use_[static_cast<std::size_t>(u)].in_use.fetch_sub(b);
  }

  //! Sets every peak to what is in use now: the peaks that follow are those of what comes next.
  void reset_peaks() {
    total_peak_.store(total_.load());
    for (auto& u : by_use_) u.peak.store(u.in_use.load());
  }

  int rank() const { return rank_; }
  std::size_t cap() const { return cap_; }
  std::size_t in_use() const { return total_.load(); }
  std::size_t peak() const { return total_peak_.load(); }
  std::size_t in_use(MemoryUse u) const { return by_use_[static_cast<std::size_t>(u)].in_use.load(); }
  std::size_t peak(MemoryUse u) const { return by_use_[static_cast<std::size_t>(u)].peak.load(); }
  //! "parameters 1024, gradients 1024, ..." (bytes in use, the uses that hold any).
  std::string describe() const {
    std::string s;
    for (std::size_t i = 0; i < memory_uses; ++i)
      if (const auto b = by_use_[i].in_use.load())
        s += (s.empty() ? "" : ", ") + std::string(name_of(static_cast<MemoryUse>(i))) + " " + std::to_string(b);
    return s.empty() ? "nothing" : s;
  }

 private:
  struct Use {
    std::atomic<std::size_t> in_use{0}, peak{0};
  };
  static void raise(std::atomic<std::size_t>& peak, std::size_t now) {
    auto p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
  }

  int rank_;
  std::size_t cap_;
  std::atomic<std::size_t> total_{0}, total_peak_{0};
  std::array<Use, memory_uses> by_use_{};
};

namespace detail {
inline thread_local std::shared_ptr<MemoryLedger> thread_ledger;
inline thread_local MemoryUse thread_memory_use = MemoryUse::other;
inline thread_local unsigned thread_uncounted_uses = 0;  // a bit per MemoryUse
}  // namespace detail

//! The ledger of the rank this thread works for (the process's, rank -1, where none was bound).
inline const std::shared_ptr<MemoryLedger>& rank_memory_ledger() {
  if (!detail::thread_ledger) {
    static const auto process = std::make_shared<MemoryLedger>(-1, memory_cap());
    detail::thread_ledger = process;
  }
  return detail::thread_ledger;
}
inline MemoryLedger& rank_memory() { return *rank_memory_ledger(); }
//! Makes this thread work for a ledger (run_local and run_mpi do, for each rank).
inline void bind_rank_memory(std::shared_ptr<MemoryLedger> ledger) { detail::thread_ledger = std::move(ledger); }

//! Bytes charged to a rank's ledger for `use` while this lives (memory the ledger does not see allocated: a
//! checkpoint's staged chunks, an algorithm's workspace), credited to the same ledger when it dies, on whatever
//! thread.
class ChargedBytes {
 public:
  ChargedBytes() = default;
  ChargedBytes(MemoryUse use, std::size_t bytes) : ledger_(rank_memory_ledger()), use_(use), bytes_(bytes) {
    ledger_->debit(use_, bytes_);
  }
  ChargedBytes(ChargedBytes&& o) noexcept
      : ledger_(std::move(o.ledger_)), use_(o.use_), bytes_(std::exchange(o.bytes_, 0)) {}
  ChargedBytes& operator=(ChargedBytes&& o) noexcept {
    release();
    ledger_ = std::move(o.ledger_), use_ = o.use_, bytes_ = std::exchange(o.bytes_, 0);
    return *this;
  }
  ~ChargedBytes() { release(); }
  void release() {
    if (ledger_ && bytes_) ledger_->credit(use_, bytes_);
    bytes_ = 0;
  }

 private:
  std::shared_ptr<MemoryLedger> ledger_;
  MemoryUse use_ = MemoryUse::other;
  std::size_t bytes_ = 0;
};

//! What this thread's allocations are for while it lives (then what they were for before).
class MemoryUseScope {
 public:
  explicit MemoryUseScope(MemoryUse u) : before_(detail::thread_memory_use) { detail::thread_memory_use = u; }
  ~MemoryUseScope() { detail::thread_memory_use = before_; }
  MemoryUseScope(const MemoryUseScope&) = delete;
  MemoryUseScope& operator=(const MemoryUseScope&) = delete;

 private:
  MemoryUse before_;
};
inline MemoryUse current_memory_use() { return detail::thread_memory_use; }

//! While it lives, this thread's host allocations for `uses` are not charged to the ledger (nor credited when freed):
//! whoever owns them charges what of them the rank holds. ZeRO-2's gradients and ZeRO-3's parameters are so made,
//! whole, of which a rank holds its shard and, for a while, what it gathers.
class UncountedMemoryScope {
 public:
  template <class Uses>
  explicit UncountedMemoryScope(const Uses& uses) : before_(detail::thread_uncounted_uses) {
    for (MemoryUse use : uses) detail::thread_uncounted_uses |= 1u << static_cast<unsigned>(use);
  }
  ~UncountedMemoryScope() { detail::thread_uncounted_uses = before_; }
  UncountedMemoryScope(const UncountedMemoryScope&) = delete;
  UncountedMemoryScope& operator=(const UncountedMemoryScope&) = delete;

 private:
  unsigned before_;
};
//! Whether this thread's allocations for `use` are charged to the ledger now (UncountedMemoryScope).
inline bool memory_counted(MemoryUse use) {
  return (detail::thread_uncounted_uses & (1u << static_cast<unsigned>(use))) == 0;
}

}  // namespace loom

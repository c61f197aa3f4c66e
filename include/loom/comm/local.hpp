// The Local backend: ranks are threads of one process sharing memory. Collectives read peers' buffers directly;
// all_reduce runs as a ring, by recursive halving and doubling, or directly, chosen by size or by the caller.
// Every wait is bounded by the timeout, and a rank that fails stops the others with its message. Buffers may be
// device memory when ranks share one GPU and <loom/comm/local_cuda.hpp> (or .cuh) is included (see
// detail/device_memory.hpp).
#pragma once

#include <loom/comm/communicator.hpp>
#include <loom/core/compiled.hpp>
#include <loom/core/memory.hpp>
#define LOOM_COMM_BACKEND_INCLUDED
#define LOOM_COMM_LOCAL_INCLUDED
#include <loom/comm/detail/device_memory.hpp>
#include <loom/comm/detail/host_reduce.hpp>
#include <loom/comm/detail/worker.hpp>
#include <loom/core/threads.hpp>
#include <loom/core/trace.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <mutex>
#include <thread>

namespace loom::comm {

//! Settings of a Local world.
struct LocalOptions {
  std::chrono::milliseconds timeout = default_timeout();  //!< how long any rank waits for its peers
  Algorithm algorithm = Algorithm::automatic;            //!< all_reduce algorithm
  //! automatic: direct for groups of at most this many ranks (two synchronisations, each rank reads every peer);
  //! larger groups, where a slice's fan-in grows, use halving_doubling up to small_bytes and ring above.
  int direct_max_ranks = 16;
  std::size_t small_bytes = 64 * 1024;
  //! The OpenMP threads each rank's kernels use; 0: threads_per_rank(world size), the machine's share of one rank.
  int threads_per_rank = 0;
};

namespace detail {

using Clock = std::chrono::steady_clock;

class LocalWorld;

//! State shared by the threads of one group: arrival and completion counters, the posted operations, per-step
//! progress for the multi-step algorithms, and mailboxes for point-to-point messages.
struct LocalGroup {
  struct Member {
    // Written under the group's mutex (so that waiters are woken), read by spinning waiters without it.
    std::atomic<std::uint64_t> arrived{0};   // sequence number of the last collective entered (taken back on failure)
    std::atomic<std::uint64_t> passed{0};    // ... whose arrival this member saw complete: it may read peers' buffers
    std::atomic<std::uint64_t> done{0};      // ... that it finished: it reads no peer's buffer any more
    std::atomic<std::uint64_t> left{0};      // ... that it left on a failure: it reads no peer's buffer any more
    std::atomic<std::uint64_t> progress{0};  // (seq << 20) | steps completed, for ring and halving-doubling
    std::uint64_t next_seq = 0;  // owned by the member's thread
    const Op* op = nullptr;      // the posted operation of collective `arrived`
    bool device = false;         // whether that operation's buffers are device memory
  };
  struct Msg {
    const void* data;
    std::size_t count;
    DType dtype;
    std::uint64_t seq;
    bool consumed = false;  // the receiver has copied it (or refused it): the sender's buffer is free again
    std::string error;      // set by the receiver when the message does not fit
  };

  LocalWorld* world;
  GroupInfo info;
  int n;
  std::mutex m;
  std::condition_variable cv;
  std::vector<Member> mem;
  std::vector<std::deque<std::shared_ptr<Msg>>> box;  // [src * n + dst]
  std::vector<std::uint64_t> sent, received;          // per pair, for messages

  LocalGroup(LocalWorld* w, GroupInfo g)
      : world(w), info(std::move(g)), n(static_cast<int>(info.ranks.size())), mem(n), box(n * n),
        sent(n * n), received(n * n) {}
};

class LocalWorld {
 public:
  LocalWorld(int size, LocalOptions opt) : size_(size), opt_(opt) {}

  int size() const { return size_; }
  const LocalOptions& options() const { return opt_; }

  //! The shared state of the group of this name and these global ranks; made by whichever member asks first.
  std::shared_ptr<LocalGroup> group(const GroupInfo& info);

  //! Records the first failure and wakes every waiting rank, which then stops with an AbortedError.
  void abort(int rank, const std::string& what);
  bool aborted() const { return aborted_.load(std::memory_order_relaxed); }
  std::string abort_message() const;

 private:
  int size_;
  LocalOptions opt_;
  mutable std::mutex m_;
  std::map<std::pair<std::string, std::vector<int>>, std::shared_ptr<LocalGroup>> groups_;  //!< by name and ranks
  std::atomic<bool> aborted_{false};
  int failed_rank_ = -1;
  std::string reason_;
};

inline constexpr std::uint64_t step_key(std::uint64_t seq, std::uint64_t step) { return (seq << 20) | step; }

//! A half-open element range [lo, hi).
struct Range {
  std::size_t lo, hi;
  std::size_t size() const { return hi - lo; }
};
inline Range chunk(std::size_t count, int parts, int i) {
  return {count * i / parts, count * (i + 1) / parts};
}

//! The copies and reductions of one operation: on host memory, or through the installed device operations.
struct Mover {
  const DeviceMemoryOps* dev = nullptr;  //!< null: host memory

  //! For buffers a and b: device operations when either is device memory.
  static Mover for_buffers(const void* a, const void* b) {
    const DeviceMemoryOps* ops = device_memory_ops().load(std::memory_order_acquire);
    return {ops && (ops->holds(a) || ops->holds(b)) ? ops : nullptr};
  }
  void copy(void* dst, const void* src, std::size_t bytes) const {
    if (!bytes || dst == src) return;
    if (dev) dev->copy(dst, src, bytes);
    else std::memcpy(dst, src, bytes);
  }
  template <class T>
  void reduce_into(T* dst, const T* src, std::size_t n, Reduce op) const {
    if (dev) dev->reduce_into(host_dtype<T>, dst, src, n, op);
    else detail::reduce_into(dst, src, n, op);
  }
  //! dst = the reduction of srcs[0..nsrc); dst may be one of them.
  template <class T>
  void reduce_sources(T* dst, const T* const* srcs, int nsrc, std::size_t n, Reduce op) const {
    if (!dev) return detail::reduce_sources(dst, srcs, nsrc, n, op);
    int first = 0;
    for (int q = 0; q < nsrc; ++q)
      if (srcs[q] == dst) first = q;
    copy(dst, srcs[first], n * sizeof(T));
    for (int q = 0; q < nsrc; ++q)
      if (q != first) reduce_into(dst, srcs[q], n, op);
  }
  template <class T>
  void finish_avg(T* dst, std::size_t n, int group_size, Reduce op) const {
    if (op != Reduce::avg || !n) return;
    if (dev) dev->divide(host_dtype<T>, dst, n, group_size);
    else detail::finish_avg(dst, n, group_size, op);
  }
};

}  // namespace detail

//! The Local backend's communicator over one group, held by one rank's thread.
class LocalComm : public Frontend<LocalComm> {
 public:
  LocalComm(std::shared_ptr<detail::LocalGroup> g, int global_rank);
  LocalComm(const LocalComm&) = delete;
  LocalComm& operator=(const LocalComm&) = delete;
  int rank() const { return me_; }
  int size() const { return g_->n; }
  const GroupInfo& group() const { return g_->info; }

  //! Overrides the world's all_reduce algorithm for this communicator.
  void set_algorithm(Algorithm a) { algo_ = a; }
  Algorithm algorithm_for(std::size_t bytes) const {
    const auto& o = g_->world->options();
    Algorithm a = algo_ != Algorithm::automatic ? algo_ : o.algorithm;
    if (a == Algorithm::automatic)
      a = g_->n <= o.direct_max_ranks ? Algorithm::direct
          : bytes <= o.small_bytes    ? Algorithm::halving_doubling
                                      : Algorithm::ring;
    return a;
  }

  //! Runs op on this thread, or queues it on this communicator's worker thread when async. Operations keep the
  //! order in which they were issued.
  Handle start(Op&& op, bool async);

 private:
  using Lock = std::unique_lock<std::mutex>;

  // --- waiting -----------------------------------------------------------------------------------------------
  //! Waits until pred() holds, the world aborts, or the deadline passes. With `spin`, pred reads only atomics and is
  //! first polled without the lock, yielding the core: peers are usually microseconds away, a sleep costs more.
  template <class Pred, class Describe>
  void wait(Lock& lk, detail::Clock::time_point deadline, Pred pred, Describe describe, bool spin = false);
  std::string timeout_text() const;
  std::string where(std::uint64_t seq, const Op& op) const;
  //! Waits until every member's `field` has reached seq; a timeout names the ranks still `waiting` (then `also`).
  void wait_all(Lock& lk, std::uint64_t seq, const Op& op, detail::Clock::time_point deadline,
                std::atomic<std::uint64_t> detail::LocalGroup::Member::*field, const char* waiting,
                const std::string& also);
  //! Ranks whose counter `field` is below `target`, for messages.
  std::string laggards(std::atomic<std::uint64_t> detail::LocalGroup::Member::*field, std::uint64_t target,
                       bool steps) const;

  // --- one operation ---------------------------------------------------------------------------------------
  void run(Op& op);

  AbortedError abandoned(const std::string& what) const;

  //! Collective seq: publish the operation, wait for every member, run it, wait until every member has finished.
  //! Returns the mismatch text (every member computes the same) instead of running what the members disagree on.
  std::string collective(std::uint64_t seq, Op& op, detail::Clock::time_point deadline);

  //! After a failure inside collective seq, before this rank's buffers can be freed: takes back its arrival, so
  //! that no peer starts on them; stops the world with the failure, so that peers inside leave at their next wait;
  //! and returns once no peer that started can still be reading them. A peer that is still inside after the
  //! timeout is named on stderr and left behind.
  void leave(std::uint64_t seq, const std::string& what) noexcept;

  //! The same text on every member when the posted operations disagree; empty when they agree.
  std::string validate(std::uint64_t seq) const;

  template <class T>
  const T* send_of(int q) const { return static_cast<const T*>(g_->mem[q].op->send); }
  template <class T>
  T* recv_of(int q) const { return static_cast<T*>(g_->mem[q].op->recv); }

  //! One collective on elements of type T (a host_t). Not inline: with LOOM_EXTERN_KERNELS the element types'
  //! instantiations come from loom::cpu_kernels, compiled once (src/compiled.cpp).
  template <class T>
  void execute(std::uint64_t seq, const Op& op, Algorithm algo, detail::Clock::time_point deadline);

  //! Marks `steps` steps of collective seq done.
  void advance(std::uint64_t seq, std::uint64_t steps);
  //! Waits until group rank q has completed `steps` steps of collective seq.
  void await(int q, std::uint64_t seq, std::uint64_t steps, const Op& op, detail::Clock::time_point deadline);

  //! Two shots: reduce my slice from every rank's send into my recv, then copy the other slices from their owners.
  template <class T>
  void direct_all_reduce(std::uint64_t seq, const Op& op, detail::Clock::time_point deadline) {
    const int n = g_->n;
    const auto r = detail::chunk(op.count, n, me_);
    std::vector<const T*> src(n);
    for (int q = 0; q < n; ++q) src[q] = send_of<T>(q) + r.lo;
    T* out = static_cast<T*>(op.recv);
    mv_.reduce_sources(out + r.lo, src.data(), n, r.size(), op.reduce);
    mv_.finish_avg(out + r.lo, r.size(), n, op.reduce);
    advance(seq, 1);
    for (int k = 1; k < n; ++k) {
      const int q = (me_ + k) % n;
      await(q, seq, 1, op, deadline);
    }
    // Every slice is reduced, and nobody reads a send buffer any more: gather.
    for (int k = 1; k < n; ++k) {
      const int q = (me_ + k) % n;
      const auto rq = detail::chunk(op.count, n, q);
      mv_.copy(out + rq.lo, recv_of<T>(q) + rq.lo, rq.size() * sizeof(T));
    }
  }

  //! Reduce-scatter then all-gather around the ring, in the recv buffers. Step s reads the left neighbour's chunk
  //! that it finished at step s-1; an all-gather step also waits for the right neighbour to have read the chunk
  //! it is about to overwrite.
  template <class T>
  void ring_all_reduce(std::uint64_t seq, const Op& op, detail::Clock::time_point deadline) {
    const int n = g_->n;
    if (n == 1) return;
    const int left = (me_ + n - 1) % n, right = (me_ + 1) % n;
    T* mine = static_cast<T*>(op.recv);
    const T* theirs = recv_of<T>(left);
    for (int k = 0; k < n - 1; ++k) {
      await(left, seq, k, op, deadline);
      const auto r = detail::chunk(op.count, n, ((me_ - 1 - k) % n + n) % n);
      mv_.reduce_into(mine + r.lo, theirs + r.lo, r.size(), op.reduce);
      if (k == n - 2) mv_.finish_avg(mine + r.lo, r.size(), n, op.reduce);  // chunk me+1 is complete
      advance(seq, k + 1);
    }
    for (int k = 0; k < n - 1; ++k) {
      const int step = n - 1 + k;
      await(left, seq, step, op, deadline);
      await(right, seq, k + 1, op, deadline);
      const auto r = detail::chunk(op.count, n, ((me_ - k) % n + n) % n);
      mv_.copy(mine + r.lo, theirs + r.lo, r.size() * sizeof(T));
      advance(seq, step + 1);
    }
  }

  //! Rabenseifner: fold the ranks beyond the largest power of two, recursive halving (reduce-scatter), recursive
  //! doubling (all-gather), unfold. Only partners of one level touch each other's ranges at that level.
  template <class T>
  void rhd_all_reduce(std::uint64_t seq, const Op& op, detail::Clock::time_point deadline) {
    const int n = g_->n;
    if (n == 1) return finish_avg_all<T>(op);
    int m = 1, levels = 0;
    while (m * 2 <= n) m *= 2, ++levels;
    T* mine = static_cast<T*>(op.recv);
    const std::uint64_t last = 1 + 2 * static_cast<std::uint64_t>(levels);
    if (me_ >= m) {  // an extra rank: its partner me-m adds our data, and we copy the result back
      await(me_ - m, seq, last, op, deadline);
      mv_.copy(mine, recv_of<T>(me_ - m), op.count * sizeof(T));
      advance(seq, last + 1);
      return;
    }
    if (me_ + m < n) mv_.reduce_into(mine, static_cast<const T*>(recv_of<T>(me_ + m)), op.count, op.reduce);
    advance(seq, 1);
    detail::Range own{0, op.count};
    std::vector<detail::Range> kept;
    for (int k = 0, d = m / 2; d >= 1; ++k, d /= 2) {
      const int partner = me_ ^ d;
      await(partner, seq, 1 + k, op, deadline);
      const std::size_t mid = own.lo + own.size() / 2;
      const detail::Range lo{own.lo, mid}, hi{mid, own.hi};
      kept.push_back(own);
      own = (me_ & d) ? hi : lo;
      mv_.reduce_into(mine + own.lo, recv_of<T>(partner) + own.lo, own.size(), op.reduce);
      if (d == 1) mv_.finish_avg(mine + own.lo, own.size(), n, op.reduce);  // `own` is complete
      advance(seq, 2 + k);
    }
    for (int k = 0, d = 1; d < m; ++k, d *= 2) {
      const int partner = me_ ^ d;
      const std::uint64_t step = 1 + levels + k;
      await(partner, seq, step, op, deadline);
      const detail::Range whole = kept[levels - 1 - k];
      // The partner owns the other half of `whole`.
      const detail::Range other = own.lo == whole.lo ? detail::Range{own.hi, whole.hi} : detail::Range{whole.lo, own.lo};
      mv_.copy(mine + other.lo, recv_of<T>(partner) + other.lo, other.size() * sizeof(T));
      own = whole;
      advance(seq, step + 1);
    }
  }
  template <class T>
  void finish_avg_all(const Op& op) {
    mv_.finish_avg(static_cast<T*>(op.recv), op.count, g_->n, op.reduce);
  }

  // --- point to point ----------------------------------------------------------------------------------------
  using Posted = std::vector<std::pair<std::shared_ptr<detail::LocalGroup::Msg>, int>>;

  //! Posts every send, then serves every receive in order, then waits until each send was taken. A receiver copies
  //! from the sender's buffer, so a sender that fails first withdraws what nobody has taken (withdraw()).
  void run_p2p(const Op& op);

  void serve_p2p(const Op& op, detail::Clock::time_point deadline, Posted& posted);

  //! After a failure, before the buffers of this rank's sends can be freed: takes back the sends nobody has taken,
  //! stops the world with the failure (unless `what` is empty), and waits (up to the timeout) for the receivers that
  //! are copying the others.
  void withdraw(const Posted& posted, const std::string& what) noexcept;

  std::shared_ptr<detail::LocalGroup> g_;
  int me_;
  Algorithm algo_ = Algorithm::automatic;
  detail::Mover mv_;  // the current collective's: host or device memory
  detail::SerialWorker worker_;  // last member: destroyed first, while the rest is still valid
};

//! The element types every Local collective runs on.
#define LOOM_LOCAL_COMM_TYPES(X) \
  X(float) X(double) X(detail::host_t<bf16>) X(detail::host_t<fp16>) X(std::int32_t) X(std::int64_t)
#define LOOM_LOCAL_COMM_EXECUTE(T) \
  template void LocalComm::execute<T>(std::uint64_t, const Op&, Algorithm, detail::Clock::time_point);
#ifdef LOOM_EXTERN_KERNELS
#define LOOM_LOCAL_COMM_EXTERN(T) extern LOOM_LOCAL_COMM_EXECUTE(T)
LOOM_LOCAL_COMM_TYPES(LOOM_LOCAL_COMM_EXTERN)
#undef LOOM_LOCAL_COMM_EXTERN
#endif

//! The Local backend: what Context<Cfg, Local> needs to hand out communicators to one rank thread.
struct Local {
  using Comm = LocalComm;
  struct Rank {
    detail::LocalWorld* world;
    int rank;
    std::unique_ptr<Comm> make(const GroupInfo& g) const;
  };
};

static_assert(Communicator<LocalComm>);

}  // namespace loom::comm

#if LOOM_DEFINE_COMPILED
#include <loom/comm/detail/local_impl.hpp>
#endif

#include <loom/comm/context.hpp>

namespace loom {

//! Runs fn(Context<Cfg, comm::Local>&) on Cfg::world_size threads, one per rank, and waits for them. When a rank
//! throws, the others stop (their waits end with an AbortedError naming it) and a RankFailure is thrown here:
//! "loom: rank N failed: ..." for the lowest-numbered rank that failed on its own (not merely abandoned), so that
//! the report does not depend on which thread got there first; every rank's message stays in it.
template <class Cfg, class F>
  requires std::invocable<F&, Context<Cfg, comm::Local>&>
void run_local(F&& fn, comm::LocalOptions opt = {}) {
  comm::detail::LocalWorld world(Cfg::world_size, opt);
  std::vector<std::exception_ptr> thrown(Cfg::world_size);
  std::vector<std::string> messages(Cfg::world_size);
  std::vector<char> abandoned(Cfg::world_size, 0);
  std::vector<std::thread> threads;
  threads.reserve(Cfg::world_size);
  const int rank_threads = opt.threads_per_rank > 0 ? opt.threads_per_rank : threads_per_rank(Cfg::world_size);
  for (int r = 0; r < Cfg::world_size; ++r) {
    threads.emplace_back([&, r] {
      trace::set_rank(r);
      use_threads(rank_threads);
      bind_rank_memory(std::make_shared<MemoryLedger>(r, memory_cap()));
      Context<Cfg, comm::Local> ctx(comm::Local::Rank{&world, r});
      try {
        fn(ctx);
        return;
      } catch (const AbortedError& e) {
        abandoned[r] = 1;
        messages[r] = e.what();
        thrown[r] = std::current_exception();
      } catch (const std::exception& e) {
        messages[r] = e.what();
        thrown[r] = std::current_exception();
      } catch (...) {
        messages[r] = "a non-standard exception";
        thrown[r] = std::current_exception();
      }
      world.abort(r, messages[r]);
    });
  }
  for (auto& t : threads) t.join();
  int report = -1;
  for (int r = Cfg::world_size - 1; r >= 0; --r)
    if (thrown[r] && (!abandoned[r] || report < 0 || abandoned[report])) report = r;
  if (report < 0) return;
  std::string what = loom::detail::cat("loom: rank ", report, " failed: ", messages[report]);
  throw RankFailure(report, std::move(what), std::move(messages), thrown[report]);
}

}  // namespace loom

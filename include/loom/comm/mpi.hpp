// The Mpi backend: one process per rank (mpirun, srun), one MPI communicator per group. Blocking operations call
// MPI's own collectives; asynchronous ones run them on the communicator's worker thread. A watchdog bounds every
// operation by the timeout: on expiry it prints which operation, group and sequence number stalled and which ranks
// have not entered it, then aborts the job, so no rank hangs. MPI error codes become loom::BackendError.
// Link loom::mpi.
#pragma once

#include <loom/comm/communicator.hpp>
#include <loom/core/memory.hpp>
#include <loom/comm/context.hpp>
#define LOOM_COMM_BACKEND_INCLUDED
#include <loom/comm/detail/device_memory.hpp>
#include <loom/comm/detail/host_reduce.hpp>
#include <loom/comm/detail/worker.hpp>
#include <loom/core/threads.hpp>
#include <loom/core/trace.hpp>

#include <mpi.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <list>
#include <mutex>

namespace loom::comm {

namespace detail {

inline void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw BackendError(loom::detail::cat("loom: ", call, " failed: ", std::string(text, len)));
}

#define LOOM_MPI(call) ::loom::comm::detail::mpi_check((call), #call)

//! MPI datatypes and reduction operators for loom's element types; bf16 and f16 get user-defined operators.
class MpiTypes {
 public:
  static MpiTypes& get() {
    static MpiTypes t;
    return t;
  }
  MPI_Datatype type(DType d) const {
    switch (d) {
      case DType::f32: return MPI_FLOAT;
      case DType::f64: return MPI_DOUBLE;
      case DType::i32: return MPI_INT32_T;
      case DType::i64: return MPI_INT64_T;
      case DType::bf16: return half_[0];
      case DType::f16: return half_[1];
    }
    return MPI_BYTE;
  }
  MPI_Op op(DType d, Reduce r) const {
    const int k = r == Reduce::avg ? 0 : static_cast<int>(r);  // avg: sum, then divide
    if (d == DType::bf16) return half_ops_[0][k];
    if (d == DType::f16) return half_ops_[1][k];
    switch (r) {
      case Reduce::sum: case Reduce::avg: return MPI_SUM;
      case Reduce::max: return MPI_MAX;
      case Reduce::min: return MPI_MIN;
      case Reduce::prod: return MPI_PROD;
    }
    return MPI_SUM;
  }

 private:
  MpiTypes() {
    for (auto& t : half_) {
      MPI_Type_contiguous(2, MPI_BYTE, &t);
      MPI_Type_commit(&t);
    }
    make_ops<host_t<bf16>>(half_ops_[0]);
    make_ops<host_t<fp16>>(half_ops_[1]);
  }
  template <class T, Reduce R>
  static void apply(void* in, void* inout, int* len, MPI_Datatype*) {
    reduce_into(static_cast<T*>(inout), static_cast<const T*>(in), static_cast<std::size_t>(*len), R);
  }
  template <class T>
  static void make_ops(std::array<MPI_Op, 5>& ops) {
    MPI_Op_create(&apply<T, Reduce::sum>, 1, &ops[0]);
    ops[1] = ops[0];
    MPI_Op_create(&apply<T, Reduce::max>, 1, &ops[2]);
    MPI_Op_create(&apply<T, Reduce::min>, 1, &ops[3]);
    MPI_Op_create(&apply<T, Reduce::prod>, 1, &ops[4]);
  }
  std::array<MPI_Datatype, 2> half_{};
  std::array<std::array<MPI_Op, 5>, 2> half_ops_{};
};

//! One process's record of what each of its groups has entered, exposed to the other ranks through an MPI window
//! so that a stalled operation can name the ranks that never arrived; and the watchdog thread that enforces the
//! timeout.
class MpiWatch {
 public:
  static constexpr int max_groups = 256;

  static MpiWatch& get() {
    static MpiWatch w;
    return w;
  }

  //! Collective over MPI_COMM_WORLD: call once after MPI_Init.
  void start(std::chrono::milliseconds timeout) {
    timeout_ = timeout;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    LOOM_MPI(MPI_Win_allocate(max_groups * sizeof(std::uint64_t), sizeof(std::uint64_t), MPI_INFO_NULL,
                              MPI_COMM_WORLD, &counters_, &win_));
    for (int i = 0; i < max_groups; ++i) counters_[i] = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    thread_ = std::thread([this] { watch(); });
  }
  void stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    MPI_Win_free(&win_);
  }
  std::chrono::milliseconds timeout() const { return timeout_; }

  struct Pending {
    std::string what;
    const GroupInfo* group;
    int slot;
    std::uint64_t seq;
    std::chrono::steady_clock::time_point deadline;
  };

  //! While alive, bounds one operation by the timeout.
  class Ticket {
   public:
    Ticket(MpiWatch& w, std::list<Pending>::iterator it) : w_(&w), it_(it) {}
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket() {
      std::lock_guard lk(w_->m_);
      w_->pending_.erase(it_);
    }

   private:
    MpiWatch* w_;
    std::list<Pending>::iterator it_;
  };

  //! Marks operation seq of the group in `slot` as entered, visible to the other ranks, and bounds it by the
  //! timeout while the ticket lives.
  //! slot -1: an operation outside any communicator's sequence (creating one, the final barrier), not tracked
  //! per rank.
  [[nodiscard]] std::unique_ptr<Ticket> enter(std::string what, const GroupInfo& g, int slot, std::uint64_t seq) {
    if (slot >= 0) __atomic_store_n(&counters_[slot], seq, __ATOMIC_RELEASE);
    std::lock_guard lk(m_);
    pending_.push_back({std::move(what), &g, slot, seq, std::chrono::steady_clock::now() + timeout_});
    return std::make_unique<Ticket>(*this, std::prev(pending_.end()));
  }

 private:
  MpiWatch() = default;

  void watch() {
    std::unique_lock lk(m_);
    while (!stop_) {
      cv_.wait_for(lk, std::chrono::milliseconds(100));
      const auto now = std::chrono::steady_clock::now();
      for (const auto& p : pending_) {
        if (now < p.deadline) continue;
        const Pending stalled = p;
        lk.unlock();
        report(stalled);  // aborts
      }
    }
  }

  [[noreturn]] void report(const Pending& p) {
    // Ask every member how far it got in this group, through the window; a member that does not answer within a
    // second is reported as unknown.
    std::string missing;
    auto reader = std::make_shared<std::vector<std::int64_t>>(p.group->ranks.size(), -1);
    if (p.slot < 0) missing = "not tracked for this operation";
    else std::thread([reader, p, this] {
      for (std::size_t i = 0; i < p.group->ranks.size(); ++i) {
        std::uint64_t v = 0;
        const int target = p.group->ranks[i];
        if (MPI_Win_lock(MPI_LOCK_SHARED, target, 0, win_) != MPI_SUCCESS) return;
        MPI_Get(&v, 1, MPI_UINT64_T, target, p.slot, 1, MPI_UINT64_T, win_);
        MPI_Win_unlock(target, win_);
        (*reader)[i] = static_cast<std::int64_t>(v);
      }
    }).detach();
    if (p.slot >= 0) std::this_thread::sleep_for(std::chrono::seconds(1));
    for (std::size_t i = 0; i < p.group->ranks.size() && p.slot >= 0; ++i) {
      const auto v = (*reader)[i];
      if (v >= 0 && static_cast<std::uint64_t>(v) >= p.seq) continue;
      missing += loom::detail::cat(missing.empty() ? "" : ", ", "global rank ", p.group->ranks[i], " (group rank ", i,
                                   v < 0 ? ", did not answer)" : loom::detail::cat(", at #", v, ")"));
    }
    std::fprintf(stderr, "%s\n",
                 loom::detail::cat("loom: ", p.what, p.slot >= 0 ? loom::detail::cat(" #", p.seq) : std::string(), " on group ", p.group->describe(), " timed out after ",
                                   describe_timeout(timeout_),
                                   " on global rank ", rank_, "; ranks that have not entered it: ",
                                   missing.empty() ? std::string("none (it stalled inside MPI)") : missing,
                                   ". Aborting the job.")
                     .c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::_Exit(3);
  }

  std::chrono::milliseconds timeout_{};
  int rank_ = 0;
  std::uint64_t* counters_ = nullptr;
  MPI_Win win_ = MPI_WIN_NULL;
  std::mutex m_;
  std::condition_variable cv_;
  std::list<Pending> pending_;
  bool stop_ = false;
  std::thread thread_;
};

//! MPI_Barrier over every rank, bounded by the watchdog.
inline void world_barrier(const char* what) {
  static const GroupInfo world = [] {
    int n = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    GroupInfo g{"world", {}};
    for (int i = 0; i < n; ++i) g.ranks.push_back(i);
    return g;
  }();
  auto watched = MpiWatch::get().enter(what, world, -1, 0);
  LOOM_MPI(MPI_Barrier(MPI_COMM_WORLD));
}

}  // namespace detail

//! The Mpi backend's communicator over one group.
class MpiComm : public Frontend<MpiComm> {
 public:
  //! Collective over the group's members.
  explicit MpiComm(const GroupInfo& g) : info_(g) {
    auto watched = detail::MpiWatch::get().enter("creating the communicator", info_, -1, 0);
    MPI_Group world_group, group;
    LOOM_MPI(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
    LOOM_MPI(MPI_Group_incl(world_group, static_cast<int>(g.ranks.size()), g.ranks.data(), &group));
    LOOM_MPI(MPI_Comm_create_group(MPI_COMM_WORLD, group, 0, &comm_));
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // The watchdog slot: the next free one on every member.
    static std::atomic<int> next_slot{0};
    int mine = next_slot.load(), agreed = 0;
    LOOM_MPI(MPI_Allreduce(&mine, &agreed, 1, MPI_INT, MPI_MAX, comm_));
    LOOM_CHECK(agreed < detail::MpiWatch::max_groups, "more than ", detail::MpiWatch::max_groups,
               " communicators in one process");
    slot_ = agreed;
    next_slot.store(agreed + 1);
  }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;
  ~MpiComm() {
    worker_.reset();  // finish queued operations before the communicator goes
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const GroupInfo& group() const { return info_; }
  MPI_Comm native() const { return comm_; }

  Handle start(Op&& op, bool async) {
    detail::order_on_host(op);
    return worker_->run([this, op = std::move(op)]() mutable { run(op); }, async);
  }

 private:
  void run(Op& op) {
    trace::Scope span(name_of(op.kind).data(), "comm");
    auto& types = detail::MpiTypes::get();
    const MPI_Datatype t = types.type(op.dtype);
    const int c = static_cast<int>(op.count);
    auto ticket = [&] {
      return detail::MpiWatch::get().enter(std::string(name_of(op.kind)), info_, slot_, ++seq_);
    };
    auto in_place = [&](const void* send) { return send == op.recv ? MPI_IN_PLACE : send; };
    switch (op.kind) {
      case Collective::barrier: {
        auto tk = ticket();
        LOOM_MPI(MPI_Barrier(comm_));
        return;
      }
      case Collective::all_reduce: {
        auto tk = ticket();
        LOOM_MPI(MPI_Allreduce(in_place(op.send), op.recv, c, t, types.op(op.dtype, op.reduce), comm_));
        return avg(op, op.recv, op.count);
      }
      case Collective::reduce_scatter: {
        auto tk = ticket();
        LOOM_MPI(MPI_Reduce_scatter_block(op.send, op.recv, c, t, types.op(op.dtype, op.reduce), comm_));
        return avg(op, op.recv, op.count);
      }
      case Collective::all_gather: {
        auto tk = ticket();
        const bool inplace = op.send == static_cast<char*>(op.recv) + rank_ * op.count * size_of(op.dtype);
        LOOM_MPI(MPI_Allgather(inplace ? MPI_IN_PLACE : op.send, c, t, op.recv, c, t, comm_));
        return;
      }
      case Collective::broadcast: {
        auto tk = ticket();
        LOOM_MPI(MPI_Bcast(op.recv, c, t, op.root, comm_));
        return;
      }
      case Collective::reduce: {
        auto tk = ticket();
        const bool root = rank_ == op.root;
        LOOM_MPI(MPI_Reduce(root ? in_place(op.send) : op.send, op.recv, c, t, types.op(op.dtype, op.reduce),
                            op.root, comm_));
        if (root) avg(op, op.recv, op.count);
        return;
      }
      case Collective::all_to_all: {
        auto tk = ticket();
        LOOM_MPI(MPI_Alltoall(op.send, c, t, op.recv, c, t, comm_));
        return;
      }
      case Collective::all_to_all_v: {
        auto tk = ticket();
        std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
        for (int q = 0; q < size_; ++q) {
          sc[q] = static_cast<int>(op.send_counts[q]), sd[q] = static_cast<int>(op.send_displs[q]);
          rc[q] = static_cast<int>(op.recv_counts[q]), rd[q] = static_cast<int>(op.recv_displs[q]);
        }
        LOOM_MPI(MPI_Alltoallv(op.send, sc.data(), sd.data(), t, op.recv, rc.data(), rd.data(), t, comm_));
        return;
      }
      case Collective::send_recv: {
        std::vector<MPI_Request> reqs(op.p2p.size());
        auto tk = detail::MpiWatch::get().enter("send/recv batch", info_, slot_, seq_);
        for (std::size_t i = 0; i < op.p2p.size(); ++i) {
          const auto& p = op.p2p[i];
          const auto ty = types.type(p.dtype);
          if (p.kind == P2P::Kind::send)
            LOOM_MPI(MPI_Isend(p.data, static_cast<int>(p.count), ty, p.peer, 7, comm_, &reqs[i]));
          else
            LOOM_MPI(MPI_Irecv(p.data, static_cast<int>(p.count), ty, p.peer, 7, comm_, &reqs[i]));
        }
        std::vector<MPI_Status> st(reqs.size());
        const int rc = MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), st.data());
        if (rc == MPI_ERR_IN_STATUS) {
          for (std::size_t i = 0; i < st.size(); ++i)
            if (st[i].MPI_ERROR != MPI_SUCCESS)
              detail::mpi_check(st[i].MPI_ERROR, op.p2p[i].kind == P2P::Kind::send ? "MPI_Isend" : "MPI_Irecv");
        }
        LOOM_MPI(rc);
        return;
      }
    }
  }
  void avg(const Op& op, void* data, std::size_t n) {
    if (op.reduce != Reduce::avg) return;
    visit_dtype(op.dtype, [&](auto tag) {
      using T = detail::host_t<typename decltype(tag)::type>;
      detail::finish_avg(static_cast<T*>(data), n, size_, op.reduce);
    });
  }

  GroupInfo info_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, slot_ = 0;
  std::uint64_t seq_ = 0;
  std::unique_ptr<detail::SerialWorker> worker_ = std::make_unique<detail::SerialWorker>();
};

//! The Mpi backend for Context<Cfg, Mpi>.
struct Mpi {
  using Comm = MpiComm;
  struct Rank {
    int rank;
    std::unique_ptr<Comm> make(const GroupInfo& g) const { return std::make_unique<Comm>(g); }
  };
};

static_assert(Communicator<MpiComm>);

}  // namespace loom::comm

namespace loom {

namespace comm::detail {

//! What run_mpi and run_nccl share: MPI start-up, the world-size check, the watchdog, and failure handling around
//! body(global rank), which makes the rank's Context and runs the user's function.
template <class Cfg, class Body>
int mpi_main(int& argc, char**& argv, Body&& body) {
  int provided = 0;
  comm::detail::mpi_check(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != Cfg::world_size) {
    if (rank == 0)
      std::fprintf(stderr, "loom: the layout %s needs %d ranks, but the job was launched with %d (use mpirun -np %d)\n",
                   std::string(Cfg::name()).c_str(), Cfg::world_size, size, Cfg::world_size);
    MPI_Finalize();
    return 1;
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    if (rank == 0) std::fprintf(stderr, "loom: this MPI does not provide MPI_THREAD_MULTIPLE\n");
    MPI_Finalize();
    return 1;
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  {  // the processes on this node share its cores
    MPI_Comm node;
    int here = 1;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
      MPI_Comm_size(node, &here);
      MPI_Comm_free(&node);
    }
    use_threads(threads_per_rank(here));
  }
  try {
    comm::detail::MpiWatch::get().start(comm::default_timeout());
    trace::set_rank(rank);
    bind_rank_memory(std::make_shared<MemoryLedger>(rank, memory_cap()));
    body(rank);
    comm::detail::world_barrier("the barrier after the program's work");
    comm::detail::MpiWatch::get().stop();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom: rank %d failed: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 2);
    return 2;
  }
  MPI_Finalize();
  return 0;
}

}  // namespace comm::detail

//! Runs fn(Context<Cfg, comm::Mpi>&) in this process, one rank of a job started by mpirun or srun, and returns the
//! exit code for main. A launch with the wrong number of processes makes every rank return 1 after rank 0 prints
//! one message naming both numbers; a rank whose fn throws prints the failure and aborts the whole job.
template <class Cfg, class F>
  requires std::invocable<F&, Context<Cfg, comm::Mpi>&>
int run_mpi(int& argc, char**& argv, F&& fn) {
  return comm::detail::mpi_main<Cfg>(argc, argv, [&](int rank) {
    Context<Cfg, comm::Mpi> ctx(comm::Mpi::Rank{rank});
    fn(ctx);
  });
}

}  // namespace loom

// The Nccl backend: one process and one GPU per rank, one NCCL communicator and one CUDA stream per group; buffers
// are device memory (std::span<T> over it), or host memory, which an operation stages through device memory on its
// stream (a trainer's scalars: a loss, a norm, a flag). Every operation is bounded by the timeout: on expiry the
// communicator is aborted and the rank throws loom::TimeoutError naming the operation, group, sequence number and
// rank (for one ordered on the caller's stream, whose call has returned, the next operation throws it). Communicators
// are non-blocking, so that their set-up and the connections a first operation makes are bounded
// by the timeout too. NCCL and CUDA error codes become loom::BackendError. Link loom::cuda and loom::mpi; launch with
// mpirun, one rank per GPU.
#pragma once

#if !defined(LOOM_HAS_CUDA) || !defined(LOOM_HAS_MPI)
#error "loom: <loom/comm/nccl.hpp> needs LOOM_HAS_CUDA and LOOM_HAS_MPI: link loom::cuda and loom::mpi (configure with -DLOOM_WITH_CUDA=ON -DLOOM_WITH_MPI=ON)"
#endif

#include <loom/comm/communicator.hpp>
#include <loom/comm/context.hpp>
#define LOOM_COMM_BACKEND_INCLUDED
#include <loom/comm/detail/worker.hpp>
#include <loom/comm/mpi.hpp>

#include <loom/kernels/cuda/check.cuh>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace loom::comm {

namespace detail {

//! The function's name out of a macro's stringified call: "ncclAllReduce(a, b, ...)" -> "ncclAllReduce".
constexpr std::string_view call_name(std::string_view call) { return call.substr(0, call.find('(')); }

inline void cuda_check(cudaError_t rc, std::string_view call) {
  if (rc == cudaSuccess) return;
  throw BackendError(loom::detail::cat("loom: ", call_name(call), " failed: ", cudaGetErrorString(rc), " (",
                                       cudaGetErrorName(rc), ")"));
}

inline std::string nccl_text(ncclResult_t rc) {
  std::string s = ncclGetErrorString(rc);
  if (const char* last = ncclGetLastError(nullptr); last && *last) s += loom::detail::cat(": ", last);
  return s;
}

inline void nccl_check(ncclResult_t rc, std::string_view call) {
  if (rc == ncclSuccess) return;
  throw BackendError(loom::detail::cat("loom: ", call_name(call), " failed: ", nccl_text(rc)));
}
//! As nccl_check, for a call on a non-blocking communicator: ncclInProgress means it goes on in the background
//! (NcclComm::settle waits for it).
inline void nccl_issue(ncclResult_t rc, std::string_view call) {
  if (rc != ncclInProgress) nccl_check(rc, call);
}

}  // namespace detail

}  // namespace loom::comm

// Guarded: a kernels header may define the same checks.
#ifndef LOOM_CUDA
#define LOOM_CUDA(call) ::loom::comm::detail::cuda_check((call), #call)
#endif
#ifndef LOOM_NCCL
#define LOOM_NCCL(call) ::loom::comm::detail::nccl_check((call), #call)
#endif
#define LOOM_NCCL_ISSUE(call) ::loom::comm::detail::nccl_issue((call), #call)

namespace loom::comm {

namespace detail {

inline ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
  }
  return ncclInt8;
}

inline ncclRedOp_t nccl_op(Reduce r) {
  switch (r) {
    case Reduce::sum: return ncclSum;
    case Reduce::avg: return ncclAvg;
    case Reduce::max: return ncclMax;
    case Reduce::min: return ncclMin;
    case Reduce::prod: return ncclProd;
  }
  return ncclSum;
}

//! This process's rank on its node (first) and the node's process count (second), from MPI's shared-memory group.
inline std::pair<int, int> node_group() {
  MPI_Comm node;
  LOOM_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int r = 0, n = 1;
  MPI_Comm_rank(node, &r);
  MPI_Comm_size(node, &n);
  MPI_Comm_free(&node);
  return {r, n};
}
//! This process's rank on its node, from the launcher (Open MPI, Slurm, MPICH) or else from MPI itself.
inline int local_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"})
    if (const char* s = std::getenv(var); s && *s) return std::atoi(s);
  return node_group().first;
}
//! How many processes of the job run on this node.
inline int local_size() {
  if (const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"); s && *s) return std::atoi(s);
  return node_group().second;
}

//! The GPU of this rank: its local rank modulo the visible devices (so that CUDA_VISIBLE_DEVICES set per rank
//! works too), made current. A node that runs more processes than it shows GPUs is refused: NCCL takes one rank
//! per GPU.
inline int pick_device(int rank) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0)
    throw BackendError(loom::detail::cat("loom: the Nccl backend needs a CUDA device, but rank ", rank, " sees none",
                                         rc != cudaSuccess ? loom::detail::cat(" (cudaGetDeviceCount: ",
                                                                               cudaGetErrorString(rc), ")")
                                                           : std::string()));
  if (const int procs = local_size(); procs > count && std::getenv("CUDA_VISIBLE_DEVICES") == nullptr)
    throw BackendError(loom::detail::cat("loom: the Nccl backend runs one process per GPU, but rank ", rank,
                                         "'s node runs ", procs, " processes and shows ", count,
                                         " GPU(s): launch at most ", count, " a node (ranks that share a GPU talk "
                                         "through the Local backend, as threads of one process)"));
  const int device = local_rank() % count;
  LOOM_CUDA(cudaSetDevice(device));
  loom::chosen_device() = device;  // the workers this thread starts run there too
  return device;
}

}  // namespace detail

//! The Nccl backend's communicator over one group. Operations run on stream() after the work already enqueued
//! there. An operation ordered on a stream of the caller (Frontend::on_stream, Op::stream) is ordered by events:
//! stream() waits for what the caller queued before it, the caller's stream waits for it, and the call returns
//! without the host waiting for the device; a watchdog thread then bounds it by the timeout (on expiry, or an error
//! NCCL reports, the communicator is aborted, so that the kernels waiting on it end, and the next operation on it
//! throws the failure). Any other operation returns once its result is in device memory (or, staged, in host
//! memory), as does an ordered one with host buffers.
class NcclComm : public Frontend<NcclComm> {
 public:
  //! Collective over the group's members; device is this rank's GPU. Needs MPI and the Mpi watchdog started, as
  //! run_nccl does.
  NcclComm(const GroupInfo& g, int device, std::chrono::milliseconds timeout = default_timeout())
      : info_(g), device_(device), timeout_(timeout) {
    try {
      LOOM_CUDA(cudaSetDevice(device_));
      // Group rank 0 makes the id; the broadcast runs under the Mpi watchdog, so a member that never comes is
      // named rather than waited for.
      std::array<std::int64_t, (sizeof(ncclUniqueId) + 7) / 8> id_words{};
      {
        MpiComm host(g);
        rank_ = host.rank();
        size_ = host.size();
        if (rank_ == 0) {
          ncclUniqueId id;
          LOOM_NCCL(ncclGetUniqueId(&id));
          std::memcpy(id_words.data(), &id, sizeof id);
        }
        host.broadcast(id_words, 0);
      }
      ncclUniqueId id;
      std::memcpy(&id, id_words.data(), sizeof id);
      LOOM_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      LOOM_CUDA(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
      LOOM_CUDA(cudaMalloc(&scratch_, sizeof(std::int32_t)));
      LOOM_CUDA(cudaMemsetAsync(scratch_, 0, sizeof(std::int32_t), stream_));
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      // Non-blocking: set-up and the connections a first operation makes go on in the background, which settle()
      // bounds by the timeout (a blocking communicator would wait for a missing member without end).
      config.blocking = 0;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
      const std::string name = info_.describe();
      config.commName = name.c_str();  // names the group in NCCL's own logs
#endif
      LOOM_NCCL_ISSUE(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config));
      settle(loom::detail::cat("loom: setting up the NCCL communicator of group ", info_.describe()),
             Clock::now() + timeout_);
      LOOM_CUDA(cudaStreamSynchronize(stream_));
    } catch (...) {
      release(true);
      throw;
    }
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  //! Destroyed while an exception unwinds (this rank failed), the communicator is aborted instead of destroyed, so
  //! that its end never waits for peers.
  ~NcclComm() {
    const bool aborting = std::uncaught_exceptions() > 0;
    worker_.reset();  // finish queued operations before the communicator goes
    if (aborting) abort_comm();  // what the watchdog still watches ends at once
    stop_watchdog();             // else it finishes, or times out, first
    if (failure_ && !failure_reported_) {  // an ordered operation failed, and no operation came after to say so
      try {
        std::rethrow_exception(failure_);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
      }
    }
    release(aborting);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const GroupInfo& group() const { return info_; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  ncclComm_t native() const { return comm_; }

  Handle start(Op&& op, bool async) {
    if (!op.stream) return worker_->run([this, op = std::move(op)]() mutable { run(op, nullptr, nullptr); }, async);
    // Ordered on the caller's stream: an event recorded here, on the caller's thread, marks what it queued so far;
    // the caller's stream waits for the operation where the caller waits for its handle.
    LOOM_CUDA(cudaSetDevice(device_));
    auto* const caller = *op.stream ? static_cast<cudaStream_t>(*op.stream) : cudaStreamLegacy;
    EventBack ready{this, take_event()};
    LOOM_CUDA(cudaEventRecord(ready.event, caller));
    auto on_device = std::make_shared<OnDevice>();
    Handle h = worker_->run(
        [this, op = std::move(op), ready = ready.release(), on_device]() mutable {
          EventBack back{this, ready};  // given back unless the operation went on the device alone
          run(op, &back, on_device.get());
        },
        async);
    return std::move(h).then([this, caller, on_device](bool ok) {
      if (!ok || !on_device->done) return;  // failed (its events are back), or complete already (host buffers)
      // The legacy stream is the current device's: the waiting thread's may be another. Its device is put back
      // only where it chose one (setting device 0 by default would make a context there).
      int current = device_;
      cudaGetDevice(&current);
      const bool other = current != device_;
      if (other) cudaSetDevice(device_);
      const cudaError_t rc = cudaStreamWaitEvent(caller, on_device->done, 0);
      if (other && loom::chosen_device() >= 0) cudaSetDevice(current);
      watch(std::move(*on_device));  // its events go back once it is done, however this ends
      LOOM_CUDA(rc);
    });
  }

 private:
  using Clock = std::chrono::steady_clock;

  //! An event of the pool, given back when this goes unless released.
  struct EventBack {
    NcclComm* comm;
    cudaEvent_t event;
    EventBack(NcclComm* c, cudaEvent_t e) : comm(c), event(e) {}
    EventBack(const EventBack&) = delete;
    EventBack& operator=(const EventBack&) = delete;
    ~EventBack() {
      if (event) comm->give_event(event);
    }
    cudaEvent_t release() { return std::exchange(event, nullptr); }
  };
  //! An operation ordered on the caller's stream that went on the device alone (every buffer device memory): the
  //! event the caller's stream reached when it was issued (ready) and the one after it on stream() (done), for the
  //! caller's wait and the watchdog.
  struct OnDevice {
    cudaEvent_t ready = nullptr, done = nullptr;
    std::string what, op;
  };

  //! Runs op on stream(). Ordered on the caller's stream (`ready` holds the event of that stream, Op::stream): after
  //! that event; then, with its buffers all in device memory, its events go to `on_device` for the caller's wait and
  //! the watchdog, and the thread does not wait. Otherwise the thread waits for its end.
  void run(Op& op, EventBack* ready, OnDevice* on_device) {
    Staged staged;  // what it stages is freed however it ends
    report_failure(op);
    const std::uint64_t seq = ++seq_;
    const auto t0 = Clock::now();
    LOOM_CUDA(cudaSetDevice(device_));  // current device is per thread; the worker has its own
    // Host buffers are staged before the communicator's lock is taken: a copy from pageable memory may wait for the
    // stream, and where an earlier operation is stuck there, the watchdog must still take the lock to abort it.
    try {
      if (ready) LOOM_CUDA(cudaStreamWaitEvent(stream_, ready->event, 0));
      staged = stage(op);
    } catch (...) {
      abort_comm();  // the operation is not issued: the ranks' sequences of operations no longer match
      throw;
    }
    {
      const std::lock_guard lk(comm_mutex_);
      if (!comm_) {
        report_failure(op);  // the watchdog's reason, where it aborted the communicator since the check above
        throw aborted(op);
      }
      try {
        enqueue(op);
        // Its kernels are on the stream once the communicator has settled (non-blocking: a first operation between
        // two ranks connects them in the background).
        settle(what_of(op, seq), t0 + timeout_);
        if (ready && staged.all.empty()) {
          EventBack done{this, take_event()};
          LOOM_CUDA(cudaEventRecord(done.event, stream_));
          on_device->what = what_of(op, seq), on_device->op = describe(op);
          on_device->done = done.release(), on_device->ready = ready->release();
          return;
        }
        LOOM_CUDA(cudaEventRecord(done_, stream_));
      } catch (...) {
        abort_locked();
        throw;
      }
    }
    wait(op, seq, t0);
    staged.back();  // once the operation is done: a copy to pageable memory blocks the thread
  }

  Error aborted(const Op& op) const {
    return Error(loom::detail::cat("loom: ", name_of(op.kind), " on group ", info_.describe(), ", global rank ",
                                   global_rank(), ": the NCCL communicator was aborted by an earlier failure"));
  }

  void enqueue(Op& op) {
    const ncclDataType_t t = detail::nccl_type(op.dtype);
    const std::size_t es = size_of(op.dtype);
    const std::size_t c = op.count;
    auto at = [](const void* p, std::size_t bytes) { return static_cast<const char*>(p) + bytes; };
    auto at_mut = [](void* p, std::size_t bytes) { return static_cast<char*>(p) + bytes; };
    // One rank: every collective's result is its input, so it is a copy on the stream (or nothing), exact for every
    // reduction and every element type; NCCL's own one-rank path is not used. Sends and receives go to NCCL.
    if (size_ == 1 && op.kind != Collective::send_recv) {
      std::size_t bytes = c * es;
      if (op.kind == Collective::all_to_all_v) bytes = op.recv_counts[0] * es;
      const void* from = op.kind == Collective::all_to_all_v ? at(op.send, op.send_displs[0] * es) : op.send;
      void* to = op.kind == Collective::all_to_all_v ? at_mut(op.recv, op.recv_displs[0] * es) : op.recv;
      const bool copies = op.kind != Collective::barrier && op.kind != Collective::broadcast;
      if (copies && bytes && from && from != to)
        LOOM_CUDA(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, stream_));
      return;
    }
    switch (op.kind) {
      case Collective::barrier:
        LOOM_NCCL_ISSUE(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_));
        return;
      case Collective::all_reduce:
        if (c) LOOM_NCCL_ISSUE(ncclAllReduce(op.send, op.recv, c, t, detail::nccl_op(op.reduce), comm_, stream_));
        return;
      case Collective::reduce_scatter:
        if (c) LOOM_NCCL_ISSUE(ncclReduceScatter(op.send, op.recv, c, t, detail::nccl_op(op.reduce), comm_, stream_));
        return;
      case Collective::all_gather:
        if (c) LOOM_NCCL_ISSUE(ncclAllGather(op.send, op.recv, c, t, comm_, stream_));
        return;
      case Collective::broadcast:
        if (c) LOOM_NCCL_ISSUE(ncclBroadcast(op.recv, op.recv, c, t, op.root, comm_, stream_));
        return;
      case Collective::reduce:
        if (c) LOOM_NCCL_ISSUE(ncclReduce(op.send, op.recv, c, t, detail::nccl_op(op.reduce), op.root, comm_, stream_));
        return;
      case Collective::all_to_all:
        if (c)
          grouped([&] {
            for (int q = 0; q < size_; ++q) {
              LOOM_NCCL_ISSUE(ncclSend(at(op.send, q * c * es), c, t, q, comm_, stream_));
              LOOM_NCCL_ISSUE(ncclRecv(at_mut(op.recv, q * c * es), c, t, q, comm_, stream_));
            }
          });
        return;
      case Collective::all_to_all_v:
        // A zero-length block is skipped on both sides, since counts agree pairwise.
        grouped([&] {
          for (int q = 0; q < size_; ++q) {
            if (op.send_counts[q])
              LOOM_NCCL_ISSUE(ncclSend(at(op.send, op.send_displs[q] * es), op.send_counts[q], t, q, comm_, stream_));
            if (op.recv_counts[q])
              LOOM_NCCL_ISSUE(ncclRecv(at_mut(op.recv, op.recv_displs[q] * es), op.recv_counts[q], t, q, comm_, stream_));
          }
        });
        return;
      case Collective::send_recv:
        grouped([&] {
          for (const auto& p : op.p2p) {
            if (!p.count) continue;
            if (p.kind == P2P::Kind::send)
              LOOM_NCCL_ISSUE(ncclSend(p.data, p.count, detail::nccl_type(p.dtype), p.peer, comm_, stream_));
            else
              LOOM_NCCL_ISSUE(ncclRecv(p.data, p.count, detail::nccl_type(p.dtype), p.peer, comm_, stream_));
          }
        });
        return;
    }
  }

  //! The host buffers of an operation, each in device memory of its own for the operation: copied there before it
  //! (what it reads), copied back after it (what it writes), and freed, all on the stream.
  struct Staged {
    struct Buffer {
      void* host;
      void* device = nullptr;
      std::size_t bytes = 0;
      bool in = false, out = false;
    };
    std::vector<Buffer> all;
    cudaStream_t stream = nullptr;
    Staged() = default;
    Staged(Staged&& o) noexcept : all(std::exchange(o.all, {})), stream(o.stream) {}
    Staged& operator=(Staged&& o) noexcept {
      std::swap(all, o.all), std::swap(stream, o.stream);
      return *this;
    }
    ~Staged() {
      for (const Buffer& b : all)
        if (b.device) cudaFreeAsync(b.device, stream);
    }
    //! What the operation wrote, into host memory (nothing to wait for where nothing was staged).
    void back() {
      if (all.empty()) return;
      for (const Buffer& b : all)
        if (b.out) LOOM_CUDA(cudaMemcpyAsync(b.host, b.device, b.bytes, cudaMemcpyDeviceToHost, stream));
      LOOM_CUDA(cudaStreamSynchronize(stream));
    }
  };
  //! Whether p is memory the device reads (its own, or managed); else host memory, which NCCL does not take.
  static bool device_memory(const void* p) { return kernels::cuda::detail::device_memory(p); }
  //! Replaces op's host buffers by staged device copies (Staged), the bytes each is read or written over.
  Staged stage(Op& op) {
    Staged s;
    s.stream = stream_;
    if (op.kind == Collective::barrier) return s;
    const std::size_t es = size_of(op.dtype), c = op.count, n = static_cast<std::size_t>(size_);
    auto extent = [&](const std::vector<std::size_t>& counts, const std::vector<std::size_t>& displs) {
      std::size_t e = 0;
      for (std::size_t q = 0; q < counts.size(); ++q) e = std::max(e, displs[q] + counts[q]);
      return e * es;
    };
    std::vector<std::pair<void**, Staged::Buffer>> wants;  // where the pointer is, and what it holds
    auto want = [&](void** at, std::size_t bytes, bool in, bool out) {
      if (*at && bytes) wants.push_back({at, Staged::Buffer{*at, nullptr, bytes, in, out}});
    };
    void* send = const_cast<void*>(op.send);
    switch (op.kind) {
      case Collective::all_reduce: want(&send, c * es, true, false), want(&op.recv, c * es, false, true); break;
      case Collective::reduce:  // recv is the root's alone: elsewhere NCCL gets device memory and nothing comes back
        want(&send, c * es, true, false), want(&op.recv, c * es, false, rank_ == op.root);
        break;
      case Collective::reduce_scatter: want(&send, c * n * es, true, false), want(&op.recv, c * es, false, true); break;
      case Collective::all_gather: want(&send, c * es, true, false), want(&op.recv, c * n * es, false, true); break;
      case Collective::broadcast: want(&op.recv, c * es, true, true); break;
      case Collective::all_to_all: want(&send, c * n * es, true, false), want(&op.recv, c * n * es, false, true); break;
      case Collective::all_to_all_v:
        want(&send, extent(op.send_counts, op.send_displs), true, false);
        // In and out: what falls between the blocks received keeps its values.
        want(&op.recv, extent(op.recv_counts, op.recv_displs), true, true);
        break;
      case Collective::send_recv:
        for (auto& p : op.p2p)
          want(&p.data, p.count * size_of(p.dtype), p.kind == P2P::Kind::send, p.kind == P2P::Kind::recv);
        break;
      case Collective::barrier: break;
    }
    for (auto& [at, b] : wants) {
      if (device_memory(b.host)) continue;
      auto same = std::find_if(s.all.begin(), s.all.end(), [&](const Staged::Buffer& x) { return x.host == b.host; });
      if (same == s.all.end()) {
        s.all.push_back(b);
        same = s.all.end() - 1;
      } else {  // an operation in place: one copy, read and written
        same->bytes = std::max(same->bytes, b.bytes), same->in = same->in || b.in, same->out = same->out || b.out;
      }
    }
    for (auto& b : s.all) {
      LOOM_CUDA(cudaMallocAsync(&b.device, b.bytes, stream_));
      if (b.in) LOOM_CUDA(cudaMemcpyAsync(b.device, b.host, b.bytes, cudaMemcpyHostToDevice, stream_));
    }
    for (auto& [at, b] : wants)
      for (const auto& x : s.all)
        if (x.host == b.host) *at = x.device;
    op.send = send;
    return s;
  }

  //! Issues fn's sends and receives as one NCCL group; the group is closed even when one of them fails.
  template <class F>
  void grouped(F&& fn) {
    LOOM_NCCL(ncclGroupStart());
    try {
      fn();
    } catch (...) {
      ncclGroupEnd();
      throw;
    }
    LOOM_NCCL_ISSUE(ncclGroupEnd());
  }

  //! Waits until what the non-blocking communicator does in the background (its set-up, an operation's enqueueing)
  //! is done; an error, or the deadline passing, aborts the communicator and throws, naming `what`. With
  //! comm_mutex_ held (or before the watchdog starts).
  void settle(const std::string& what, Clock::time_point deadline) {
    const auto t0 = Clock::now();
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
      if (rc == ncclSuccess && state == ncclSuccess) return;
      if (rc != ncclSuccess || state != ncclInProgress) {
        const std::string text = detail::nccl_text(rc != ncclSuccess ? rc : state);
        abort_locked();
        throw BackendError(loom::detail::cat(what, " failed on global rank ", global_rank(), ": ", text));
      }
      const auto now = Clock::now();
      if (now >= deadline) {
        abort_locked();
        throw TimeoutError(loom::detail::cat(what, " did not finish within ", describe_timeout(timeout_),
                                             " on global rank ", global_rank(),
                                             ": a member of the group is missing or stuck; the NCCL communicator was "
                                             "aborted"));
      }
      if (now - t0 < std::chrono::milliseconds(2)) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  //! Polls the operation's event and the communicator's asynchronous error until it completes or the timeout from
  //! t0 passes.
  void wait(const Op& op, std::uint64_t seq, Clock::time_point t0) {
    const auto deadline = t0 + timeout_;
    for (;;) {
      const cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) {
        // Done, unless the watchdog aborted the communicator under it (its kernels then end early).
        const std::lock_guard lk(comm_mutex_);
        if (comm_) return;
        report_failure(op);
        throw aborted(op);
      }
      if (q != cudaErrorNotReady) {
        abort_comm();
        throw BackendError(loom::detail::cat(what_of(op, seq), " failed on global rank ", global_rank(),
                                             ": cudaEventQuery: ", cudaGetErrorString(q), " (", cudaGetErrorName(q),
                                             ")"));
      }
      if (const std::string text = async_error(); !text.empty()) {
        abort_comm();
        throw BackendError(loom::detail::cat(what_of(op, seq), " failed on global rank ", global_rank(), ": ", text));
      }
      const auto now = Clock::now();
      if (now >= deadline) {
        abort_comm();
        throw TimeoutError(loom::detail::cat(
            what_of(op, seq), " timed out after ", describe_timeout(timeout_), " on global rank ",
            global_rank(), " (", describe(op), "); the NCCL communicator was aborted"));
      }
      // Spin briefly for small operations' latency, then stop burning the core.
      if (now - t0 < std::chrono::milliseconds(2)) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  //! "loom: all_reduce #3 on group dp{1,3}", as the Mpi watchdog names an operation.
  std::string what_of(const Op& op, std::uint64_t seq) const {
    return loom::detail::cat("loom: ", name_of(op.kind), " #", seq, " on group ", info_.describe());
  }
  int global_rank() const { return info_.ranks.empty() ? rank_ : info_.ranks[rank_]; }

  //! NCCL's text for an error the communicator met in the background, or "" (also where it was aborted: whoever
  //! aborted it reports why).
  std::string async_error() {
    const std::lock_guard lk(comm_mutex_);
    if (!comm_) return {};
    ncclResult_t state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
    if (rc == ncclSuccess && (state == ncclSuccess || state == ncclInProgress)) return {};
    return detail::nccl_text(rc != ncclSuccess ? rc : state);
  }

  //! Aborts the communicator: the kernels waiting on it end, and every later operation fails. abort_locked: with
  //! comm_mutex_ held.
  void abort_comm() noexcept {
    ncclComm_t c = nullptr;
    {
      const std::lock_guard lk(comm_mutex_);
      c = std::exchange(comm_, nullptr);
    }
    if (c) ncclCommAbort(c);  // the others see no communicator meanwhile, rather than wait for the abort
  }
  void abort_locked() noexcept {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  // --- Events of stream-ordered operations: taken where one is recorded, given back once the wait that reads it is
  // queued (cudaStreamWaitEvent reads the event's latest record when called) or the operation it marks is done.
  cudaEvent_t take_event() {
    {
      const std::lock_guard lk(events_mutex_);
      if (!free_events_.empty()) {
        const cudaEvent_t e = free_events_.back();
        free_events_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    LOOM_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void give_event(cudaEvent_t e) noexcept {
    const std::lock_guard lk(events_mutex_);
    free_events_.push_back(e);
  }

  // --- The watchdog: the stream-ordered operations the caller's stream waits for, oldest first.
  struct Watched {
    OnDevice op;
    Clock::time_point handed;                   //!< when the caller waited for it
    std::optional<Clock::time_point> deadline;  //!< from when the caller's stream reached the operation
  };
  //! Hands an ordered operation's events to the watchdog (started by the first), which gives them back.
  void watch(OnDevice&& op) {
    const std::lock_guard lk(watch_mutex_);
    if (!watchdog_.joinable()) watchdog_ = std::thread([this] { watch_loop(); });
    watched_.push_back({std::move(op), Clock::now(), std::nullopt});
    watch_cv_.notify_one();
  }
  //! Polls the oldest watched operation every millisecond: its timeout runs from when the caller's stream reaches
  //! it (its `ready` event), since the host runs ahead of the device; done, it goes; failed, or past its deadline, the
  //! failure is kept for the next operation (report_failure) and the communicator aborted, so that the kernels
  //! waiting on it end. A caller's stream that does not reach it within the timeout of the caller's wait is stuck
  //! before it, on work of its own: that is kept as the failure too, without an abort (the communicator's kernels are
  //! not what waits), and nothing more is watched. Ends when stopping and nothing is left.
  void watch_loop() {
    cudaSetDevice(device_);
    std::unique_lock lk(watch_mutex_);
    for (;;) {
      watch_cv_.wait(lk, [&] { return stopping_ || !watched_.empty(); });
      if (watched_.empty()) return;
      Watched& w = watched_.front();  // only this thread removes or changes entries; the others append
      lk.unlock();
      std::string failure;
      bool timed_out = false, finished = false, stuck = false;
      const auto now = Clock::now();
      const cudaError_t q = cudaEventQuery(w.op.done);
      if (q == cudaSuccess) {
        finished = true;
      } else if (q != cudaErrorNotReady) {
        failure = loom::detail::cat(w.op.what, " failed on global rank ", global_rank(), ": cudaEventQuery: ",
                                    cudaGetErrorString(q), " (", cudaGetErrorName(q), ")");
      } else if (std::string text = async_error(); !text.empty()) {
        failure = loom::detail::cat(w.op.what, " failed on global rank ", global_rank(), ": ", text);
      } else if (!w.deadline) {
        if (cudaEventQuery(w.op.ready) == cudaSuccess) {
          w.deadline = now + timeout_;
        } else if (now >= w.handed + timeout_) {
          timed_out = stuck = true;
          failure = loom::detail::cat(w.op.what, " did not start within ", describe_timeout(timeout_),
                                      " on global rank ", global_rank(), " (", w.op.op, "): the caller's stream did not "
                                      "reach it, held by the work queued there before it");
        }
      } else if (now >= *w.deadline) {
        timed_out = true;
        failure = loom::detail::cat(w.op.what, " timed out after ", describe_timeout(timeout_), " on global rank ",
                                    global_rank(), " (", w.op.op, ", ordered on the caller's stream); the NCCL "
                                    "communicator was aborted");
      }
      lk.lock();
      if (finished) {
        give_event(w.op.ready), give_event(w.op.done);
        watched_.pop_front();
        continue;
      }
      if (!failure.empty()) {
        if (!failure_)  // kept before the abort: an operation that then finds no communicator reports it
          failure_ = timed_out ? std::make_exception_ptr(TimeoutError(failure))
                               : std::make_exception_ptr(BackendError(failure));
        for (const Watched& x : watched_) give_event(x.op.ready), give_event(x.op.done);
        watched_.clear();  // nothing more is watched on an aborted communicator
        if (!stuck) {
          lk.unlock();
          abort_comm();
          lk.lock();
        }
        continue;
      }
      watch_cv_.wait_for(lk, std::chrono::milliseconds(1), [&] { return stopping_ && watched_.empty(); });
    }
  }
  //! Throws what the watchdog met: the failure itself the first time, then that the communicator is out of use.
  void report_failure(const Op& op) {
    const std::lock_guard lk(watch_mutex_);
    if (!failure_) return;
    if (!failure_reported_) {
      failure_reported_ = true;
      std::rethrow_exception(failure_);
    }
    throw aborted(op);
  }
  void stop_watchdog() noexcept {
    {
      const std::lock_guard lk(watch_mutex_);
      stopping_ = true;
    }
    watch_cv_.notify_one();
    if (watchdog_.joinable()) watchdog_.join();
  }

  //! Finalises the communicator (what it still does in the background, done), within the timeout; false where that
  //! failed or took longer, and the communicator is then aborted rather than destroyed.
  bool finalize() noexcept {
    const ncclResult_t rc = ncclCommFinalize(comm_);
    if (rc != ncclSuccess && rc != ncclInProgress) return false;
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) return false;
      if (state == ncclSuccess) return true;
      if (state != ncclInProgress || Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  void release(bool aborting) noexcept {
    cudaSetDevice(device_);
    if (comm_) {
      if (!aborting && finalize()) ncclCommDestroy(comm_);
      else ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    if (scratch_) cudaFree(scratch_);
    for (const cudaEvent_t e : free_events_) cudaEventDestroy(e);
    free_events_.clear();
    if (done_) cudaEventDestroy(done_);
    if (stream_) cudaStreamDestroy(stream_);
    scratch_ = nullptr, done_ = nullptr, stream_ = nullptr;
  }

  GroupInfo info_;
  int device_ = 0;
  std::chrono::milliseconds timeout_;
  int rank_ = 0, size_ = 1;
  std::uint64_t seq_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  std::int32_t* scratch_ = nullptr;  // the barrier's one element
  std::mutex comm_mutex_;  // comm_'s use against its abort by the watchdog
  std::mutex events_mutex_;
  std::vector<cudaEvent_t> free_events_;
  std::mutex watch_mutex_;  // what follows
  std::condition_variable watch_cv_;
  std::deque<Watched> watched_;
  bool stopping_ = false, failure_reported_ = false;
  std::exception_ptr failure_;
  std::thread watchdog_;
  std::unique_ptr<detail::SerialWorker> worker_ = std::make_unique<detail::SerialWorker>();
};

//! The Nccl backend for Context<Cfg, Nccl>.
struct Nccl {
  using Comm = NcclComm;
  struct Rank {
    int rank;
    int device;  //!< this rank's GPU
    std::unique_ptr<Comm> make(const GroupInfo& g) const { return std::make_unique<Comm>(g, device); }
  };
};

static_assert(Communicator<NcclComm>);

}  // namespace loom::comm

namespace loom {

//! Runs fn(Context<Cfg, comm::Nccl>&) in this process, one rank of a job started by mpirun or srun with one GPU per
//! rank (the local rank modulo the visible devices), and returns the exit code for main. Launch checks and failure
//! handling are run_mpi's: a wrong process count makes every rank return 1 after one message; a rank that throws
//! prints the failure and aborts the whole job.
template <class Cfg, class F>
  requires std::invocable<F&, Context<Cfg, comm::Nccl>&>
int run_nccl(int& argc, char**& argv, F&& fn) {
  return comm::detail::mpi_main<Cfg>(argc, argv, [&](int rank) {
    Context<Cfg, comm::Nccl> ctx(comm::Nccl::Rank{rank, comm::detail::pick_device(rank)});
    fn(ctx);
    // Every rank's operations have finished before any communicator goes, so none is torn down while a peer's
    // transfers through it are still in flight.
    comm::detail::world_barrier("the barrier before the communicators go");
  });
}

}  // namespace loom

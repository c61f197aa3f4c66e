// The definitions of the Local backend's non-template members, and of its collectives' algorithms. Private:
// include <loom/comm/local.hpp>, which includes this file in a header-only build; with LOOM_EXTERN_KERNELS they are
// compiled once in loom::cpu_kernels (src/compiled.cpp).
#pragma once

#ifndef LOOM_COMM_LOCAL_INCLUDED
#error "loom: comm/detail/ is private: include <loom/comm/local.hpp>"
#endif

namespace loom::comm {
namespace detail {

LOOM_COMPILED std::shared_ptr<LocalGroup> LocalWorld::group(const GroupInfo& info) {
  std::lock_guard lk(m_);
  auto& g = groups_[{info.name, info.ranks}];
  if (!g) g = std::make_shared<LocalGroup>(this, info);
  return g;
}

LOOM_COMPILED void LocalWorld::abort(int rank, const std::string& what) {
  std::vector<std::shared_ptr<LocalGroup>> gs;
  {
    std::lock_guard lk(m_);
    if (aborted_.load()) return;
    failed_rank_ = rank;
    reason_ = what;
    aborted_.store(true);
    for (auto& [k, g] : groups_) gs.push_back(g);
  }
  for (auto& g : gs) {
    std::lock_guard lk(g->m);
    g->cv.notify_all();
  }
}

LOOM_COMPILED std::string LocalWorld::abort_message() const {
  std::lock_guard lk(m_);
  return loom::detail::cat("rank ", failed_rank_, " failed: ", reason_);
}

}  // namespace detail

LOOM_COMPILED LocalComm::LocalComm(std::shared_ptr<detail::LocalGroup> g, int global_rank)
    : g_(std::move(g)), me_(static_cast<int>(std::find(g_->info.ranks.begin(), g_->info.ranks.end(), global_rank) -
                                             g_->info.ranks.begin())) {
  LOOM_CHECK(me_ < g_->n, "global rank ", global_rank, " is not a member of group ", g_->info.describe());
}

LOOM_COMPILED Handle LocalComm::start(Op&& op, bool async) {
  detail::order_on_host(op);  // here, on the caller's thread: what it queued before is what the operation reads
  return worker_.run([this, op = std::move(op)]() mutable { run(op); }, async);
}

template <class Pred, class Describe>
void LocalComm::wait(Lock& lk, detail::Clock::time_point deadline, Pred pred, Describe describe, bool spin) {
  auto& g = *g_;
  if (spin && !pred()) {
    lk.unlock();
    for (int i = 0; i < 256 && !pred(); ++i) std::this_thread::yield();
    lk.lock();
  }
  while (!pred()) {
    if (g.world->aborted())
      throw AbortedError(loom::detail::cat("loom: ", describe(false), " was abandoned because ",
                                     g.world->abort_message()));
    const auto now = detail::Clock::now();
    if (now >= deadline) throw TimeoutError(loom::detail::cat("loom: ", describe(true)));
    g.cv.wait_until(lk, std::min(deadline, now + std::chrono::milliseconds(50)));
  }
}

LOOM_COMPILED std::string LocalComm::timeout_text() const { return describe_timeout(g_->world->options().timeout); }

LOOM_COMPILED std::string LocalComm::where(std::uint64_t seq, const Op& op) const {
  return loom::detail::cat(name_of(op.kind), " #", seq, " on group ", g_->info.describe(), " (this is global rank ",
                     g_->info.ranks[me_], ", group rank ", me_, ")");
}

LOOM_COMPILED std::string LocalComm::laggards(std::atomic<std::uint64_t> detail::LocalGroup::Member::*field, std::uint64_t target,
                     bool steps) const {
  std::string s;
  for (int q = 0; q < g_->n; ++q) {
    const auto v = (g_->mem[q].*field).load();
    if (v >= target) continue;
    s += loom::detail::cat(s.empty() ? "" : ", ", "global rank ", g_->info.ranks[q], " (group rank ", q, ", at ");
    s += steps ? loom::detail::cat("#", v >> 20, " step ", v & 0xfffff, ")")
               : (v ? loom::detail::cat("#", v, ")") : std::string("none yet)"));
  }
  return s;
}

LOOM_COMPILED void LocalComm::run(Op& op) {
  trace::Scope span(name_of(op.kind).data(), "comm");
  if (op.kind == Collective::send_recv) return run_p2p(op);
  auto& g = *g_;
  const auto deadline = detail::Clock::now() + g.world->options().timeout;
  const std::uint64_t seq = ++g.mem[me_].next_seq;
  // A rank that arrives after its world failed touches nothing: its peers may be gone.
  if (g.world->aborted()) throw abandoned(where(seq, op));
  std::string mismatch;
  try {
    mismatch = collective(seq, op, deadline);
  } catch (const std::exception& e) {
    leave(seq, e.what());
    throw;
  } catch (...) {
    leave(seq, "a non-standard exception");
    throw;
  }
  if (!mismatch.empty()) throw MismatchError(mismatch);
}

LOOM_COMPILED AbortedError LocalComm::abandoned(const std::string& what) const {
  return AbortedError(loom::detail::cat("loom: ", what, " was abandoned because ", g_->world->abort_message()));
}

LOOM_COMPILED void LocalComm::wait_all(Lock& lk, std::uint64_t seq, const Op& op, detail::Clock::time_point deadline,
                                       std::atomic<std::uint64_t> detail::LocalGroup::Member::*field,
                                       const char* waiting, const std::string& also) {
  auto& g = *g_;
  wait(lk, deadline,
       [&] { return std::all_of(g.mem.begin(), g.mem.end(), [&](auto& x) { return (x.*field) >= seq; }); },
       [&](bool timed_out) {
         return timed_out ? loom::detail::cat(where(seq, op), " timed out after ", timeout_text(), " waiting for ranks ",
                                              waiting, ": ", laggards(field, seq, false), also)
                          : where(seq, op);
       }, true);
}

LOOM_COMPILED std::string LocalComm::collective(std::uint64_t seq, Op& op, detail::Clock::time_point deadline) {
  auto& g = *g_;
  const Algorithm algo = op.kind == Collective::all_reduce ? algorithm_for(op.count * size_of(op.dtype))
                                                           : Algorithm::direct;
  mv_ = detail::Mover::for_buffers(op.send, op.recv);
  if (op.kind == Collective::all_reduce && algo != Algorithm::direct && op.send != op.recv && op.count)
    mv_.copy(op.recv, op.send, op.count * size_of(op.dtype));
  {
    Lock lk(g.m);
    g.mem[me_].op = &op;
    g.mem[me_].device = mv_.dev != nullptr;
    g.mem[me_].arrived = seq;
    g.mem[me_].progress = detail::step_key(seq, 0);
    g.cv.notify_all();
    wait_all(lk, seq, op, deadline, &detail::LocalGroup::Member::arrived, "that have not entered it",
             "; this rank called " + describe(op));
    // Decided under the lock that every member holds it: from here on a member that fails waits for this one
    // to be done with its buffers before it frees them (leave()).
    g.mem[me_].passed = seq;
  }
  std::string mismatch = validate(seq);
  if (mismatch.empty()) {
    visit_dtype(op.dtype,
                [&](auto tag) { execute<detail::host_t<typename decltype(tag)::type>>(seq, op, algo, deadline); });
  }
  {
    Lock lk(g.m);
    g.mem[me_].done = seq;
    g.cv.notify_all();
    wait_all(lk, seq, op, deadline, &detail::LocalGroup::Member::done, "to finish it", "");
  }
  return mismatch;
}

LOOM_COMPILED void LocalComm::leave(std::uint64_t seq, const std::string& what) noexcept {
  auto& g = *g_;
  {
    Lock lk(g.m);
    auto& self = g.mem[me_];
    if (self.arrived.load() == seq) self.arrived = seq - 1;
    self.left = seq;
    g.cv.notify_all();
  }
  g.world->abort(g.info.ranks[me_], what);  // no effect when the world has already failed
  const auto until = detail::Clock::now() + g.world->options().timeout;
  Lock lk(g.m);
  auto reader = [&] {
    for (int q = 0; q < g.n; ++q)
      if (q != me_ && g.mem[q].passed == seq && g.mem[q].done < seq && g.mem[q].left < seq) return q;
    return -1;
  };
  for (int q = reader(); q >= 0; q = reader()) {
    const auto now = detail::Clock::now();
    if (now >= until) {
      std::fprintf(stderr, "loom: global rank %d leaves collective #%llu on group %s while global rank %d is still "
                   "inside it after %s\n", g.info.ranks[me_], static_cast<unsigned long long>(seq),
                   g.info.describe().c_str(), g.info.ranks[q], timeout_text().c_str());
      return;
    }
    g.cv.wait_until(lk, std::min(until, now + std::chrono::milliseconds(50)));
  }
}

LOOM_COMPILED std::string LocalComm::validate(std::uint64_t seq) const {
  auto& g = *g_;
  const Op& a = *g.mem[0].op;
  for (int q = 1; q < g.n; ++q) {
    const Op& b = *g.mem[q].op;
    const bool same = a.kind == b.kind && (a.kind == Collective::barrier ||
                      (a.dtype == b.dtype && (a.kind == Collective::all_to_all_v || a.count == b.count) &&
                       a.reduce == b.reduce && a.root == b.root));
    if (!same)
      return loom::detail::cat("loom: ranks of group ", g.info.describe(), " disagree at collective #", seq,
                         ": global rank ", g.info.ranks[0], " called ", describe(a), " but global rank ",
                         g.info.ranks[q], " called ", describe(b));
    if (a.kind != Collective::barrier && g.mem[0].device != g.mem[q].device)
      return loom::detail::cat("loom: ranks of group ", g.info.describe(), " disagree at collective #", seq,
                         " (", describe(a), "): global rank ", g.info.ranks[0], " passed ",
                         g.mem[0].device ? "device" : "host", " memory but global rank ", g.info.ranks[q],
                         " passed ", g.mem[q].device ? "device" : "host", " memory");
  }
  if (a.kind == Collective::all_to_all_v) {
    for (int p = 0; p < g.n; ++p)
      for (int q = 0; q < g.n; ++q) {
        const auto s = g.mem[p].op->send_counts[q], r = g.mem[q].op->recv_counts[p];
        if (s != r)
          return loom::detail::cat("loom: all_to_all_v #", seq, " on group ", g.info.describe(), ": group rank ", p,
                             " sends ", s, " elements to group rank ", q, ", which expects ", r);
      }
  }
  return {};
}

LOOM_COMPILED void LocalComm::advance(std::uint64_t seq, std::uint64_t steps) {
  Lock lk(g_->m);
  g_->mem[me_].progress = detail::step_key(seq, steps);
  g_->cv.notify_all();
}

LOOM_COMPILED void LocalComm::await(int q, std::uint64_t seq, std::uint64_t steps, const Op& op, detail::Clock::time_point deadline) {
  Lock lk(g_->m);
  const auto key = detail::step_key(seq, steps);
  wait(lk, deadline, [&] { return g_->mem[q].progress >= key; }, [&](bool timed_out) {
    return timed_out ? loom::detail::cat(where(seq, op), " timed out after ", timeout_text(), " at step ", steps,
                                   " waiting for ", laggards(&detail::LocalGroup::Member::progress, key, true))
                     : where(seq, op);
  }, true);
}

LOOM_COMPILED void LocalComm::run_p2p(const Op& op) {
  auto& g = *g_;
  const auto deadline = detail::Clock::now() + g.world->options().timeout;
  if (g.world->aborted()) throw abandoned(loom::detail::cat("send/recv on group ", g.info.describe()));
  Posted posted;
  try {
    serve_p2p(op, deadline, posted);
  } catch (const MismatchError&) {  // told to both sides; the message was refused, not read
    withdraw(posted, {});
    throw;
  } catch (const std::exception& e) {
    withdraw(posted, e.what());
    throw;
  } catch (...) {
    withdraw(posted, "a non-standard exception");
    throw;
  }
}

LOOM_COMPILED void LocalComm::serve_p2p(const Op& op, detail::Clock::time_point deadline, Posted& posted) {
  auto& g = *g_;
  {
    Lock lk(g.m);
    for (const auto& p : op.p2p) {
      if (p.kind != P2P::Kind::send) continue;
      const int slot = me_ * g.n + p.peer;
      auto msg = std::make_shared<detail::LocalGroup::Msg>(
          detail::LocalGroup::Msg{p.data, p.count, p.dtype, ++g.sent[slot], false, {}});
      g.box[slot].push_back(msg);
      posted.emplace_back(std::move(msg), p.peer);
    }
    g.cv.notify_all();
  }
  auto p2p_where = [&](const char* what, int peer, std::uint64_t seq) {
    return loom::detail::cat(what, " #", seq, " between global ranks ", g.info.ranks[me_], " and ",
                             g.info.ranks[peer], " on group ", g.info.describe());
  };
  for (const auto& p : op.p2p) {
    if (p.kind != P2P::Kind::recv) continue;
    const int slot = p.peer * g.n + me_;
    Lock lk(g.m);
    const std::uint64_t seq = g.received[slot] + 1;
    wait(lk, deadline, [&] { return !g.box[slot].empty(); }, [&](bool timed_out) {
      return timed_out ? loom::detail::cat(p2p_where("recv", p.peer, seq), " timed out after ", timeout_text(),
                                     ": global rank ", g.info.ranks[p.peer], " has posted ", g.sent[slot],
                                     " sends to this rank, this is receive #", seq)
                       : p2p_where("recv", p.peer, seq);
    });
    // Taken out of the box, the message is this rank's to copy; its sender waits for `consumed`.
    auto msg = g.box[slot].front();
    g.box[slot].pop_front();
    ++g.received[slot];
    if (msg->dtype != p.dtype || msg->count != p.count) {
      msg->error = loom::detail::cat("loom: ", p2p_where("send/recv", p.peer, seq), ": global rank ",
                               g.info.ranks[p.peer], " sent ", msg->count, " ", name_of(msg->dtype),
                               " elements but global rank ", g.info.ranks[me_], " expected ", p.count, " ",
                               name_of(p.dtype));
      msg->consumed = true;
      g.cv.notify_all();
      throw MismatchError(msg->error);
    }
    lk.unlock();
    try {
      if (p.count) detail::Mover::for_buffers(p.data, msg->data).copy(p.data, msg->data, p.count * size_of(p.dtype));
    } catch (...) {
      lk.lock();
      msg->consumed = true;
      g.cv.notify_all();
      throw;
    }
    lk.lock();
    msg->consumed = true;
    g.cv.notify_all();
  }
  Lock lk(g.m);
  for (auto& [msg, peer] : posted) {
    wait(lk, deadline, [&] { return msg->consumed; }, [&](bool timed_out) {
      return timed_out ? loom::detail::cat(p2p_where("send", peer, msg->seq), " timed out after ", timeout_text(),
                                     ": global rank ", g.info.ranks[peer], " has not received it")
                       : p2p_where("send", peer, msg->seq);
    });
    if (!msg->error.empty()) throw MismatchError(msg->error);
  }
}

LOOM_COMPILED void LocalComm::withdraw(const Posted& posted, const std::string& what) noexcept {
  auto& g = *g_;
  {
    Lock lk(g.m);
    for (const auto& [msg, peer] : posted) {
      auto& box = g.box[me_ * g.n + peer];
      if (auto it = std::find(box.begin(), box.end(), msg); it != box.end()) {
        box.erase(it);
        msg->consumed = true;
      }
    }
  }
  if (!what.empty()) g.world->abort(g.info.ranks[me_], what);
  const auto until = detail::Clock::now() + g.world->options().timeout;
  Lock lk(g.m);
  for (const auto& [msg, peer] : posted) {
    while (!msg->consumed) {
      const auto now = detail::Clock::now();
      if (now >= until) {
        std::fprintf(stderr, "loom: global rank %d leaves send #%llu to global rank %d on group %s while it is "
                     "still being received after %s\n", g.info.ranks[me_], static_cast<unsigned long long>(msg->seq),
                     g.info.ranks[peer], g.info.describe().c_str(), timeout_text().c_str());
        return;
      }
      g.cv.wait_until(lk, std::min(until, now + std::chrono::milliseconds(50)));
    }
  }
}

template <class T>
void LocalComm::execute(std::uint64_t seq, const Op& op, Algorithm algo, detail::Clock::time_point deadline) {
  const int n = g_->n;
  const std::size_t c = op.count;
  std::vector<const T*> src(n);
  switch (op.kind) {
    case Collective::barrier:
    case Collective::send_recv:
      return;
    case Collective::all_reduce:
      if (algo == Algorithm::ring) return ring_all_reduce<T>(seq, op, deadline);
      if (algo == Algorithm::halving_doubling) return rhd_all_reduce<T>(seq, op, deadline);
      return direct_all_reduce<T>(seq, op, deadline);
    case Collective::reduce_scatter:
      for (int q = 0; q < n; ++q) src[q] = send_of<T>(q) + me_ * c;
      mv_.reduce_sources(static_cast<T*>(op.recv), src.data(), n, c, op.reduce);
      mv_.finish_avg(static_cast<T*>(op.recv), c, n, op.reduce);
      return;
    case Collective::all_gather:
      for (int q = 0; q < n; ++q)
        if (static_cast<T*>(op.recv) + q * c != send_of<T>(q))
          mv_.copy(static_cast<T*>(op.recv) + q * c, send_of<T>(q), c * sizeof(T));
      return;
    case Collective::broadcast:
      if (me_ != op.root && c) mv_.copy(op.recv, recv_of<T>(op.root), c * sizeof(T));
      return;
    case Collective::reduce: {
      // Each rank reduces its slice of the buffer into the root's recv.
      const auto r = detail::chunk(c, n, me_);
      for (int q = 0; q < n; ++q) src[q] = send_of<T>(q) + r.lo;
      T* out = recv_of<T>(op.root) + r.lo;
      mv_.reduce_sources(out, src.data(), n, r.size(), op.reduce);
      mv_.finish_avg(out, r.size(), n, op.reduce);
      return;
    }
    case Collective::all_to_all:
      for (int q = 0; q < n; ++q)
        mv_.copy(static_cast<T*>(op.recv) + q * c, send_of<T>(q) + me_ * c, c * sizeof(T));
      return;
    case Collective::all_to_all_v:
      for (int q = 0; q < n; ++q) {
        const auto* peer = g_->mem[q].op;
        mv_.copy(static_cast<T*>(op.recv) + op.recv_displs[q], send_of<T>(q) + peer->send_displs[me_],
                 op.recv_counts[q] * sizeof(T));
      }
      return;
  }
}

LOOM_COMPILED std::unique_ptr<LocalComm> Local::Rank::make(const GroupInfo& g) const {
  return std::make_unique<LocalComm>(world->group(g), rank);
}

}  // namespace loom::comm

// The Communicator concept and the typed front end every backend shares: collectives over a group, typed on
// element and reduction, each blocking or asynchronous (returning a Handle), with sizes checked at the boundary.
#pragma once

#include <loom/comm/types.hpp>

#include <algorithm>
#include <concepts>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::comm {

//! What loom's layers need of a communicator over one group. Ranks, roots and peers are ranks in that group.
template <class C>
concept Communicator = requires(C& c, const C& cc, std::vector<float>& v, const std::vector<float>& cv,
                                std::vector<std::size_t>& counts, std::vector<P2P> ops) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  { cc.group() } -> std::convertible_to<const GroupInfo&>;
  c.all_reduce(cv, v, Reduce::sum);
  c.all_reduce(v, Reduce::sum);
  c.reduce_scatter(cv, v, Reduce::sum);
  c.all_gather(cv, v);
  c.broadcast(v, 0);
  c.reduce(cv, v, Reduce::sum, 0);
  c.all_to_all(cv, v);
  c.all_to_all_v(cv, counts, counts, v, counts, counts);
  c.send(cv, 0);
  c.recv(v, 0);
  c.exchange(ops);
  c.barrier();
  { c.all_reduce_async(cv, v, Reduce::sum) } -> std::same_as<Handle>;
  { c.exchange_async(ops) } -> std::same_as<Handle>;
};

//! While it lives, what a communicator issues is ordered against one CUDA stream of the caller (Op::stream); when
//! it ends, the ordering before it comes back (scopes nest). Frontend::on_stream makes one.
class [[nodiscard]] StreamOrderScope {
 public:
  StreamOrderScope(std::optional<void*>& order, std::optional<void*> stream)
      : order_(order), before_(std::exchange(order, stream)) {}
  ~StreamOrderScope() { order_ = before_; }
  StreamOrderScope(const StreamOrderScope&) = delete;
  StreamOrderScope& operator=(const StreamOrderScope&) = delete;

 private:
  std::optional<void*>& order_;
  std::optional<void*> before_;
};

//! The typed operations, written once; Derived supplies rank(), size(), group() and
//! `Handle start(Op&&, bool async)`, which runs the operation (to completion unless async).
template <class Derived>
class Frontend {
 public:
  // --- all_reduce: recv[i] = reduce over ranks of send[i]; send and recv may be the same buffer.
  template <Buffer S, Buffer R>
  Handle all_reduce_async(const S& send, R&& recv, Reduce op = Reduce::sum) {
    return go(all_reduce_op(send, recv, op), true);
  }
  template <Buffer S, Buffer R>
  void all_reduce(const S& send, R&& recv, Reduce op = Reduce::sum) {
    go(all_reduce_op(send, recv, op), false).wait();
  }
  template <Buffer B>
  void all_reduce(B&& buf, Reduce op = Reduce::sum) { all_reduce(buf, buf, op); }
  template <Buffer B>
  Handle all_reduce_async(B&& buf, Reduce op = Reduce::sum) { return all_reduce_async(buf, buf, op); }

  // --- reduce_scatter: send holds size() blocks of recv.size(); rank r receives the reduction of block r.
  template <Buffer S, Buffer R>
  Handle reduce_scatter_async(const S& send, R&& recv, Reduce op = Reduce::sum) {
    return go(reduce_scatter_op(send, recv, op), true);
  }
  template <Buffer S, Buffer R>
  void reduce_scatter(const S& send, R&& recv, Reduce op = Reduce::sum) {
    go(reduce_scatter_op(send, recv, op), false).wait();
  }

  // --- all_gather: recv holds size() blocks of send.size(); block r comes from rank r.
  template <Buffer S, Buffer R>
  Handle all_gather_async(const S& send, R&& recv) { return go(all_gather_op(send, recv), true); }
  template <Buffer S, Buffer R>
  void all_gather(const S& send, R&& recv) { go(all_gather_op(send, recv), false).wait(); }

  // --- broadcast: every rank's buf becomes root's.
  template <Buffer B>
  Handle broadcast_async(B&& buf, int root) { return go(broadcast_op(buf, root), true); }
  template <Buffer B>
  void broadcast(B&& buf, int root) { go(broadcast_op(buf, root), false).wait(); }

  // --- reduce: root's recv receives the reduction; recv is ignored (and may be empty) on other ranks.
  template <Buffer S, Buffer R>
  Handle reduce_async(const S& send, R&& recv, Reduce op, int root) { return go(reduce_op(send, recv, op, root), true); }
  template <Buffer S, Buffer R>
  void reduce(const S& send, R&& recv, Reduce op, int root) { go(reduce_op(send, recv, op, root), false).wait(); }

  // --- all_to_all: block q of send goes to rank q; block q of recv comes from rank q. Not in place.
  template <Buffer S, Buffer R>
  Handle all_to_all_async(const S& send, R&& recv) { return go(all_to_all_op(send, recv), true); }
  template <Buffer S, Buffer R>
  void all_to_all(const S& send, R&& recv) { go(all_to_all_op(send, recv), false).wait(); }

  // --- all_to_all_v: send[send_displs[q] .. + send_counts[q]] goes to rank q, which receives it at
  // recv[recv_displs[r] .. + recv_counts[r]]; counts must agree pairwise.
  template <Buffer S, class C1, class C2, Buffer R, class C3, class C4>
  Handle all_to_all_v_async(const S& send, const C1& send_counts, const C2& send_displs, R&& recv,
                            const C3& recv_counts, const C4& recv_displs) {
    return go(all_to_all_v_op(send, send_counts, send_displs, recv, recv_counts, recv_displs), true);
  }
  template <Buffer S, class C1, class C2, Buffer R, class C3, class C4>
  void all_to_all_v(const S& send, const C1& send_counts, const C2& send_displs, R&& recv, const C3& recv_counts,
                    const C4& recv_displs) {
    go(all_to_all_v_op(send, send_counts, send_displs, recv, recv_counts, recv_displs), false).wait();
  }

  // --- point to point. exchange() issues its sends and receives as one group: no order of them deadlocks.
  // Messages between two ranks are matched in the order they were issued.
  Handle exchange_async(std::span<const P2P> ops) { return go(exchange_op(ops), true); }
  void exchange(std::span<const P2P> ops) { go(exchange_op(ops), false).wait(); }
  Handle exchange_async(std::initializer_list<P2P> ops) { return exchange_async(std::span<const P2P>(ops)); }
  void exchange(std::initializer_list<P2P> ops) { exchange(std::span<const P2P>(ops)); }
  template <Buffer S>
  void send(const S& data, int peer) { exchange({send_op(data, peer)}); }
  template <Buffer R>
  void recv(R&& data, int peer) { exchange({recv_op(data, peer)}); }
  template <Buffer S>
  Handle send_async(const S& data, int peer) { return exchange_async({send_op(data, peer)}); }
  template <Buffer R>
  Handle recv_async(R&& data, int peer) { return exchange_async({recv_op(data, peer)}); }

  Handle barrier_async() { return go(Op{}, true); }
  void barrier() { go(Op{}, false).wait(); }

  //! What this communicator has issued since it was made or last reset (Traffic).
  const Traffic& traffic() const { return traffic_; }
  void reset_traffic() { traffic_ = {}; }
  //! Issues an operation already made (what the typed calls above do): counted in traffic(), then started. How
  //! AnyComm hands its operations on, so that the communicator it wraps counts them too.
  Handle issue(Op&& op, bool async) { return go(std::move(op), async); }

  //! Orders the operations issued on this communicator, until the returned scope ends, against the CUDA
  //! stream `stream` (a cudaStream_t; null is the legacy default stream; empty: on the host): each reads what the
  //! work queued on that stream before it wrote, and the work queued there after it completes reads its results
  //! (Op::stream). An operation that already carries a stream (handed on by a wrapper) keeps it.
  StreamOrderScope on_stream(std::optional<void*> stream) { return {order_, stream}; }
  //! The stream operations are ordered on now (empty: the host).
  std::optional<void*> stream_order() const { return order_; }

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
  int n() { return self().size(); }
  Handle go(Op&& op, bool async) {
    if (order_ && !op.stream) op.stream = order_;
    traffic_.note(op, n(), self().rank());
    return self().start(std::move(op), async);
  }

  template <class... Args>
  void check(bool ok, Args&&... args) {
    if (!ok) throw Error(loom::detail::cat("loom: ", std::forward<Args>(args)..., " (group ", self().group().describe(),
                                     ", rank ", self().rank(), ")"));
  }
  template <class S, class R>
  static void same_type() {
    static_assert(std::is_same_v<element_t<S>, element_t<R>>, "loom: send and recv must have the same element type");
  }
  template <class S, class R>
  static Op make(Collective kind, const S& send, R& recv, std::size_t count, Reduce red = Reduce::sum, int root = 0) {
    Op op;
    op.kind = kind;
    op.dtype = dtype_of<element_t<R>>;
    op.reduce = red;
    op.send = std::ranges::data(send);
    op.recv = std::ranges::data(recv);
    op.count = count;
    op.root = root;
    return op;
  }
  void check_root(const char* what, int root) {
    check(root >= 0 && root < n(), what, ": root ", root, " is outside the group of size ", n());
  }
  template <class S, class R>
  Op all_reduce_op(const S& send, R& recv, Reduce red) {
    same_type<S, R>();
    check(std::ranges::size(send) == std::ranges::size(recv), "all_reduce: send has ", std::ranges::size(send),
          " elements but recv has ", std::ranges::size(recv));
    return make(Collective::all_reduce, send, recv, std::ranges::size(recv), red);
  }
  template <class S, class R>
  Op reduce_scatter_op(const S& send, R& recv, Reduce red) {
    same_type<S, R>();
    const auto c = std::ranges::size(recv);
    check(std::ranges::size(send) == c * n(), "reduce_scatter: send has ", std::ranges::size(send),
          " elements but must hold size()*recv.size() = ", n(), "*", c);
    return make(Collective::reduce_scatter, send, recv, c, red);
  }
  template <class S, class R>
  Op all_gather_op(const S& send, R& recv) {
    same_type<S, R>();
    const auto c = std::ranges::size(send);
    check(std::ranges::size(recv) == c * n(), "all_gather: recv has ", std::ranges::size(recv),
          " elements but must hold size()*send.size() = ", n(), "*", c);
    return make(Collective::all_gather, send, recv, c);
  }
  template <class B>
  Op broadcast_op(B& buf, int root) {
    check_root("broadcast", root);
    return make(Collective::broadcast, buf, buf, std::ranges::size(buf), Reduce::sum, root);
  }
  template <class S, class R>
  Op reduce_op(const S& send, R& recv, Reduce red, int root) {
    same_type<S, R>();
    check_root("reduce", root);
    if (self().rank() == root)
      check(std::ranges::size(recv) == std::ranges::size(send), "reduce: root's recv has ", std::ranges::size(recv),
            " elements but send has ", std::ranges::size(send));
    return make(Collective::reduce, send, recv, std::ranges::size(send), red, root);
  }
  template <class S, class R>
  Op all_to_all_op(const S& send, R& recv) {
    same_type<S, R>();
    const auto total = std::ranges::size(send);
    check(total % n() == 0, "all_to_all: send has ", total, " elements, not a multiple of the group size ", n());
    check(std::ranges::size(recv) == total, "all_to_all: recv has ", std::ranges::size(recv),
          " elements but send has ", total);
    check(total == 0 || static_cast<const void*>(std::ranges::data(send)) !=
                            static_cast<const void*>(std::ranges::data(recv)),
          "all_to_all: send and recv must be different buffers");
    return make(Collective::all_to_all, send, recv, total / n());
  }
  template <class C>
  std::vector<std::size_t> counts(const char* what, const C& c) {
    check(std::ranges::size(c) == static_cast<std::size_t>(n()), "all_to_all_v: ", what, " has ",
          std::ranges::size(c), " entries but the group has ", n(), " ranks");
    std::vector<std::size_t> v;
    for (auto x : c) {
      if constexpr (std::is_signed_v<decltype(x)>) check(x >= 0, "all_to_all_v: ", what, " has a negative entry ", x);
      v.push_back(static_cast<std::size_t>(x));
    }
    return v;
  }
  template <class S, class C1, class C2, class R, class C3, class C4>
  Op all_to_all_v_op(const S& send, const C1& sc, const C2& sd, R& recv, const C3& rc, const C4& rd) {
    same_type<S, R>();
    Op op = make(Collective::all_to_all_v, send, recv, 0);
    op.send_counts = counts("send_counts", sc);
    op.send_displs = counts("send_displs", sd);
    op.recv_counts = counts("recv_counts", rc);
    op.recv_displs = counts("recv_displs", rd);
    for (int q = 0; q < n(); ++q) {
      check(op.send_displs[q] + op.send_counts[q] <= std::ranges::size(send), "all_to_all_v: block for rank ", q,
            " ends at ", op.send_displs[q] + op.send_counts[q], " beyond send's ", std::ranges::size(send),
            " elements");
      check(op.recv_displs[q] + op.recv_counts[q] <= std::ranges::size(recv), "all_to_all_v: block from rank ", q,
            " ends at ", op.recv_displs[q] + op.recv_counts[q], " beyond recv's ", std::ranges::size(recv),
            " elements");
    }
    return op;
  }
  Op exchange_op(std::span<const P2P> ops) {
    Op op;
    op.kind = Collective::send_recv;
    for (const auto& p : ops) {
      check(p.peer >= 0 && p.peer < n(), p.kind == P2P::Kind::send ? "send" : "recv", ": peer ", p.peer,
            " is outside the group of size ", n());
      check(p.peer != self().rank(), p.kind == P2P::Kind::send ? "send" : "recv", ": peer ", p.peer,
            " is this rank itself");
    }
    op.p2p.assign(ops.begin(), ops.end());
    return op;
  }

  Traffic traffic_;
  std::optional<void*> order_;  //!< on_stream
};

}  // namespace loom::comm

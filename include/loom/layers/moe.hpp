// A mixture-of-experts MLP, on the host or a device, its experts split over an expert-parallel group: a router picks
// each token's top-k experts (moe_router.hpp), every sequence routed as one group; the kept assignments are sorted by expert,
// which sorts them by the rank that holds the expert, and sent there with an all-to-all of variable counts; each
// rank runs its local experts, a GEMM per expert over the rows it received for it (expert-major; each layer's as one
// grouped product, Ops::matmul_group), and returns the outputs with a second all-to-all; each token's output is the
// sum of its kept experts' outputs times their weights, plus the shared experts' (an MLP every token passes through,
// split over the tensor-parallel group as the dense MLP is). Backward mirrors it: the weighted output gradients go
// out and the input gradients come back by the same two all-to-alls.
//
// The routed experts (RoutedExperts: the router, the dispatch, the local experts and the combine) depend on the element
// type and the device alone, so that loom::cpu_kernels compiles the host's once per type; MoeLayer<T, Dev, Tp> adds
// the shared experts, split over the tensor-parallel group Tp, and hands the routed experts the tensor-parallel
// all-gather they need.
//
// On a device the router's logits come to the host, which routes and plans the dispatch (a few values per token:
// the same code on every device), and sends the plan's indices back; the rows move by index on the device
// (Ops::gather_rows, scatter_rows, combine_rows), the all-to-alls take device memory, and a buffer is exchanged once
// the kernels that wrote it are done.
//
// The experts are whole on every tensor-parallel rank: without sequence parallelism each tp rank routes the same
// rows and computes the same outputs, and its expert-parallel group is the ranks with its tp coordinate.
//
// Each sequence is routed as one group, whichever ranks hold its tokens: with sequence parallelism (a share of the
// rows on each tp rank) and context parallelism (two zigzag chunks of each sequence on each cp rank) the router's
// logits are all-gathered over those groups, every rank routes the whole sequences alike, and each dispatches its
// own tokens' assignments.
#pragma once

#include <loom/comm/any.hpp>
#include <loom/core/function_ref.hpp>
#include <loom/core/memory.hpp>
#include <loom/core/trace.hpp>
#include <loom/layers/mlp.hpp>
#include <loom/layers/moe_router.hpp>
#include <loom/layers/ring_attention.hpp>
#include <loom/layers/param.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace loom::layers {

//! The expert-parallel group a mixture of experts runs over: rank r of n holds experts [r E/n, (r + 1) E/n) of every
//! MoE layer. No communicator: one rank holds every expert.
struct EpGroup {
  comm::AnyComm* comm = nullptr;
  int size() const { return comm ? comm->size() : 1; }
  int rank() const { return comm ? comm->rank() : 0; }
};

//! What MoE forwards routed, summed over layers and micro-batches until taken: the assignments (T·k per sequence)
//! and those dropped over capacity, the largest expert load over the mean summed over layer forwards, the layer
//! forwards, and the two router losses (each the mean over sequences, with its coefficient) summed over them.
//! a2a_seconds: the time this rank spent in the layers' all-to-alls or waiting for them (forward and backward).
struct MoeStats {
  double assignments = 0, dropped = 0, imbalance = 0, forwards = 0, aux_loss = 0, z_loss = 0;
  double a2a_seconds = 0;

  MoeStats& operator+=(const MoeStats& o) {
    assignments += o.assignments, dropped += o.dropped, imbalance += o.imbalance, forwards += o.forwards;
    aux_loss += o.aux_loss, z_loss += o.z_loss, a2a_seconds += o.a2a_seconds;
    return *this;
  }
  //! The dropped fraction, and the mean over layer forwards of the largest load over the mean load.
  double dropped_fraction() const { return assignments > 0 ? dropped / assignments : 0.0; }
  double mean_imbalance() const { return forwards > 0 ? imbalance / forwards : 1.0; }
};

//! The routed experts of a mixture-of-experts layer, on device Dev: the router, the dispatch, this rank's experts and
//! the combine. Its code depends on the element type and the device alone (the tensor-parallel group reaches it
//! through the calls it is given), so that loom::cpu_kernels compiles the host's once per type; MoeLayer adds the
//! shared experts.
template <class T, class Dev = Host>
class RoutedExperts {
 public:
  using Tensor = loom::Tensor<T, Dev>;
  using HostTensor = loom::Tensor<T>;
  static constexpr bool on_host = std::is_same_v<Dev, Host>;

  //! A host array of the dispatch's plan and, on a device, its copy there (upload()).
  template <class U>
  struct Indices {
    std::vector<U> host;
    loom::Tensor<U, Dev> dev;
    const U* data() const {
      if constexpr (on_host) return host.data();
      else return dev.data();
    }
    void upload(const kernels::Ops<Dev>& ops) {
      if constexpr (!on_host) {
        const std::int64_t n = std::max<std::int64_t>(1, static_cast<std::int64_t>(host.size()));
        if (!dev.defined() || dev.data() == nullptr || dev.numel() < n) dev = loom::Tensor<U, Dev>({n});
        ops.from_host(host.data(), dev.data(), host.size());
      } else {
        static_cast<void>(ops);
      }
    }
  };

  //! The router [d, E] and the first of this rank's experts: each c_fc.weight [d, f] (gated: [d, 2f], the gate's
  //! features then the up projection's), c_fc.bias, c_proj.weight [f, d], c_proj.bias [d], one after the other
  //! (without the biases where the experts have none).
  struct Params {
    T* router;
    T* experts;
  };
  //! Where this rank's kept assignments go and where the rows it receives are computed.
  struct Plan {
    std::vector<int> order;                  //!< A rows sent: assignment n·k + j, by expert, then token
    std::vector<std::size_t> send, recv;     //!< rows to and from each expert-parallel rank
    Indices<std::int32_t> grouped;           //!< R rows received (by source rank): its row in expert-major order
    std::vector<int> expert_rows;            //!< local expert le's rows are [expert_rows[le], expert_rows[le + 1])
    Indices<std::int32_t> source;            //!< A: the row of this rank each sent row is (order / k)
    Indices<std::int32_t> slots;             //!< N x k: each row's sent rows in order (-1 after the last)
    Indices<T> weight;                       //!< A: each sent row's combine weight
    std::size_t sent() const { return order.size(); }
    std::size_t received() const { return grouped.host.size(); }
  };
  struct Acts {
    Tensor logits;                //!< N x E (this rank's rows)
    HostTensor whole;             //!< B x T x E, every token of the sequences (gathered with SP or CP; on a device
                                  //!< always: the host routes)
    std::vector<Routing> routes;  //!< one per sequence
    Plan plan;
    Tensor xin, h, g;             //!< the rows this rank's experts computed, expert-major: R x d, R x up, R x f
    Tensor yret;                  //!< A x d: the experts' outputs for this rank's kept assignments, in plan.order
  };
  struct Grads {
    Tensor dlogits;   //!< N x E (this rank's rows)
    HostTensor dwhole;  //!< B x T x E (with SP or CP; on a device always)
    Tensor dyin, dh;  //!< R x d, R x up: the output gradients of the rows computed here, and before the activation
    std::vector<double> dweight;  //!< B x T x k (every token's; zero but this rank's)
  };

  //! The B sequences of T_ tokens on this rank (with context parallelism over cp, its zigzag share of each), of
  //! which it holds `rows` rows from `first_row` (all of them, or with sequence parallelism its share), each
  //! sequence routed as one group. sequence_parallel: the tensor-parallel ranks hold the sequences' rows. Each
  //! expert is an MLP of width f, GELU or (gated) SwiGLU, with or without biases.
  RoutedExperts(int rows, int first_row, int B, int T_, int d, int experts, int f, RouterConfig router, EpGroup ep,
                comm::AnyComm* cp, bool sequence_parallel, bool gated = false, bool bias = true,
                kernels::Ops<Dev> ops = {});

  int local_experts() const { return local_; }
  std::int64_t expert_stride() const {
    return std::int64_t{d_} * up() + std::int64_t{f_} * d_ + (bias_ ? up() + d_ : 0);
  }

  //! The most rows this rank's experts receive and the most it sends in one forward, where a capacity bounds them
  //! (-1 where the routing is dropless): each expert takes at most `capacity` assignments of each sequence, so every
  //! source rank sends this rank's experts at most min(its rows x k, B x local experts x capacity). With a capacity
  //! the routed rows' activations, gradients and all-to-all buffers are made at these sizes (make_acts, make_grads):
  //! what a step holds does not depend on where the router sends the tokens, so a run that fits its first step fits
  //! every step. Dropless, they grow to the most a forward has routed.
  std::int64_t most_received() const {
    const int cap = capacity();
    return cap < 0 ? -1 : std::int64_t{ep_.size()} * std::min(std::int64_t{rows_} * router_.top_k,
                                                                std::int64_t{B_} * local_ * cap);
  }
  std::int64_t most_sent() const {
    const int cap = capacity();
    return cap < 0 ? -1 : std::min(std::int64_t{rows_} * router_.top_k, std::int64_t{B_} * E_ * cap);
  }
  //! Assignments an expert takes from each sequence (-1: dropless), as route() counts them.
  int capacity() const { return expert_capacity(Tg_, router_.top_k, E_, router_.capacity_factor); }

  Acts make_acts() const;
  Grads make_grads() const;

  //! y (rows x d) from x; keeps in a what backward needs. `stats` gains what was routed, when given (not when
  //! recomputing). While the dispatch travels, `meanwhile` sets y to the shared experts' output (or zero), and the
  //! experts' outputs are added to it. With sequence parallelism, gather_rows(in, out, n) all-gathers n elements of
  //! each tensor-parallel rank's rows.
  void forward(const T* x, const Params& w, Acts& a, T* y, MoeStats* stats, FunctionRef<void()> meanwhile,
               FunctionRef<void(const T*, T*, std::size_t)> gather_rows) const;
  //! dx (rows x d) from dy, the gradient of y; leaves in g what backward_weight needs. `scale` scales the router's
  //! losses as the step's loss is scaled (1/m over m micro-batches). While the output gradients travel,
  //! `meanwhile` sets dx to the shared experts' input gradient (or zero), and the routed experts' are added to it.
  //! `stats`, when given, gains the time in the all-to-alls.
  void backward_input(const T* dy, const Params& w, const Acts& a, Grads& g, T* dx, double scale, MoeStats* stats,
                      FunctionRef<void()> meanwhile) const;
  //! The weight gradients (accumulated into dw) from x, the layer's input, and what backward_input left in g.
  void backward_weight(const T* x, const Acts& a, const Grads& g, const Params& dw) const;

  //! Bytes held by one layer's activations and gradient scratch.
  static std::size_t bytes(const Acts& a) {
    return held(a.logits) + held(a.whole) + held(a.xin) + held(a.h) + held(a.g) + held(a.yret);
  }
  static std::size_t bytes(const Grads& g) {
    return held(g.dlogits) + held(g.dwhole) + held(g.dyin) + held(g.dh) + g.dweight.capacity() * sizeof(double);
  }
  //! Bytes of a tensor's storage, none when it holds none.
  template <class U>
  static std::size_t held(const U& t) {
    return t.defined() && t.data() != nullptr ? t.bytes() : 0;
  }

 private:
  //! Adds the time spent in (or waiting for) the all-to-alls to stats->a2a_seconds, when stats is given.
  struct Clock {
    MoeStats* stats;
    template <class F>
    auto time(F&& f) {
      const auto t0 = std::chrono::steady_clock::now();
      auto result = f();
      if (stats) stats->a2a_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return result;
    }
    void wait(comm::Handle& h) {
      time([&] {
        h.wait();
        return 0;
      });
    }
    void wait(comm::Handle&& h) { wait(h); }
  };
  struct Expert {
    T *fc_w, *fc_b, *proj_w, *proj_b;
  };
  Expert expert(T* first, int le) const {
    T* at = first + le * expert_stride();
    T* proj = at + std::int64_t{d_} * up() + (bias_ ? up() : 0);
    return {at, bias_ ? at + std::int64_t{d_} * up() : nullptr, proj, bias_ ? proj + std::int64_t{f_} * d_ : nullptr};
  }
  //! The width of an expert's first projection: f, or gate and up's 2f.
  int up() const { return gated_ ? 2 * f_ : f_; }
  //! f(first row, rows, the expert's parameters or gradients in `first`) for each local expert that received rows,
  //! its rows [first row, first row + rows) of the expert-major buffers.
  template <class F>
  void each_expert(const Plan& p, T* first, F&& f) const {
    for (int le = 0; le < local_; ++le) {
      const int o = p.expert_rows[std::size_t(le)], n = p.expert_rows[std::size_t(le) + 1] - o;
      if (n > 0) f(o, n, expert(first, le));
    }
  }
  //! f(first row, rows, the expert's parameters or gradients in `first`) for each local expert that received rows:
  //! one product each (f returns it), run as one group of products.
  template <class F>
  void each_product(const Plan& p, T* first, bool trans_a, bool trans_b, float beta, F&& f) const {
    std::vector<kernels::Product<T>> products;
    products.reserve(std::size_t(local_));
    each_expert(p, first, [&](int o, int n, const Expert& e) { products.push_back(f(o, n, e)); });
    ops_.matmul_group(products.data(), products.size(), trans_a, trans_b, 1.0f, beta);
  }
  int rows() const { return rows_; }
  //! Whether a sequence's tokens are spread over ranks (sequence or context parallelism).
  bool split() const { return sequence_parallel_ || (cp_ && cp_->size() > 1); }
  //! The router's logits of every token of the B sequences, in order (B x Tg_ x E), in host memory: this rank's
  //! own, or gathered over the tensor-parallel group (sequence parallelism) and the context-parallel group.
  const T* gather_logits(Acts& a, FunctionRef<void(const T*, T*, std::size_t)> gather_rows) const {
    const std::size_t local = std::size_t(B_) * T_ * E_, mine = std::size_t(rows()) * E_;
    if (!split()) {
      if constexpr (on_host) return a.logits.data();
      ops_.to_host(a.logits.data(), a.whole.data(), mine);
      return a.whole.data();
    }
    const int n = cp_ ? cp_->size() : 1;
    std::vector<T> rows_of_cp(local), all(local * std::size_t(n));
    if (sequence_parallel_) {
      if constexpr (on_host) {
        gather_rows(a.logits.data(), rows_of_cp.data(), mine);
      } else {
        Tensor gathered({static_cast<std::int64_t>(local)});
        ops_.synchronize();
        gather_rows(a.logits.data(), gathered.data(), mine);
        ops_.to_host(gathered.data(), rows_of_cp.data(), local);
      }
    } else {
      ops_.to_host(a.logits.data(), rows_of_cp.data(), mine);
    }
    if (n > 1) cp_->all_gather(rows_of_cp, all);
    else all = rows_of_cp;
    for (int q = 0; q < n; ++q)  // cp rank q's token t of sequence b sits at its zigzag position
      for (int b = 0; b < B_; ++b)
        for (int t = 0; t < T_; ++t) {
          const int g = n > 1 ? zigzag_position(t, q, n, T_ / 2) : t;
          std::copy_n(all.data() + (std::size_t(q) * B_ * T_ + std::size_t(b) * T_ + t) * E_, E_,
                      a.whole.data() + (std::size_t(b) * Tg_ + g) * E_);
        }
    return a.whole.data();
  }
  static double imbalance_of(const std::vector<int>& load) {
    double total = 0;
    for (int l : load) total += l;
    const double mean = total / static_cast<double>(load.size());
    return mean == 0 ? 1.0 : *std::max_element(load.begin(), load.end()) / mean;
  }
  //! The combine weight of assignment n·k + j (n: this rank's row).
  double weight_of(const Acts& a, int at) const {
    const int k = router_.top_k, g = token_[std::size_t(at / k)];
    return a.routes[std::size_t(g / Tg_)].weight[std::size_t(g % Tg_) * k + at % k];
  }
  //! t with room for at least `rows` x cols (one row when rows is 0), kept when it has it.
  static void ensure(Tensor& t, std::size_t rows, int cols) {
    const std::int64_t want = std::max<std::int64_t>(1, static_cast<std::int64_t>(rows)) * cols;
    if (!t.defined() || t.data() == nullptr || t.numel() < want) t = Tensor({want});
  }
  //! The rows a forward's buffers are made for: the capacity's bound, or (dropless) what this forward routes.
  std::size_t received_rows(const Plan& p) const {
    const std::int64_t most = most_received();
    return most >= 0 ? std::size_t(most) : p.received();
  }
  std::size_t sent_rows(const Plan& p) const {
    const std::int64_t most = most_sent();
    return most >= 0 ? std::size_t(most) : p.sent();
  }
  //! The plan's indices for the device (Plan::source, slots, weight from its order; grouped), in its memory.
  void index(Acts& a) const {
    Plan& p = a.plan;
    const int k = router_.top_k;
    p.source.host.resize(p.sent()), p.weight.host.resize(p.sent());
    p.slots.host.assign(std::size_t(rows()) * k, -1);
    for (std::size_t s2 = 0; s2 < p.sent(); ++s2) {
      const int at = p.order[s2], n = at / k;
      p.source.host[s2] = n;
      p.weight.host[s2] = static_cast<T>(weight_of(a, at));
      std::int32_t* slot = p.slots.host.data() + std::size_t(n) * k;
      while (*slot >= 0) ++slot;  // a row's sent rows in the order they are sent
      *slot = static_cast<std::int32_t>(s2);
    }
    for (auto* i : {&p.source, &p.grouped, &p.slots}) i->upload(ops_);
    p.weight.upload(ops_);
  }
  //! Memory for rows x cols that lives for one call (counted as communication: it is what the all-to-alls send
  //! and receive).
  static Tensor scratch(std::size_t rows, int cols) {
    MemoryUseScope use(MemoryUse::communication);
    return Tensor({std::max<std::int64_t>(1, static_cast<std::int64_t>(rows)) * cols});
  }

  //! Sorts this rank's kept assignments by expert (then token) and learns, from every rank's counts, the rows it
  //! receives for each of its experts.
  void plan(Acts& a, Clock& clock) const {
    Plan& p = a.plan;
    const int N = rows(), k = router_.top_k, n = ep_.size();
    std::vector<int> count(static_cast<std::size_t>(E_), 0);
    for (int t = 0; t < N; ++t) {
      const int tg = token_[std::size_t(t)];
      const Routing& r = a.routes[std::size_t(tg / Tg_)];
      for (int j = 0; j < k; ++j) {
        const std::size_t at = std::size_t(tg % Tg_) * k + j;
        if (r.kept[at]) ++count[std::size_t(r.expert[at])];
      }
    }
    std::vector<int> next(static_cast<std::size_t>(E_) + 1, 0);
    for (int e = 0; e < E_; ++e) next[std::size_t(e) + 1] = next[std::size_t(e)] + count[std::size_t(e)];
    p.order.assign(std::size_t(next.back()), 0);
    for (int t = 0; t < N; ++t) {
      const int tg = token_[std::size_t(t)];
      const Routing& r = a.routes[std::size_t(tg / Tg_)];
      for (int j = 0; j < k; ++j) {
        const std::size_t at = std::size_t(tg % Tg_) * k + j;
        if (r.kept[at]) p.order[std::size_t(next[std::size_t(r.expert[at])]++)] = t * k + j;
      }
    }
    // Every rank's counts for this rank's experts: recv_count[q * local + le].
    std::vector<int> recv_count(static_cast<std::size_t>(E_));
    if (ep_.comm) clock.time([&] {
        ep_.comm->all_to_all(count, recv_count);
        return 0;
      });
    else recv_count = count;
    p.send.assign(std::size_t(n), 0), p.recv.assign(std::size_t(n), 0);
    for (int e = 0; e < E_; ++e) {
      p.send[std::size_t(e / local_)] += std::size_t(count[std::size_t(e)]);
      p.recv[std::size_t(e / local_)] += std::size_t(recv_count[std::size_t(e)]);
    }
    p.expert_rows.assign(std::size_t(local_) + 1, 0);
    for (int le = 0; le < local_; ++le) {
      int rows_le = 0;
      for (int q = 0; q < n; ++q) rows_le += recv_count[std::size_t(q * local_ + le)];
      p.expert_rows[std::size_t(le) + 1] = p.expert_rows[std::size_t(le)] + rows_le;
    }
    // Rows arrive by source rank, each source's by local expert: their places in expert-major order.
    p.grouped.host.clear();
    std::vector<int> filled(static_cast<std::size_t>(local_), 0);
    for (int q = 0; q < n; ++q)
      for (int le = 0; le < local_; ++le)
        for (int i = 0; i < recv_count[std::size_t(q * local_ + le)]; ++i)
          p.grouped.host.push_back(p.expert_rows[std::size_t(le)] + filled[std::size_t(le)]++);
  }

  //! Rows of d_ to each expert-parallel rank (send_rows[q] of them, by rank) and from each (recv_rows): the
  //! all-to-all of variable counts, or a copy on one rank; started (async) or done, and its handle.
  comm::Handle exchange(const T* send, const std::vector<std::size_t>& send_rows, T* recv,
                        const std::vector<std::size_t>& recv_rows, Clock& clock, bool async = false) const {
    const std::size_t n = send_rows.size();
    std::size_t total_send = 0, total_recv = 0;
    std::vector<std::size_t> sc(n), sd(n), rc(n), rd(n);
    for (std::size_t q = 0; q < n; ++q) {
      sc[q] = send_rows[q] * d_, sd[q] = total_send, total_send += sc[q];
      rc[q] = recv_rows[q] * d_, rd[q] = total_recv, total_recv += rc[q];
    }
    if (!ep_.comm) {
      ops_.copy(send, recv, total_send);
      return {};
    }
    return clock.time([&] {
      comm::Handle h = ep_.comm->all_to_all_v_async(std::span<const T>(send, total_send), sc, sd,
                                                    std::span<T>(recv, total_recv), rc, rd);
      if (!async) h.wait();
      return h;
    });
  }

  kernels::Ops<Dev> ops_{};
  int rows_;
  bool sequence_parallel_;
  int B_, T_, d_, E_, f_;
  bool gated_, bias_;
  int Tg_ = 0;              //!< tokens of a whole sequence (T_ x cp)
  std::vector<int> token_;  //!< per row of this rank: its sequence b and place g in it, as b Tg_ + g
  RouterConfig router_;
  EpGroup ep_;
  comm::AnyComm* cp_;
  int local_ = 0;
};

// RoutedExperts' members that a program built with LOOM_EXTERN_KERNELS takes from loom::cpu_kernels.

template <class T, class Dev>
RoutedExperts<T, Dev>::RoutedExperts(int rows, int first_row, int B, int T_, int d, int experts, int f,
                                     RouterConfig router, EpGroup ep, comm::AnyComm* cp, bool sequence_parallel,
                                     bool gated, bool bias, kernels::Ops<Dev> ops)
    : ops_(ops), rows_(rows), sequence_parallel_(sequence_parallel), B_(B), T_(T_), d_(d),
      E_(experts), f_(f), gated_(gated), bias_(bias), router_(router), ep_(ep), cp_(cp) {
  router_.experts = experts;
  LOOM_CHECK(experts % ep.size() == 0, "the ", experts, " experts do not split over ", ep.size(),
             " expert-parallel ranks");
  local_ = experts / ep.size();
  const int n = cp ? cp->size() : 1, q = cp ? cp->rank() : 0;
  Tg_ = T_ * n;
  token_.resize(static_cast<std::size_t>(rows));
  for (int i = 0; i < rows; ++i) {  // row i: token t of sequence b on this cp rank, at g in the sequence
    const int row = first_row + i, b = row / T_, t = row % T_;
    token_[std::size_t(i)] = b * Tg_ + (n > 1 ? zigzag_position(t, q, n, T_ / 2) : t);
  }
}

template <class T, class Dev>
typename RoutedExperts<T, Dev>::Acts RoutedExperts<T, Dev>::make_acts() const {
  Acts a;
  a.logits = Tensor({rows(), std::int64_t{E_}});
  if (split() || !on_host) a.whole = HostTensor({std::int64_t{B_} * Tg_, std::int64_t{E_}});
  if (const std::int64_t r = most_received(); r >= 0) {
    ensure(a.xin, std::size_t(r), d_), ensure(a.h, std::size_t(r), up()), ensure(a.g, std::size_t(r), f_);
    ensure(a.yret, std::size_t(most_sent()), d_);
  }
  return a;
}

template <class T, class Dev>
typename RoutedExperts<T, Dev>::Grads RoutedExperts<T, Dev>::make_grads() const {
  Grads g;
  g.dlogits = Tensor({rows(), std::int64_t{E_}});
  if (split() || !on_host) g.dwhole = HostTensor({std::int64_t{B_} * Tg_, std::int64_t{E_}});
  if (const std::int64_t r = most_received(); r >= 0)
    ensure(g.dyin, std::size_t(r), d_), ensure(g.dh, std::size_t(r), up());
  return g;
}

template <class T, class Dev>
void RoutedExperts<T, Dev>::forward(const T* x, const Params& w, Acts& a, T* y, MoeStats* stats,
                                    FunctionRef<void()> meanwhile,
                                    FunctionRef<void(const T*, T*, std::size_t)> gather_rows) const {
  trace::Scope span("forward moe", "compute");
  const auto& ops = ops_;
  const int N = rows(), k = router_.top_k;
  ops.matmul(x, w.router, a.logits.data(), N, E_, d_, false, false);
  const T* whole = gather_logits(a, gather_rows);
  a.routes.resize(static_cast<std::size_t>(B_));
  MoeStats s;
  for (int b = 0; b < B_; ++b) {
    Routing& r = a.routes[std::size_t(b)];
    r = route(whole + std::size_t(b) * Tg_ * E_, Tg_, router_);
    s.assignments += static_cast<double>(Tg_) * k;
    s.dropped += r.dropped() * Tg_ * k;
    s.aux_loss += r.aux_loss / B_, s.z_loss += r.z_loss / B_;
  }
  std::vector<int> load(static_cast<std::size_t>(E_), 0);
  for (const auto& r : a.routes)
    for (int e = 0; e < E_; ++e) load[std::size_t(e)] += r.load[std::size_t(e)];
  s.imbalance = imbalance_of(load), s.forwards = 1;
  Clock clock(stats);
  plan(a, clock);
  index(a);
  if (stats) *stats += s;
  const Plan& p = a.plan;
  // Dispatch: this rank's rows for each kept assignment, by expert, to the rank holding it; expert-major there.
  {
    MemoryUseScope use(MemoryUse::activations);
    ensure(a.xin, p.received(), d_), ensure(a.h, p.received(), up()), ensure(a.g, p.received(), f_);
    ensure(a.yret, p.sent(), d_);
  }
  Tensor out = scratch(received_rows(p), d_);
  {
    Tensor send = scratch(sent_rows(p), d_);
    ops.gather_rows(x, p.source.data(), static_cast<const T*>(nullptr), send.data(), p.sent(), d_);
    ops.synchronize();  // on a device: the rows are gathered before they are sent
    comm::Handle h = exchange(send.data(), p.send, out.data(), p.recv, clock, true);
    // The shared experts, while the rows travel.
    meanwhile();
    clock.wait(h);
    ops.scatter_rows(out.data(), p.grouped.data(), a.xin.data(), p.received(), d_);
  }
  // The local experts: each layer's products of every expert over its rows as one group, the activation over all
  // the rows at once; their outputs, back by source rank.
  Tensor y_grouped = scratch(received_rows(p), d_);
  const int R = static_cast<int>(p.received());
  each_product(p, w.experts, false, false, 0.0f, [&](int o, int n, const Expert& e) {
    return kernels::Product<T>{a.xin.data() + std::size_t(o) * d_, e.fc_w, a.h.data() + std::size_t(o) * up(), n,
                               up(), d_};
  });
  each_expert(p, w.experts, [&](int o, int n, const Expert& e) {
    T* h = a.h.data() + std::size_t(o) * up();
    if (e.fc_b) ops.bias_add(h, e.fc_b, h, n, up());
  });
  if (R > 0) {
    if (gated_) ops.swiglu_forward(a.h.data(), a.g.data(), R, f_);
    else ops.gelu_forward(a.h.data(), a.g.data(), std::size_t(R) * f_);
  }
  each_product(p, w.experts, false, false, 0.0f, [&](int o, int n, const Expert& e) {
    return kernels::Product<T>{a.g.data() + std::size_t(o) * f_, e.proj_w, y_grouped.data() + std::size_t(o) * d_, n,
                               d_, f_};
  });
  each_expert(p, w.experts, [&](int o, int n, const Expert& e) {
    T* yo = y_grouped.data() + std::size_t(o) * d_;
    if (e.proj_b) ops.bias_add(yo, e.proj_b, yo, n, d_);
  });
  ops.gather_rows(static_cast<const T*>(y_grouped.data()), p.grouped.data(), static_cast<const T*>(nullptr), out.data(),
                  p.received(), d_);
  ops.synchronize();
  clock.wait(exchange(out.data(), p.recv, a.yret.data(), p.send, clock));
  // Combine: the shared experts' output, plus each kept expert's output times its weight.
  ops.combine_rows(static_cast<const T*>(a.yret.data()), p.slots.data(), k, p.weight.data(), y, std::size_t(N), d_);
}

template <class T, class Dev>
void RoutedExperts<T, Dev>::backward_input(const T* dy, const Params& w, const Acts& a, Grads& g, T* dx, double scale,
                                           MoeStats* stats, FunctionRef<void()> meanwhile) const {
  trace::Scope span("backward_input moe", "compute");
  const auto& ops = ops_;
  const int N = rows(), k = router_.top_k;
  const Plan& p = a.plan;
  Clock clock(stats);
  // The combine: d(weight) = dy · the expert's output; the expert's output gradient = weight · dy.
  g.dweight.assign(std::size_t(B_) * Tg_ * k, 0.0);
  Tensor dout = scratch(received_rows(p), d_);
  {
    Tensor send = scratch(sent_rows(p), d_);
    std::vector<double> dots(p.sent());
    if constexpr (on_host) {
      ops.row_dots(dy, p.source.data(), static_cast<const T*>(a.yret.data()), dots.data(), p.sent(), d_);
    } else {
      loom::Tensor<double, Dev> on_device({std::max<std::int64_t>(1, static_cast<std::int64_t>(p.sent()))});
      ops.row_dots(dy, p.source.data(), static_cast<const T*>(a.yret.data()), on_device.data(), p.sent(), d_);
      ops.to_host(on_device.data(), dots.data(), p.sent());
    }
    for (std::size_t s = 0; s < p.sent(); ++s) {
      const int at = p.order[s];
      g.dweight[std::size_t(token_[std::size_t(at / k)]) * k + at % k] = dots[s];
    }
    ops.gather_rows(dy, p.source.data(), p.weight.data(), send.data(), p.sent(), d_);
    ops.synchronize();
    comm::Handle h = exchange(send.data(), p.send, dout.data(), p.recv, clock, true);
    meanwhile();
    clock.wait(h);
  }
  {
    MemoryUseScope use(MemoryUse::activations);
    ensure(g.dyin, p.received(), d_), ensure(g.dh, p.received(), up());
  }
  ops.scatter_rows(static_cast<const T*>(dout.data()), p.grouped.data(), g.dyin.data(), p.received(), d_);
  // The experts' input gradients, expert-major, then back by source rank.
  Tensor dx_grouped = scratch(received_rows(p), d_);
  Tensor dact = gated_ ? scratch(received_rows(p), f_) : Tensor();  // gated: the gradient of silu(gate) up
  T* dmid = gated_ ? dact.data() : g.dh.data();  // the second layer's input gradient, R x f
  each_product(p, w.experts, false, true, 0.0f, [&](int o, int n, const Expert& e) {
    return kernels::Product<T>{g.dyin.data() + std::size_t(o) * d_, e.proj_w, dmid + std::size_t(o) * f_, n, f_, d_};
  });
  if (const int R = static_cast<int>(p.received()); R > 0) {
    if (gated_) ops.swiglu_backward(static_cast<const T*>(a.h.data()), static_cast<const T*>(dmid), g.dh.data(), R, f_);
    else ops.gelu_backward(static_cast<const T*>(a.h.data()), static_cast<const T*>(dmid), dmid, std::size_t(R) * f_);
  }
  each_product(p, w.experts, false, true, 0.0f, [&](int o, int n, const Expert& e) {
    return kernels::Product<T>{g.dh.data() + std::size_t(o) * up(), e.fc_w, dx_grouped.data() + std::size_t(o) * d_, n,
                               d_, up()};
  });
  ops.gather_rows(static_cast<const T*>(dx_grouped.data()), p.grouped.data(), static_cast<const T*>(nullptr),
                  dout.data(), p.received(), d_);
  Tensor dret = scratch(sent_rows(p), d_);
  ops.synchronize();
  clock.wait(exchange(dout.data(), p.recv, dret.data(), p.send, clock));
  ops.combine_rows(static_cast<const T*>(dret.data()), p.slots.data(), k, static_cast<const T*>(nullptr), dx,
                   std::size_t(N), d_);
  // The router: its logits' gradient from the weights' and its two losses (each the mean over the sequences),
  // for every token of the sequences, of which this rank keeps its own rows. Under context parallelism the cp
  // ranks' gradients are averaged, so each scales its share of the losses' gradient by cp.
  // (On a device the logits and their gradient are the host's copies, a.whole and g.dwhole.)
  const bool apart = split() || !on_host;
  const T* whole = apart ? a.whole.data() : a.logits.data();
  T* dwhole = apart ? g.dwhole.data() : g.dlogits.data();
  const double losses = scale / B_ * (cp_ ? cp_->size() : 1);
  for (int b = 0; b < B_; ++b)
    route_backward(whole + std::size_t(b) * Tg_ * E_, a.routes[std::size_t(b)], router_,
                   g.dweight.data() + std::size_t(b) * Tg_ * k, losses, dwhole + std::size_t(b) * Tg_ * E_);
  if constexpr (on_host) {
    if (split())
      for (int i = 0; i < N; ++i)
        ops.copy(dwhole + std::size_t(token_[std::size_t(i)]) * E_, g.dlogits.data() + std::size_t(i) * E_,
                 std::size_t(E_));
  } else {  // this rank's rows of the gradient, to the device
    std::vector<T> mine(std::size_t(N) * E_);
    for (int i = 0; i < N; ++i)
      std::copy_n(dwhole + std::size_t(token_[std::size_t(i)]) * E_, E_, mine.data() + std::size_t(i) * E_);
    ops.from_host(mine.data(), g.dlogits.data(), mine.size());
  }
  ops.matmul(g.dlogits.data(), w.router, dx, N, d_, E_, false, true, 1.0f, 1.0f);
}

template <class T, class Dev>
void RoutedExperts<T, Dev>::backward_weight(const T* x, const Acts& a, const Grads& g, const Params& dw) const {
  trace::Scope span("backward_weight moe", "compute");
  const auto& ops = ops_;
  const int N = rows();
  const Plan& p = a.plan;
  each_product(p, dw.experts, true, false, 1.0f, [&](int o, int n, const Expert& e) {
    return kernels::Product<T>{a.g.data() + std::size_t(o) * f_, g.dyin.data() + std::size_t(o) * d_, e.proj_w, f_, d_,
                               n};
  });
  each_product(p, dw.experts, true, false, 1.0f, [&](int o, int n, const Expert& e) {
    return kernels::Product<T>{a.xin.data() + std::size_t(o) * d_, g.dh.data() + std::size_t(o) * up(), e.fc_w, d_,
                               up(), n};
  });
  each_expert(p, dw.experts, [&](int o, int n, const Expert& e) {
    if (e.proj_b) ops.bias_backward(static_cast<const T*>(g.dyin.data() + std::size_t(o) * d_), e.proj_b, n, d_);
    if (e.fc_b) ops.bias_backward(static_cast<const T*>(g.dh.data() + std::size_t(o) * up()), e.fc_b, n, up());
  });
  ops.matmul(x, g.dlogits.data(), dw.router, d_, E_, N, true, false, 1.0f, 1.0f);
}

//! A mixture-of-experts MLP: the routed experts (RoutedExperts, compiled once per element type) and, when there are
//! any, shared experts that every token passes through, split over the tensor-parallel group Tp as the dense MLP is;
//! they compute while the routed experts' rows travel.
template <class T, class Dev = Host, class Tp = TensorParallel<1>>
class MoeLayer {
 public:
  using Tensor = loom::Tensor<T, Dev>;
  using Routed = RoutedExperts<T, Dev>;
  using Mlp = ParallelMlp<T, Dev, Tp>;
  using Plan = typename Routed::Plan;

  //! The router [d, E], the shared experts (when there are any), and the first of this rank's experts.
  struct Params {
    T* router;
    typename Mlp::Params shared;
    T* experts;
  };
  struct Acts : Routed::Acts {
    typename Mlp::Acts shared;
  };
  struct Grads : Routed::Grads {
    typename Mlp::Grads shared;
  };

  //! The router, the shared experts and the experts of one MoE layer under prefix (Mixtral-like names:
  //! router.weight, shared_expert.c_fc ..., experts.<e>.c_fc ...), each expert's MLP gated (SwiGLU) or not, with
  //! biases or without. Only the experts expert-parallel rank ep_rank of ep holds are kept; every one is numbered,
  //! so each starts as in the single-rank model.
  static void declare(ParamTable& t, const std::string& prefix, int d, int experts, int f, int shared, int ep,
                      int ep_rank, double std_w, double std_proj, bool gated = false, bool bias = true) {
    t.add<Replicate>(prefix + "router.weight", {d, experts}, true, std_w);
    if (shared > 0) Mlp::declare(t, prefix + "shared_expert.", d, shared * f, std_w, std_proj, gated, bias);
    const bool skipping = t.skipping();
    const int per = experts / ep;
    t.expert(true);
    for (int e = 0; e < experts; ++e) {
      t.skip(skipping || e / per != ep_rank);
      const std::string x = prefix + "experts." + std::to_string(e) + ".";
      const int up = gated ? 2 * f : f;
      t.add<Replicate>(x + "c_fc.weight", {d, up}, true, std_w);
      if (bias) t.add<Replicate>(x + "c_fc.bias", {up}, false, 0);
      t.add<Replicate>(x + "c_proj.weight", {f, d}, true, std_proj);
      if (bias) t.add<Replicate>(x + "c_proj.bias", {d}, false, 0);
    }
    t.expert(false);
    t.skip(skipping);
  }
  //! The parameters of one MoE layer: the router, the shared experts (when there are any), each expert held (an
  //! MLP: 4 parameters with biases, 2 without).
  static std::size_t param_count(int held_experts, int shared, bool bias = true) {
    return 1 + (shared > 0 ? Mlp::param_count(bias) : 0) + Mlp::param_count(bias) * static_cast<std::size_t>(held_experts);
  }
  //! Params from the layer's first parameter specs[p] in the flat buffer `flat`.
  static Params in(T* flat, const std::vector<ParamSpec>& specs, std::size_t p, int shared, bool bias = true) {
    const std::size_t e = 1 + (shared > 0 ? Mlp::param_count(bias) : 0);
    return {flat + specs[p].offset, shared > 0 ? Mlp::in(flat, specs, p + 1, bias) : typename Mlp::Params{},
            p + e < specs.size() ? flat + specs[p + e].offset : nullptr};
  }

  //! B sequences of T_ tokens on this rank (with context parallelism over cp, its zigzag share of each; with
  //! sequence parallelism, the region's rows of them), each sequence routed as one group.
  MoeLayer(Region<T, Dev, Tp> r, int B, int T_, int d, int experts, int f, int shared, RouterConfig router,
           EpGroup ep, comm::AnyComm* cp = nullptr, bool gated = false, bool bias = true)
      : region_(r),
        routed_(r.rows(), r.first_row(), B, T_, d, experts, f, router, ep, cp, Tp::sequence_parallel, gated, bias,
                r.ops),
        shared_(r, std::max(shared, 1) * f, gated), has_shared_(shared > 0) {}

  int local_experts() const { return routed_.local_experts(); }
  std::int64_t expert_stride() const { return routed_.expert_stride(); }

  Acts make_acts() const {
    Acts a;
    static_cast<typename Routed::Acts&>(a) = routed_.make_acts();
    if (has_shared_) a.shared = shared_.make_acts();
    return a;
  }
  Grads make_grads() const {
    Grads g;
    static_cast<typename Routed::Grads&>(g) = routed_.make_grads();
    if (has_shared_) g.shared = shared_.make_grads();
    return g;
  }

  //! y (N x d) from x (N x d); keeps in a what backward needs. `stats` gains what was routed, when given (not when
  //! recomputing). The shared experts compute while the dispatch travels.
  void forward(const T* x, const Params& w, Acts& a, T* partial, T* y, MoeStats* stats) const {
    routed_.forward(
        x, {w.router, w.experts}, a, y, stats,
        [&] {
          if (has_shared_) shared_.forward(x, w.shared, a.shared, partial, y);
          else region_.ops.fill(y, std::size_t(region_.rows()) * region_.C, T(0));
        },
        [&](const T* in, T* out, std::size_t n) { region_.all_gather(in, out, n); });
  }
  //! dx (N x d) from dy, the gradient of y; leaves in g what backward_weight needs. `scale` scales the router's
  //! losses as the step's loss is scaled (1/m over m micro-batches). The shared experts' backward runs while the
  //! output gradients travel; `stats`, when given, gains the time in the all-to-alls.
  void backward_input(const T* dy, const Params& w, const Acts& a, Grads& g, T* dx, double scale,
                      MoeStats* stats = nullptr) const {
    routed_.backward_input(dy, {w.router, w.experts}, a, g, dx, scale, stats, [&] {
      if (has_shared_) shared_.backward_input(dy, w.shared, a.shared, g.shared, dx);
      else region_.ops.fill(dx, std::size_t(region_.rows()) * region_.C, T(0));
    });
  }
  //! The weight gradients (accumulated into dw) from x, the layer's input, and what backward_input left in g.
  void backward_weight(const T* x, const T* dy, const Acts& a, const Grads& g, const Params& dw) const {
    if (has_shared_) shared_.backward_weight(x, dy, a.shared, g.shared, dw.shared);
    routed_.backward_weight(x, a, g, {dw.router, dw.experts});
  }

  //! Bytes held by one layer's activations and gradient scratch.
  static std::size_t bytes(const Acts& a) {
    return Routed::bytes(a) + Routed::held(a.shared.in_full) + Routed::held(a.shared.h) + Routed::held(a.shared.g);
  }
  static std::size_t bytes(const Grads& g) {
    return Routed::bytes(g) + Routed::held(g.shared.dy_full) + Routed::held(g.shared.dg) +
           Routed::held(g.shared.dx_full) + Routed::held(g.shared.dh);
  }

 private:
  Region<T, Dev, Tp> region_;
  Routed routed_;
  Mlp shared_;
  bool has_shared_;
};

}  // namespace loom::layers

// With LOOM_EXTERN_KERNELS the routed experts are instantiated once, in loom::cpu_kernels (src/moe.cpp).
#ifdef LOOM_EXTERN_KERNELS
namespace loom::layers {
extern template class RoutedExperts<float>;
extern template class RoutedExperts<double>;
extern template class RoutedExperts<::loom::bf16>;
extern template class RoutedExperts<::loom::fp16>;
}  // namespace loom::layers
#endif

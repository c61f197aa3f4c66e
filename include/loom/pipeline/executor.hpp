// The pipeline executor: runs one stage's list of a schedule table (schedule.hpp) on that stage's model chunks,
// moving activations and gradients over the pipeline communicator as the table says: each maximal run of send/recv
// actions is one batched exchange, as the verifier assumed, so a table that passed verify() cannot hang here.
// The list runs as one exec::Graph on the rank's workers: exchanges overlap computation (each is posted on P2p and
// runs on the communicator while the stage computes on), and a computation waits only for the exchanges whose data
// it reads. Waiting later than the verifier's blocking model never delays a peer, so what completes there
// completes here.
//
// On a device the received activations and gradients are device memory. A computation whose result an exchange or a
// gradient reduction reads next records an event after its kernels, which that exchange or reduction waits for on
// its own thread before it starts (the collectives read what is ready), while Compute queues the next kernels.
#pragma once

#include <loom/comm/types.hpp>
#include <loom/core/error.hpp>
#include <loom/core/trace.hpp>
#include <loom/exec/graph.hpp>
#include <loom/pipeline/schedule.hpp>
#include <loom/tensor/tensor.hpp>

#include <algorithm>
#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace loom::pipeline {

namespace detail {
//! Whether a part's ops() mark the kernels it has issued (ops().mark()), and the mark's type; a part without ops (a
//! host model of tests) has nothing to wait for.
template <class Model>
concept has_marks = requires(Model& m) { m.ops().mark().wait(); };
struct NoMark {
  void wait() const {}
};
template <class Model>
struct MarkOf {
  using type = NoMark;
};
template <class Model>
  requires has_marks<Model>
struct MarkOf<Model> {
  using type = decltype(std::declval<Model&>().ops().mark());
};
}  // namespace detail

//! Runs tables on one pipeline stage. Model is a part of a model with forward(slot, micro_batch, input),
//! backward(slot, scale, doutput) (BW), backward_inputs(slot, scale, doutput) (B), backward_weights(slot) (W),
//! output(slot), input_grad(slot), slots() and set_slots(n) (a part of any train::TrainableModel); chunks[c] is
//! the part this stage holds as its chunk c. Comm is the pipeline group's communicator: its rank is the stage.
template <class Model, class Comm>
class Executor {
 public:
  //! run()'s grads_ready when none is given.
  struct NoCallback {
    void operator()(int) const {}
  };
  using T = typename std::remove_cvref_t<decltype(std::declval<Model&>().grads())>::value_type;
  using Dev = typename std::remove_cvref_t<decltype(std::declval<Model&>().grads())>::device;
  using MicroBatch = typename Model::MicroBatch;
  //! What an activation or gradient is received into, or sent from: host memory, or the device's.
  using Buffer = std::conditional_t<std::is_same_v<Dev, Host>, std::vector<T>, Tensor<T, Dev>>;

  Executor(std::vector<Model*> chunks, Comm& pp, Schedule schedule)
      : chunks_(std::move(chunks)), pp_(pp), schedule_(schedule) {
    LOOM_CHECK(static_cast<int>(chunks_.size()) == chunks_per_stage(schedule, static_cast<int>(chunks_.size())),
               "the ", describe_schedule(schedule), " schedule holds ",
               chunks_per_stage(schedule, static_cast<int>(chunks_.size())), " chunks per stage, got ",
               chunks_.size());
  }

  //! Checks `table` against this pipeline and verifies it, once: run() then takes it with no further check. The
  //! table's verified peak of (micro-batch, chunk) pairs held on this stage sizes each chunk's activation slots.
  template <ScheduleTable Table>
  void prepare(const Table& table) {
    const int stage = pp_.rank(), P = pp_.size(), m = table.micro_batches;
    LOOM_CHECK(table.stage_count() == P, "a table for ", table.stage_count(), " stages on a pipeline of ", P);
    LOOM_CHECK(table.schedule == schedule_, "a ", describe_schedule(table.schedule), " table on an executor built for ",
               describe_schedule(schedule_));
    const VerifyResult check = verify(table);
    LOOM_CHECK(check.ok, "the ", describe_schedule(table.schedule), " table fails verification: ",
               describe(check.problem));
    capacity_ = std::max(1, std::min(m, check.peak_held[static_cast<std::size_t>(stage)]));
    for (auto* c : chunks_)
      if (c->slots() != capacity_) c->set_slots(capacity_);
    prepared_ = &table;
    prepared_m_ = m;
  }

  //! Runs this stage's list of `table`, micro-batch i being micro_batch(i) (each the same B x T), and accumulates
  //! the gradient of the mean loss over the micro-batches. Returns that mean loss on the stage that computes the
  //! loss, 0 elsewhere. grads_ready(c), when given, is called as soon as chunk c's weight gradients are complete
  //! (after its last micro-batch's W or BW), on the Comm resource, so that their reduction starts while the stage
  //! computes on; what it returns (a Completion, such as the Handle of an all-reduce it started) is waited for
  //! before run() returns. A table not given to prepare() is prepared first.
  //!
  //! The list becomes one exec::Graph: its computations on Compute in the table's order; each maximal run of
  //! send/recv actions one batched exchange on P2p, posted once the computation before it has run (it sends what
  //! that produced) and left running on the communicator; a computation that reads what an exchange receives
  //! depends on the exchanges posted since the last such computation. Exchanges are posted in the table's order,
  //! as the verifier assumed, so a table that passed verify() cannot hang here.
  template <ScheduleTable Table, class Provider, class Ready = NoCallback>
  double run(const Table& table, Provider&& micro_batch, Ready&& grads_ready = {}) {
    if (prepared_ != static_cast<const void*>(&table) || prepared_m_ != table.micro_batches) prepare(table);
    const int stage = pp_.rank(), P = pp_.size(), m = table.micro_batches;
    const int V = static_cast<int>(chunks_.size()), last = P * V - 1;
    std::vector<MicroBatch> mbs;
    for (int i = 0; i < m; ++i) mbs.push_back(micro_batch(i));
    const std::size_t n = chunks_.front()->io_elements(mbs[0].batch, mbs[0].seq);
    bool fresh = false;
    for (auto* b : {&act_in_, &grad_in_, &grad_out_}) {
      b->resize(std::size_t(V) * m);
      for (auto& v : *b) fresh = resize(v, n) || fresh;
    }
    // On a device, a new buffer may be a block freed with kernels still queued that use it: they finish before an
    // exchange (on the communicator's stream) writes it.
    if (fresh) computed_on_device(chunks_.front());
    auto buf = [&](std::vector<Buffer>& b, int micro, int chunk) -> Buffer& {
      return b[std::size_t(chunk) * m + micro];
    };
    auto vstage = [&](int chunk) { return virtual_stage(schedule_, P, stage, chunk); };
    //! The chunk of this stage that holds virtual stage k, or -1.
    auto local = [&](int k) {
      const auto sc = stage_chunk(schedule_, P, k);
      return sc.stage == stage ? sc.chunk : -1;
    };
    // Activation slots, assigned in the table's order as the run will use them: F takes one of its chunk's, the
    // BW or W that ends the micro-batch gives it back.
    std::vector<std::vector<int>> free(static_cast<std::size_t>(V));
    for (auto& f : free)
      for (int i = capacity_; i-- > 0;) f.push_back(i);
    std::vector<int> slot(std::size_t(V) * m, -1);
    auto slot_of = [&](int micro, int chunk) -> int& { return slot[std::size_t(chunk) * m + micro]; };
    int in_use = 0;
    peak_ = 0;

    exec::Graph g;
    double loss = 0;  // written by Compute's tasks only
    // The event after a computation's kernels, for the exchange or reduction that reads its result next.
    MarkSlot done;  // the last computation's, where it records one
    std::vector<exec::Graph::Id> posted;  // exchanges no computation has waited for yet
    std::optional<exec::Graph::Id> computed;  // the last computation
    std::vector<int> weights_done(std::size_t(V), 0);  // per chunk: micro-batches whose weight gradients are in
    const auto actions = table.stage(stage);
    //! Whether the action after i is an exchange, which may send what action i computes.
    auto exchange_next = [&](std::size_t i) { return i + 1 < actions.size() && !is_compute(actions[i + 1].kind); };
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      if (!is_compute(a.kind)) {
        const std::size_t first = i;
        while (i + 1 < actions.size() && !is_compute(actions[i + 1].kind)) ++i;
        // What each action sends or receives into, fixed now; the activation it sends is read when it runs.
        std::vector<Transfer> run;
        for (std::size_t j = first; j <= i; ++j) {
          const Action& x = actions[j];
          Model* part = chunks_[static_cast<std::size_t>(x.chunk)];
          switch (x.kind) {
            case Kind::send_act: run.push_back({x.kind, x.peer, part, slot_of(x.micro, x.chunk), nullptr}); break;
            case Kind::recv_act: run.push_back({x.kind, x.peer, part, -1, &buf(act_in_, x.micro, x.chunk)}); break;
            case Kind::send_grad: run.push_back({x.kind, x.peer, part, -1, &buf(grad_out_, x.micro, x.chunk)}); break;
            case Kind::recv_grad: run.push_back({x.kind, x.peer, part, -1, &buf(grad_in_, x.micro, x.chunk)}); break;
            default: break;
          }
        }
        std::vector<exec::Graph::Id> after;
        if (computed) after.push_back(*computed);
        posted.push_back(g.add<exec::P2p>(
            "exchange",
            [this, run = std::move(run), n, done] {
              computed_on_device(done);
              return exchange(run, n);
            },
            std::move(after)));
        continue;
      }
      Model* part = chunks_[static_cast<std::size_t>(a.chunk)];
      const int k = vstage(a.chunk), micro = a.micro;
      std::vector<exec::Graph::Id> after;
      const bool reads_exchange = a.kind == Kind::F ? k > 0 && local(k - 1) < 0
                                  : a.kind == Kind::W ? false
                                                      : k < last && local(k + 1) < 0;
      if (reads_exchange) after.swap(posted);
      if (a.kind == Kind::F) {
        auto& f = free[static_cast<std::size_t>(a.chunk)];
        LOOM_CHECK(!f.empty(), "stage ", stage, " has no free activation slot for micro-batch ", micro);
        const int s = slot_of(micro, a.chunk) = f.back();
        f.pop_back();
        peak_ = std::max(peak_, ++in_use);
        const T* received = k > 0 && local(k - 1) < 0 ? buf(act_in_, micro, a.chunk).data() : nullptr;
        Model* prev = k > 0 && local(k - 1) >= 0 ? chunks_[static_cast<std::size_t>(local(k - 1))] : nullptr;
        const int prev_slot = prev ? slot_of(micro, local(k - 1)) : -1;
        const MicroBatch mb = mbs[static_cast<std::size_t>(micro)];
        const bool counts = k == last;
        done = mark_slot(exchange_next(i));
        computed = g.add<exec::Compute>("F", [=, &loss] {
          const double l = part->forward(s, mb, prev ? prev->output(prev_slot) : received);
          if (counts) loss += l / m;
          if (done) done->emplace(mark_of(part));  // the output, for the exchange that sends it
        }, std::move(after));
      } else {
        const int s = slot_of(micro, a.chunk);
        const T* dout = nullptr;
        if (k < last)
          dout = local(k + 1) >= 0 ? buf(grad_out_, micro, local(k + 1)).data() : buf(grad_in_, micro, a.chunk).data();
        T* din = k > 0 ? buf(grad_out_, micro, a.chunk).data() : nullptr;
        const Kind kind = a.kind;
        const char* name = kind == Kind::B ? "B" : kind == Kind::BW ? "BW" : "W";
        // The chunk's weight gradients are complete after this one: their reduction reads them next.
        const bool last_weights = kind != Kind::B && weights_done[std::size_t(a.chunk)] + 1 == m;
        done = mark_slot(exchange_next(i) || last_weights);
        computed = g.add<exec::Compute>(name, [=] {
          if (kind == Kind::W) {
            part->backward_weights(s);
          } else {
            if (kind == Kind::B) part->backward_inputs(s, 1.0 / m, dout);
            else part->backward(s, 1.0 / m, dout);
            if (din) copy(part, part->input_grad(s), din, n);
          }
          if (done) done->emplace(mark_of(part));  // what is sent or reduced next
        }, std::move(after));
        if (kind != Kind::B) {  // the micro-batch is done with its slot
          free[static_cast<std::size_t>(a.chunk)].push_back(s);
          slot_of(micro, a.chunk) = -1;
          --in_use;
          if (++weights_done[std::size_t(a.chunk)] == m)
            g.add<exec::Comm>(
                "gradients ready",
                [&grads_ready, c = a.chunk, done] {
                  computed_on_device(done);
                  return grads_ready(c);
                },
                {*computed});
        }
      }
    }
    g.run();
    return loss;
  }

  //! The mean loss over the micro-batches of `table` by forward alone (evaluation): no gradient is computed, and
  //! each micro-batch's MicroBatch::backward is false. This stage runs, micro-batch by micro-batch and within one in
  //! the order of the virtual stages it holds, each forward between the receive of its input and the send of its
  //! output, each exchange waited for: every stage goes through the (micro-batch, virtual stage) pairs in the same
  //! order, so the pair that is first among those not yet done, anywhere, can always proceed, and no stage waits
  //! forever. A chunk's forwards all use its slot 0 (the one before is sent, or read by the next chunk, before the
  //! next starts). Returns the mean loss on the stage that computes the loss, 0 elsewhere.
  template <ScheduleTable Table, class Provider>
  double forward_only(const Table& table, Provider&& micro_batch) {
    const int stage = pp_.rank(), P = pp_.size(), m = table.micro_batches;
    LOOM_CHECK(table.stage_count() == P, "a table for ", table.stage_count(), " stages on a pipeline of ", P);
    const int V = static_cast<int>(chunks_.size()), last = P * V - 1;
    std::vector<MicroBatch> mbs;
    for (int i = 0; i < m; ++i) {
      mbs.push_back(micro_batch(i));
      if constexpr (requires { mbs.back().backward = false; }) mbs.back().backward = false;
    }
    for (auto* c : chunks_)
      if (c->slots() < 1) c->set_slots(1);
    const std::size_t n = chunks_.front()->io_elements(mbs[0].batch, mbs[0].seq);
    act_in_.resize(std::size_t(V));
    bool fresh = false;
    for (auto& b : act_in_) fresh = resize(b, n) || fresh;
    if (fresh) computed_on_device(chunks_.front());  // a new block may still be read by queued kernels
    double loss = 0;
    for (int micro = 0; micro < m; ++micro) {
      for (int k = 0; k <= last; ++k) {
        const auto sc = stage_chunk(schedule_, P, k);
        if (sc.stage != stage) continue;
        Model* part = chunks_[static_cast<std::size_t>(sc.chunk)];
        const T* input = nullptr;
        if (k > 0) {
          const auto prev = stage_chunk(schedule_, P, k - 1);
          if (prev.stage == stage) {
            input = chunks_[static_cast<std::size_t>(prev.chunk)]->output(0);
          } else {
            Buffer& in = act_in_[static_cast<std::size_t>(sc.chunk)];
            exchange({Transfer{Kind::recv_act, prev.stage, part, -1, &in}}, n).wait();
            input = in.data();
          }
        }
        const double l = part->forward(0, mbs[static_cast<std::size_t>(micro)], input);
        if (k == last) loss += l / m;
        if (k < last) {
          const auto next = stage_chunk(schedule_, P, k + 1);
          if (next.stage != stage) {
            computed_on_device(part);  // the output is written before the exchange reads it
            exchange({Transfer{Kind::send_act, next.stage, part, 0, nullptr}}, n).wait();
          }
        }
      }
    }
    computed_on_device(chunks_.front());  // the forwards' kernels are done (their losses were read)
    return loss;
  }

  //! The most (micro-batch, chunk) activations this stage held at once in the last run.
  int peak_activations() const { return peak_; }

 private:
  //! One send or receive of an exchange: an activation of a part's slot, or a buffer.
  struct Transfer {
    Kind kind;
    int peer;
    Model* part;
    int slot;          //!< send_act: the slot whose output is sent
    Buffer* data;      //!< the others: what is sent, or received into
  };
  static_assert(std::is_same_v<Dev, Host> || detail::has_marks<Model>,
                "loom: a pipeline part on a device must mark its kernels (ops().mark()), which exchanges wait for");
  using Mark = typename detail::MarkOf<Model>::type;
  static Mark mark_of([[maybe_unused]] Model* part) {
    if constexpr (detail::has_marks<Model>) return part->ops().mark();
    else return {};
  }
  //! On a device: waits until the kernels issued so far are done (nothing to wait for on the host).
  static void computed_on_device([[maybe_unused]] Model* part) {
    if constexpr (!std::is_same_v<Dev, Host>) part->ops().synchronize();
  }
  //! Where a computation records the event after its kernels, when an exchange or a reduction reads its result
  //! next (`needed`) and there is a device to wait for (on the host: none, and no allocation).
  using MarkSlot = std::shared_ptr<std::optional<Mark>>;
  static MarkSlot mark_slot([[maybe_unused]] bool needed) {
    if constexpr (std::is_same_v<Dev, Host>) return nullptr;
    else return needed ? std::make_shared<std::optional<Mark>>() : nullptr;
  }
  //! Waits, on the calling thread, for the event a computation recorded after its kernels (none: nothing to wait
  //! for). The computation has run, so the event is there.
  static void computed_on_device(const MarkSlot& done) {
    if (done && *done) (*done)->wait();
  }
  static void copy([[maybe_unused]] Model* part, const T* src, T* dst, std::size_t n) {
    if constexpr (std::is_same_v<Dev, Host>) std::copy_n(src, n, dst);
    else part->ops().copy(src, dst, n);
  }
  //! Whether b was made anew.
  static bool resize(Buffer& b, std::size_t n) {
    if constexpr (std::is_same_v<Dev, Host>) {
      b.resize(n);
      return false;
    } else {
      if (static_cast<std::size_t>(b.numel()) == n) return false;
      b = Buffer({static_cast<std::int64_t>(n)});
      return true;
    }
  }
  static std::span<T> span_of(Buffer& b) {
    if constexpr (std::is_same_v<Dev, Host>) return std::span<T>(b);
    else return b.span();
  }
  //! Posts one batched exchange and returns its handle, left running on the communicator.
  comm::Handle exchange(const std::vector<Transfer>& run, std::size_t n) {
    std::vector<comm::P2P> ops;
    for (const auto& x : run) {
      if (x.kind == Kind::send_act) ops.push_back(comm::send_op(std::span<const T>(x.part->output(x.slot), n), x.peer));
      else if (x.kind == Kind::send_grad) ops.push_back(comm::send_op(std::span<const T>(span_of(*x.data)), x.peer));
      else ops.push_back(comm::recv_op(span_of(*x.data), x.peer));
    }
    return pp_.exchange_async(ops);
  }

  const void* prepared_ = nullptr;        //!< the table prepare() verified, and its micro-batch count
  int prepared_m_ = 0;
  int capacity_ = 1;                      //!< activation slots per chunk, from the prepared table
  int peak_ = 0;                          //!< the most activations held at once in the last run
  std::vector<Model*> chunks_;
  Comm& pp_;
  Schedule schedule_;
  // Per (chunk, micro-batch): activations received, gradients received, gradients of the chunk's input to send.
  std::vector<Buffer> act_in_, grad_in_, grad_out_;
};

}  // namespace loom::pipeline

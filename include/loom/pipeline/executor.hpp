// The pipeline executor: runs one stage's list of a schedule table (schedule.hpp) on that stage's model chunks,
// moving activations and gradients over the pipeline communicator as the table says: each maximal run of send/recv
// actions is one batched exchange, as the verifier assumed, so a table that passed verify() cannot hang here.
// Exchanges overlap computation: each is posted and runs on the communicator's worker while the stage computes on,
// and the stage waits only before a computation that reads what an exchange receives. Waiting later than the
// verifier's blocking model never delays a peer, so what completes there completes here.
#pragma once

#include <loom/comm/types.hpp>
#include <loom/core/error.hpp>
#include <loom/core/trace.hpp>
#include <loom/pipeline/schedule.hpp>

#include <algorithm>
#include <vector>

namespace loom::pipeline {

//! Runs tables on one pipeline stage. Model is a part of a model with forward(slot, micro_batch, input),
//! backward(slot, scale, doutput) (BW), backward_inputs(slot, scale, doutput) (B), backward_weights(slot) (W),
//! output(slot), input_grad(), slots() and set_slots(n) (models::Gpt with a GptPart); chunks[c] is the part this
//! stage holds as its chunk c. Comm is the pipeline group's communicator: its rank is the stage.
template <class Model, class Comm>
class Executor {
 public:
  //! run()'s grads_ready when none is given.
  struct NoCallback {
    void operator()(int) const {}
  };
  using T = typename std::remove_cvref_t<decltype(std::declval<Model&>().grads())>::value_type;
  using MicroBatch = typename Model::MicroBatch;

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
  //! (after its last micro-batch's W or BW), so that their reduction can start while the stage computes on. A table
  //! not given to prepare() is prepared first.
  template <ScheduleTable Table, class Provider, class Ready = NoCallback>
  double run(const Table& table, Provider&& micro_batch, Ready&& grads_ready = {}) {
    if (prepared_ != static_cast<const void*>(&table) || prepared_m_ != table.micro_batches) prepare(table);
    const int stage = pp_.rank(), P = pp_.size(), m = table.micro_batches;
    const int V = static_cast<int>(chunks_.size()), last = P * V - 1;
    const int capacity = capacity_;
    free_.assign(std::size_t(V), {});
    for (auto& f : free_)
      for (int i = capacity; i-- > 0;) f.push_back(i);
    slot_.assign(std::size_t(V) * m, -1);
    in_use_ = peak_ = 0;
    std::vector<int> weights_done(std::size_t(V), 0);  // per chunk: micro-batches whose weight gradients are in
    auto weights_in = [&](int chunk) {
      if (++weights_done[std::size_t(chunk)] == m) grads_ready(chunk);
    };
    if (static_cast<int>(act_in_.size()) != V * m) {
      act_in_.assign(std::size_t(V) * m, {});
      grad_in_.assign(std::size_t(V) * m, {});
      grad_out_.assign(std::size_t(V) * m, {});
    }
    std::vector<MicroBatch> mbs;
    for (int i = 0; i < m; ++i) mbs.push_back(micro_batch(i));
    const std::size_t n = Model::io_elements(mbs[0].batch, mbs[0].seq);
    auto buf = [&](std::vector<std::vector<T>>& b, int micro, int chunk) -> std::vector<T>& {
      auto& v = b[std::size_t(chunk) * m + micro];
      v.resize(n);
      return v;
    };
    auto vstage = [&](int chunk) { return virtual_stage(schedule_, P, stage, chunk); };
    auto slot = [&](int micro, int chunk) -> int& { return slot_[std::size_t(chunk) * m + micro]; };
    auto release = [&](int micro, int chunk) {
      free_[std::size_t(chunk)].push_back(slot(micro, chunk));
      slot(micro, chunk) = -1;
      --in_use_;
    };
    //! The chunk of this stage that holds virtual stage k, or -1.
    auto local = [&](int k) {
      const auto sc = stage_chunk(schedule_, P, k);
      return sc.stage == stage ? sc.chunk : -1;
    };
    double loss = 0;
    const auto actions = table.stage(stage);
    std::vector<comm::P2P> ops;
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      if (!is_compute(a.kind)) {
        ops.clear();
        for (; i < actions.size() && !is_compute(actions[i].kind); ++i) {
          const Action& x = actions[i];
          Model& part = *chunks_[static_cast<std::size_t>(x.chunk)];
          switch (x.kind) {
            case Kind::send_act:
              ops.push_back(comm::send_op(std::span<const T>(part.output(slot(x.micro, x.chunk)), n), x.peer));
              break;
            case Kind::recv_act: ops.push_back(comm::recv_op(buf(act_in_, x.micro, x.chunk), x.peer)); break;
            case Kind::send_grad: ops.push_back(comm::send_op(buf(grad_out_, x.micro, x.chunk), x.peer)); break;
            case Kind::recv_grad: ops.push_back(comm::recv_op(buf(grad_in_, x.micro, x.chunk), x.peer)); break;
            default: break;
          }
        }
        --i;
        // Posted, not waited for: the stage computes on while the exchange runs on the communicator's worker, and
        // waits only before a compute that reads what it receives. Exchanges complete in the order posted.
        pending_.push_back(pp_.exchange_async(ops));
        continue;
      }
      Model& part = *chunks_[static_cast<std::size_t>(a.chunk)];
      const int k = vstage(a.chunk);
      if (a.kind == Kind::F) {
        if (k > 0 && local(k - 1) < 0) wait_exchanges();
        trace::Scope span("F", "compute");
        const T* input = nullptr;
        if (k > 0) {
          const int prev = local(k - 1);
          input = prev >= 0 ? chunks_[static_cast<std::size_t>(prev)]->output(slot(a.micro, prev))
                            : buf(act_in_, a.micro, a.chunk).data();
        }
        auto& f = free_[static_cast<std::size_t>(a.chunk)];
        LOOM_CHECK(!f.empty(), "stage ", stage, " has no free activation slot for micro-batch ", a.micro);
        slot(a.micro, a.chunk) = f.back();
        f.pop_back();
        peak_ = std::max(peak_, ++in_use_);
        const double l = part.forward(slot(a.micro, a.chunk), mbs[static_cast<std::size_t>(a.micro)], input);
        if (k == last) loss += l / m;
      } else if (a.kind == Kind::B || a.kind == Kind::BW) {
        if (k < last && local(k + 1) < 0) wait_exchanges();
        trace::Scope span(a.kind == Kind::B ? "B" : "BW", "compute");
        const T* dout = nullptr;
        if (k < last) {
          const int next = local(k + 1);
          dout = next >= 0 ? buf(grad_out_, a.micro, next).data() : buf(grad_in_, a.micro, a.chunk).data();
        }
        if (a.kind == Kind::B) {
          part.backward_inputs(slot(a.micro, a.chunk), 1.0 / m, dout);
        } else {
          part.backward(slot(a.micro, a.chunk), 1.0 / m, dout);
          release(a.micro, a.chunk);
        }
        if (k > 0) std::copy_n(part.input_grad(), n, buf(grad_out_, a.micro, a.chunk).data());
        if (a.kind == Kind::BW) weights_in(a.chunk);
      } else {  // W
        trace::Scope span("W", "compute");
        part.backward_weights(slot(a.micro, a.chunk));
        release(a.micro, a.chunk);
        weights_in(a.chunk);
      }
    }
    wait_exchanges();
    return loss;
  }

  //! The most (micro-batch, chunk) activations this stage held at once in the last run.
  int peak_activations() const { return peak_; }

 private:
  void wait_exchanges() {
    if (pending_.empty()) return;
    trace::Scope span("wait for exchanges", "comm");
    for (auto& h : pending_) h.wait();
    pending_.clear();
  }

  const void* prepared_ = nullptr;        //!< the table prepare() verified, and its micro-batch count
  int prepared_m_ = 0;
  int capacity_ = 1;                      //!< activation slots per chunk, from the prepared table
  std::vector<comm::Handle> pending_;     //!< exchanges posted and not yet waited for, in order
  std::vector<std::vector<int>> free_;  //!< per chunk: free activation slots
  std::vector<int> slot_;               //!< per (chunk, micro-batch): its slot, or -1
  int in_use_ = 0, peak_ = 0;
  std::vector<Model*> chunks_;
  Comm& pp_;
  Schedule schedule_;
  // Per (chunk, micro-batch): activations received, gradients received, gradients of the chunk's input to send.
  std::vector<std::vector<T>> act_in_, grad_in_, grad_out_;
};

}  // namespace loom::pipeline

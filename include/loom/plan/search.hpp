// Every layout of a device count for a model and run: tensor parallelism within a node, context parallelism for
// long sequences, pipeline parallelism under 1F1B, interleaved (2 to 4 chunks) and ZB-V, data parallelism with
// ZeRO 0-3, sequence parallelism, and (unless the run fixes it) each recomputation mode; each either refused with
// its reason (the shape does not divide, the batch does not split, it does not fit the device) or kept with its
// memory and step time, fastest first.
#pragma once

#include <loom/plan/cluster.hpp>
#include <loom/plan/layout.hpp>
#include <loom/plan/memory.hpp>
#include <loom/plan/time.hpp>

#include <algorithm>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

namespace loom::plan {

//! A layout that fits, with the run it was timed under.
struct Candidate {
  Layout l;
  Run r;
  Memory m;
  StepTime t;
};

struct SearchOptions {
  //! Try none, selective and full recomputation; false: the run's.
  bool every_recompute = true;
  //! Sequences per micro-batch on a rank; the micro-batches per step follow from the data-parallel degree. 0: the
  //! run's micro_batches, unchanged.
  int micro_batch_size = 1;
  //! The pipeline schedules to try (a published run's own era may not have had them all), and the interleaved
  //! schedule's chunks per stage.
  std::vector<Schedule> schedules{Schedule::one_f_one_b, Schedule::interleaved, Schedule::zero_bubble_v};
  std::vector<int> chunks{2, 3, 4};
  //! The largest context-parallel degree (1: none), and the ZeRO stages to try.
  int max_cp = 1 << 30;
  std::vector<int> zero_stages{0, 1, 2, 3};
  bool sequence_parallel = true;  //!< try tensor parallelism with sequence parallelism as well
  //! Only layouts Megatron-LM runs: pipeline parts of the same number of layers (loom splits unevenly), and
  //! interleaving only on more than two stages (Megatron-LM refuses virtual stages on one or two).
  bool megatron_layouts = false;
  //! Megatron-LM's recipe, as its 2021 runs used it: the gradient all-reduce overlaps backward (PyTorch's DDP)
  //! without a pipeline, and follows it (Megatron's own DDP) with one.
  bool overlap_without_pipeline = false;
};

namespace detail {
inline std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}
}  // namespace detail

//! The layouts of `gpus` devices that fit shape s under run r on cluster c, fastest first; `rejected(why, layout)`
//! hears each that does not. `tried` counts every layout looked at.
inline std::vector<Candidate> search(const GptShape& s, const Run& run, const Cluster& c, int gpus,
                                     const SearchOptions& o, int& tried,
                                     const std::function<void(const std::string&, const Layout&)>& rejected = {}) {
  std::vector<Candidate> ok;
  auto reject = [&](const std::string& why, const Layout& l) {
    if (rejected) rejected(why, l);
  };
  const Recompute modes[] = {Recompute::none, Recompute::selective, Recompute::full};
  for (int tp : detail::divisors(gpus)) {
    if (tp > c.devices_per_node) continue;
    for (int cp : detail::divisors(gpus / tp)) {
      if (cp > 1 && (run.seq < 8192 || cp > o.max_cp)) continue;  // it pays for long sequences only
      for (int pp : detail::divisors(gpus / tp / cp)) {
        if (pp > s.layers) continue;
        const int dp = gpus / tp / cp / pp;
        for (int zero : o.zero_stages)
          for (int sp = 0; sp <= (tp > 1 && o.sequence_parallel ? 1 : 0); ++sp)
            for (std::size_t vi = 0; vi <= o.chunks.size(); ++vi)
              for (Schedule sched : o.schedules) {
                const int v = vi == 0 ? 1 : o.chunks[vi - 1];
                if ((dp == 1 && zero > 0) || (pp == 1 && sched != Schedule::one_f_one_b) ||
                    ((sched == Schedule::interleaved) != (v > 1)))
                  continue;
                for (Recompute rc : modes) {
                  if (!o.every_recompute && rc != run.recompute) continue;
                  Layout l;
                  l.tp = tp, l.cp = cp, l.pp = pp, l.dp = dp, l.zero = zero, l.sp = sp, l.schedule = sched, l.v = v;
                  l.keep = zero == 3 && pp > 1;
                  if (s.experts > 0) l.ep = std::gcd(s.experts, dp * cp);
                  Run r = run;
                  r.recompute = rc;
                  if (o.overlap_without_pipeline) r.overlap_grad_reduce = pp == 1;
                  r.ends_alone = run.ends_alone && pp * l.chunks() >= 3;  // a run's pipeline recipe, where it has one
                  ++tried;
                  if (o.megatron_layouts && !r.ends_alone && s.layers % (pp * l.chunks()) != 0) {
                    reject(loom::detail::cat(s.layers, " layers do not split evenly into ", pp * l.chunks(),
                                             " pipeline parts"), l);
                    continue;
                  }
                  if (o.megatron_layouts && sched == Schedule::interleaved && pp <= 2) {
                    reject("Megatron-LM interleaves only pipelines of more than 2 stages", l);
                    continue;
                  }
                  if (r.batch % dp != 0 ||
                      (o.micro_batch_size > 0 && (r.batch / dp) % o.micro_batch_size != 0)) {
                    reject(loom::detail::cat("the batch of ", r.batch, " does not split over dp"), l);
                    continue;
                  }
                  if (o.micro_batch_size > 0) r.micro_batches = r.batch / dp / o.micro_batch_size;
                  if (const std::string why = violation(s, l, r); !why.empty()) {
                    reject(why, l);
                    continue;
                  }
                  const Memory m = memory(s, l, r, false);
                  if (m.peak > c.usable_bytes()) {
                    reject(loom::detail::cat("out of memory (", m.largest().first, " the largest category)"), l);
                    continue;
                  }
                  ok.push_back({l, r, m, step_time(s, l, r, c)});
                }
              }
      }
    }
  }
  std::sort(ok.begin(), ok.end(), [](const Candidate& x, const Candidate& y) { return x.t.step < y.t.step; });
  return ok;
}

}  // namespace loom::plan

// Pipeline-parallel test cases shared by the Local (threads) and Mpi (processes) tests: a 4-layer GPT in double,
// the single-rank reference run, and one rank's run of a layout with pipeline parallelism (and tensor and data
// parallelism) under a schedule, through the pipeline trainer.
#pragma once

#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/trainer.hpp>

#include "reference_run.hpp"

#include <cmath>
#include <vector>

namespace loom::test::pp {

constexpr models::GptShape shape{4, 4, 2, 16, 37, 8};
constexpr models::GptShape deep{8, 4, 2, 16, 37, 8};  // eight blocks: p = 4 with two chunks per stage
constexpr int steps = 5, batch = 24, seq = 8;  // 24 sequences: split by every m and dp used

inline models::GptOptions options() {
  models::GptOptions o;
  o.dropout = 0.1f;
  return o;
}

inline train::Batches data() {
  static_assert(shape.vocab == deep.vocab);
  std::vector<std::int32_t> tok(2000);
  for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<std::int32_t>((i * i + 5 * i + 2) % shape.vocab);
  return train::Batches(tok, batch, seq, train::BatchOrder::shuffle, 9);
}

using test::Run;
using test::difference;

//! One rank, the whole batch: the reference.
template <models::GptShape S = shape>
Run single_rank() {
  return test::single_rank<S>(data(), options(), steps, batch, seq);
}

//! What a run trains on: the batches, their shape, the model's options.
struct Setup {
  train::Batches data;
  int batch, seq;
  models::GptOptions options;
};
inline Setup setup() { return {data(), batch, seq, options()}; }

//! One rank of layout Cfg (whose PP policy names the schedule and chunks per stage) with m micro-batches per step,
//! the blocks split evenly over the virtual stages or as `split` says, on su's data (the pipeline tests' when none).
template <class Cfg, models::GptShape S = shape, class Ctx>
Run pipeline_rank(Ctx& ctx, int micro_batches, std::vector<int> split = {}, const Setup& su = setup()) {
  using Model = models::Gpt<S, double, models::ModelLayout<Cfg>>;
  using AdamW = optim::AdamW<double>;
  const auto& d = su.data;
  train::TrainerOptions o;
  o.seed = 3, o.model = su.options, o.split = std::move(split);
  o.step.batch = su.batch, o.step.seq = su.seq, o.step.micro_batches = micro_batches, o.step.lr = 1e-2;
  o.step.grad_clip = 1.0;
  train::Trainer<Cfg, Model, AdamW> trainer(ctx, d, o, [](const auto& specs, std::int64_t n) {
    return AdamW(specs, n, {0.9, 0.999, 1e-8, 0.1});
  });
  Run r;
  for (int s = 0; s < steps; ++s) {
    const auto res = trainer.step(s);
    if (res.skipped) throw Error("a step was skipped");
    r.losses.push_back(res.loss);
  }
  const auto global = Model::param_specs(0, true);
  const auto n = static_cast<std::size_t>(S.params());
  r.params.assign(n, 0.0);
  r.held.assign(n, 0);
  r.state.assign(2 * n, 0.0);  // AdamW's two moments, each laid out as the parameters
  for (std::size_t c = 0; c < trainer.parts().size(); ++c) {
    const auto& part = trainer.parts()[c];
    r.blocks.push_back(part->first_layer());
    r.blocks.push_back(part->last_layer());
    const auto whole = part->gather(trainer.params_of_part(c).data());  // under ZeRO-3, from every rank's chunks
    std::vector<std::vector<double>> moments;  // gathered over DP (ZeRO), then TP
    for (const auto& [name, t] : trainer.optimizers()[c].state())
      moments.push_back(part->gather(trainer.state_of_part(c, t.data()).data()));
    for (const auto& s : part->specs()) {
      const auto& g = global[s.index];
      for (auto i = static_cast<std::size_t>(g.offset); i < static_cast<std::size_t>(g.offset + numel_of(g.shape));
           ++i) {
        r.params[i] = whole[i], r.held[i] = 1;
        for (std::size_t k = 0; k < moments.size(); ++k) r.state[k * n + i] = moments[k][i];
      }
    }
  }
  return r;
}

//! The ranks' parameters (and optimizer state) put together: each element from the ranks that hold it, which must
//! agree bit for bit.
inline Run combine(const std::vector<Run>& runs, std::string& disagreement) {
  Run whole = runs.at(0);
  std::vector<char> seen(whole.params.size(), 0);
  for (std::size_t r = 0; r < runs.size(); ++r)
    for (std::size_t i = 0; i < whole.params.size(); ++i) {
      if (!runs[r].held[i]) continue;
      if (seen[i] && whole.params[i] != runs[r].params[i] && disagreement.empty())
        disagreement = "ranks disagree on parameter element " + std::to_string(i);
      whole.params[i] = runs[r].params[i], seen[i] = 1;
      for (std::size_t k = 0; k < 2; ++k)
        whole.state[k * seen.size() + i] = runs[r].state[k * seen.size() + i];
    }
  for (std::size_t i = 0; i < seen.size(); ++i)
    if (!seen[i] && disagreement.empty()) disagreement = "no rank holds parameter element " + std::to_string(i);
  return whole;
}

}  // namespace loom::test::pp

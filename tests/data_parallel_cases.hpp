// Data-parallel test cases shared by the Local (threads) and Mpi (processes) tests: a small GPT in double, its
// single-rank reference run, and one rank's data-parallel run.
#pragma once

#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/trainer.hpp>

#include "reference_run.hpp"

#include <cmath>
#include <vector>

namespace loom::test {

constexpr models::GptShape shape{2, 4, 2, 16, 37, 8};
using Model = models::Gpt<shape, double>;
constexpr int steps = 5, batch = 32, seq = 8;

inline models::GptOptions options() {
  models::GptOptions o;
  o.dropout = 0.1f;
  return o;
}

inline train::Batches data() {
  std::vector<std::int32_t> tok(3000);
  for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<std::int32_t>((i * i + 3 * i) % shape.vocab);
  return train::Batches(tok, batch, seq, train::BatchOrder::shuffle, 11);
}

//! One rank, the whole batch, written directly against the model: the reference.
inline Run single_rank() { return test::single_rank<shape>(data(), options(), steps, batch, seq); }

//! The optimizer of every test: AdamW with weight decay 0.1.
inline auto adamw = [](const auto& specs, std::int64_t n) {
  return optim::AdamW<double>(specs, n, {0.9, 0.999, 1e-8, 0.1});
};
using AdamW = optim::AdamW<double>;

//! The trainer's options of every test; `micro_batches` per rank and step.
inline train::TrainerOptions<models::GptOptions> trainer_options(int micro_batches = 1) {
  train::TrainerOptions<models::GptOptions> o;
  o.seed = 3;
  o.model = options();
  o.step.batch = batch, o.step.seq = seq, o.step.micro_batches = micro_batches, o.step.lr = 1e-2;
  o.step.grad_clip = 1.0;
  return o;
}

//! This rank's run of `steps` steps of a data-parallel layout Ctx::config (ZeRO<1> included): losses, parameters and
//! the optimizer's state, gathered.
template <class Ctx>
Run data_parallel_rank(Ctx& ctx, int micro_batches, std::size_t bucket_bytes, bool overlap) {
  using Cfg = typename Ctx::config;
  const auto d = data();
  auto o = trainer_options(micro_batches);
  o.step.bucket_bytes = bucket_bytes, o.step.overlap = overlap;
  train::Trainer<Cfg, Model, AdamW> trainer(ctx, d, o, adamw);
  Run r;
  for (int s = 0; s < steps; ++s) {
    const auto res = trainer.step(s);
    if (res.skipped) throw Error("a step was skipped");
    r.losses.push_back(res.loss);
  }
  r.params = trainer.params_of_part(0);  // under ZeRO-3, gathered from every rank's chunks
  for (const auto& [name, t] : trainer.optimizers().front().state()) {
    const auto whole = trainer.state_of_part(0, t.data());
    r.state.insert(r.state.end(), whole.begin(), whole.end());
  }
  return r;
}

}  // namespace loom::test

// Data-parallel test cases shared by the Local (threads) and Mpi (processes) tests: a small GPT in double, its
// single-rank reference run, and one rank's data-parallel run.
#pragma once

#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data_parallel.hpp>

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

//! Rank `rank`'s run of `steps` data-parallel steps over communicator dp.
template <class Comm>
Run data_parallel_rank(Comm& dp, int micro_batches, std::size_t bucket_bytes, bool overlap) {
  const auto d = data();
  Model m(3, options());
  optim::AdamW<double> opt(m.specs(), shape.params(), {0.9, 0.999, 1e-8, 0.1});
  train::StepConfig cfg;
  cfg.batch = batch, cfg.seq = seq, cfg.micro_batches = micro_batches, cfg.lr = 1e-2, cfg.grad_clip = 1.0;
  cfg.bucket_bytes = bucket_bytes, cfg.overlap = overlap;
  train::DataParallelTrainer trainer(m, opt, dp, d, cfg);
  Run r;
  for (int s = 0; s < steps; ++s) {
    const auto res = trainer.step(s);
    if (res.skipped) throw Error("a step was skipped");
    r.losses.push_back(res.loss);
  }
  r.params.assign(m.params().data(), m.params().data() + m.params().numel());
  return r;
}

}  // namespace loom::test

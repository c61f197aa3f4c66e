// Tensor-parallel test cases shared by the Local (threads) and Mpi (processes) tests: small GPTs in double with
// multi-head, grouped-query and multi-query attention, the single-rank reference run, and one rank's run of a
// layout with tensor parallelism (and sequence and data parallelism), trained through train::Trainer.
#pragma once

#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/trainer.hpp>

#include "reference_run.hpp"

#include <cmath>
#include <vector>

namespace loom::test::tp {

// Eight heads so that TP 8 divides them; 37 splits unevenly over 2, 4 and 8 ranks.
constexpr models::GptShape mha{2, 8, 8, 32, 40, 8};
constexpr models::GptShape gqa{2, 8, 2, 32, 37, 8};  // kv heads split on tp2, replicated on tp4 and tp8
constexpr models::GptShape mqa{2, 8, 1, 32, 37, 8};
constexpr int steps = 5, batch = 8, seq = 8;
// The shapes as types, for Catch2's TEMPLATE_TEST_CASE.
struct Mha {
  static constexpr models::GptShape shape = mha;
  static constexpr const char* name = "mha";
};
struct Gqa {
  static constexpr models::GptShape shape = gqa;
  static constexpr const char* name = "gqa";
};
struct Mqa {
  static constexpr models::GptShape shape = mqa;
  static constexpr const char* name = "mqa";
};

inline models::GptOptions options() {
  models::GptOptions o;
  o.dropout = 0.1f;
  return o;
}

template <models::GptShape S>
train::Batches data() {
  std::vector<std::int32_t> tok(2000);
  for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<std::int32_t>((i * i + 3 * i + 1) % S.vocab);
  return train::Batches(tok, batch, seq, train::BatchOrder::shuffle, 5);
}

using test::Run;
using test::difference;
using test::state_difference;

//! One rank, the whole batch: the reference.
template <models::GptShape S>
Run single_rank() {
  return test::single_rank<S>(data<S>(), options(), steps, batch, seq);
}

//! One rank of layout Cfg (tp, optionally sp and dp, with or without ZeRO<1>): its part of the model and of the
//! optimizer's state, trained for `steps` steps, each of micro_batches micro-batches per rank.
template <models::GptShape S, class Cfg, class Ctx>
Run parallel_rank(Ctx& ctx, int micro_batches = 1) {
  using Model = models::Gpt<S, double, models::ModelLayout<Cfg>>;
  using AdamW = optim::AdamW<double>;
  const auto d = data<S>();
  train::TrainerOptions<models::GptOptions> o;
  o.seed = 3, o.model = options();
  o.step.batch = batch, o.step.seq = seq, o.step.micro_batches = micro_batches, o.step.lr = 1e-2;
  o.step.grad_clip = 1.0;
  train::Trainer<Cfg, Model, AdamW> trainer(ctx, d, o, [](const auto& specs, std::int64_t n) {
    return AdamW(specs, n, {0.9, 0.999, 1e-8, 0.1});
  });
  auto& m = trainer.model();
  Run r;
  for (int s = 0; s < steps; ++s) {
    const auto res = trainer.step(s);
    if (res.skipped) throw Error("a step was skipped");
    r.losses.push_back(res.loss);
  }
  r.params = m.gather(trainer.params_of_part(0).data());  // under ZeRO-3, from every rank's chunks
  for (const auto& [name, t] : trainer.optimizers().front().state()) {  // gathered over DP (ZeRO), then TP
    const auto flat = trainer.state_of_part(0, t.data());
    const auto whole = m.gather(flat.data());
    r.state.insert(r.state.end(), whole.begin(), whole.end());
  }
  return r;
}

}  // namespace loom::test::tp

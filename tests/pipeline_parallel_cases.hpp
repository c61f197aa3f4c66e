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
using test::state_difference;

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
//! the blocks split evenly over the virtual stages or as `split` says, on su's data (the pipeline tests' when none):
//! testing::rank_run.
template <class Cfg, models::GptShape S = shape, class Ctx>
Run pipeline_rank(Ctx& ctx, int micro_batches, std::vector<int> split = {}, const Setup& su = setup()) {
  testing::Training<models::GptOptions> t{su.data, su.batch, su.seq, steps, 3, su.options};
  t.micro_batches = micro_batches, t.split = std::move(split);
  return testing::rank_run<Cfg, models::Gpt<S, double>>(ctx, t);
}

using testing::combine;

}  // namespace loom::test::pp

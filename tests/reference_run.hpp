// What the parallel tests compare against: a GPT trained on one rank over the whole batch, and the measure of how
// far another run is from it.
#pragma once

#include <loom/models/gpt.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/testing/equivalence.hpp>
#include <loom/train/data.hpp>
#include <loom/train/data_parallel.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom::test {

using testing::Run;

//! `steps` AdamW steps (lr 1e-2, weight decay 0.1, clipping at 1) of the GPT of shape S from seed 3, on one rank,
//! over the whole batch of each step (testing::single_rank).
template <models::GptShape S>
Run single_rank(const train::Batches& d, models::GptOptions opt, int steps, int batch, int seq) {
  return testing::single_rank<models::Gpt<S, double>>(testing::Training<models::GptOptions>{d, batch, seq, steps, 3, opt});
}

//! The largest loss difference relative to the loss, and parameter difference relative to the largest parameter
//! (infinite when the runs hold different numbers of parameters): testing::compare's.
inline std::pair<double, double> difference(const Run& ref, const Run& run) {
  const auto c = testing::compare<models::Gpt<models::tiny, double>>(ref, run);
  return {c.loss, c.params};
}

//! The elements of the optimizer state rank r holds under ZeRO over n ranks, computed from the formula: its chunk of
//! ceil(L / n) elements of each bucket of L (the last chunks short, or empty).
inline std::int64_t shard_elements(const std::vector<train::Bucket>& buckets, int n, int r) {
  std::int64_t e = 0;
  for (const auto& b : buckets) {
    const std::int64_t c = (b.hi - b.lo + n - 1) / n;
    e += std::clamp<std::int64_t>(b.hi - b.lo - r * c, 0, c);
  }
  return e;
}

//! The largest difference of the optimizer's state from the reference's, relative to the largest of each moment
//! (infinite when the run kept none): testing::compare's.
inline double state_difference(const Run& ref, const Run& run) {
  return testing::compare<models::Gpt<models::tiny, double>>(ref, run).state;
}

}  // namespace loom::test

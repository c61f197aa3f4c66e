// The check the parallel tests end with: the ranks' runs put together (each element from the ranks that hold it,
// which must agree bit for bit) against the single-rank run: every rank's losses alike, and the losses, every
// parameter and the optimizer's state within 1e-9 of the reference's.
#pragma once

#include "catch.hpp"
#include "pipeline_parallel_cases.hpp"

#include <string>
#include <vector>

namespace loom::test::pp {

inline void check_equivalent(const Run& reference, const std::vector<Run>& runs) {
  std::string disagreement;
  const Run whole = combine(runs, disagreement);
  CHECK(disagreement.empty());
  INFO(disagreement);
  for (std::size_t r = 0; r < runs.size(); ++r) CHECK(runs[r].losses == runs[0].losses);
  const auto [loss, params] = difference(reference, whole);
  INFO("loss difference " << loss << ", parameter difference " << params);
  CHECK(loss <= 1e-9);
  CHECK(params <= 1e-9);
  const double state = state_difference(reference, whole);
  INFO("optimizer state difference " << state);
  CHECK(state <= 1e-9);
}

}  // namespace loom::test::pp

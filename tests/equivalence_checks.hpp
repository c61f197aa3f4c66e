// The check the parallel tests end with, through the testing kit (<loom/testing/equivalence.hpp>): the ranks' runs
// put together (each element from the ranks that hold it, which must agree bit for bit) against the single-rank run:
// every rank's losses alike, and the losses, every parameter and the optimizer's state within 1e-9 of the
// reference's.
#pragma once

#include "catch.hpp"
#include "pipeline_parallel_cases.hpp"

#include <string>
#include <vector>

namespace loom::test::pp {

inline void check_equivalent(const Run& reference, const std::vector<Run>& runs) {
  std::string disagreement;
  const Run whole = combine(runs, disagreement);
  INFO(disagreement);
  CHECK(disagreement.empty());
  const auto c = testing::compare<models::Gpt<shape, double>>(reference, whole, "the layout");
  INFO(c.describe());
  CHECK(c.ok);
}

}  // namespace loom::test::pp

// loom/plan.hpp: the planner. Memory per rank by category and step time of a model on a cluster under a layout
// (plan/memory.hpp, plan/time.hpp), clusters (plan/cluster.hpp), layouts as values (plan/layout.hpp), published
// runs it is checked against (plan/published.hpp), the search over a device count's layouts (plan/search.hpp), and
// the compile-time check plan::fits (plan/fits.hpp).
#pragma once

#include <loom/plan/cluster.hpp>
#include <loom/plan/fits.hpp>
#include <loom/plan/layout.hpp>
#include <loom/plan/memory.hpp>
#include <loom/plan/model.hpp>
#include <loom/plan/published.hpp>
#include <loom/plan/search.hpp>
#include <loom/plan/time.hpp>

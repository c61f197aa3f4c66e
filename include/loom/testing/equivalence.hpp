// Template unit tests for users: a model trained for k steps from one seed on layouts of ranks, each run put together
// and held against the run of one rank. Every layout must compute the same model: the same losses, and, gathered into
// the single-rank layout, the same parameters and optimizer state, within a tolerance set by the element type.
//
//   using Model = loom::models::Gpt<my_shape, double>;                   // the single-rank model type
//   using Layouts = std::tuple<loom::Parallel<loom::TP<2>>, loom::Parallel<loom::PP<2>, loom::DP<2>>>;
//   TEMPLATE_LIST_TEST_CASE("my model on every layout", "[model]", Layouts) {
//     static const loom::testing::Training<Model::Options> t = my_training();  // data, batch, steps, seed, options
//     static const loom::testing::Run one = loom::testing::single_rank<Model>(t);
//     const auto c = loom::testing::compare<Model>(one, loom::testing::on_layout<TestType, Model>(t));
//     INFO(c.describe());
//     CHECK(c.ok);
//   }
//
// Without Catch2: check_layouts<Model, Layouts>(t) returns one Comparison per layout. Ranks are threads
// (run_local); rank_run<Cfg, Model>(ctx, t) is one rank's part for a run under another launcher (mpirun), whose
// ranks' Runs `combine` puts together. Model is any train::TrainableModel whose type fixes its shape
// (Model::static_shape) and names itself on another layout (Model::with_layout<L>): the library's models::Gpt, or a
// model of one's own (docs/your-own-model.md).
#pragma once

#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/part.hpp>
#include <loom/optim/optimizers.hpp>
#include <loom/train/data.hpp>
#include <loom/train/trainer.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace loom::testing {

//! What every run of a comparison trains: the batches, the global batch of `batch` sequences of `seq` tokens, the
//! steps, the seed the model starts from, its options, AdamW's learning rate and weight decay (betas 0.9, 0.999,
//! eps 1e-8), clipping, micro-batches per step and an explicit layer split (empty: even). ModelOptions is the
//! model's Options.
template <class ModelOptions>
struct Training {
  train::Batches data;
  int batch = 8, seq = 8, steps = 5;
  std::uint64_t seed = 3;
  ModelOptions model{};
  double lr = 1e-2, weight_decay = 0.1, grad_clip = 1.0;
  int micro_batches = 1;
  std::vector<int> split{};
};

//! A run: the loss of every step, and the whole model's parameters and AdamW's two moments (exp_avg, then
//! exp_avg_sq, each laid out as the parameters) in the single-rank layout; `held` marks the elements a rank holds
//! (empty: all), `blocks` the first and last block of each pipeline part it holds.
struct Run {
  std::vector<double> losses, params, state;
  std::vector<char> held;
  std::vector<int> blocks;
};

//! The relative differences allowed against the single-rank run of the same element type: layouts sum in other
//! orders, so they differ by rounding alone, which double keeps near 1e-12 after a few steps.
template <class T>
inline constexpr double tolerance = std::is_same_v<T, double> ? 1e-9 : std::is_same_v<T, float> ? 2e-4 : 3e-2;

//! A model type on layout Cfg: Model::with_layout<ModelLayout<Cfg>> (models::Gpt<S, T, Parallel<>, Dev> becomes
//! models::Gpt<S, T, ModelLayout<Cfg>, Dev>).
template <class Model, class Cfg>
struct ModelOn {
  static_assert(requires { typename Model::template with_layout<models::ModelLayout<Cfg>>; },
                "loom: the testing kit needs Model::with_layout<L>, the same model on model layout L");
  using type = typename Model::template with_layout<models::ModelLayout<Cfg>>;
};
template <class Model, class Cfg>
using model_on_t = typename ModelOn<Model, Cfg>::type;

//! The model trained on one rank over the whole batch of every step: forward and backward of the whole batch,
//! clipping to the global norm, AdamW; the model built as the trainer builds it (train::BuildableModel).
template <class Model>
Run single_rank(const Training<typename Model::Options>& t) {
  static_assert(train::detail::FixesShape<Model>,
                "loom: the testing kit trains a model whose type fixes its shape (Model::static_shape)");
  static_assert(train::ModelRequirements<Model>::ok);
  using T = typename Model::value_type;
  Run r;
  run_local<Parallel<>>([&](auto& ctx) {
    auto& tp = ctx.template comm<Axis::tp>();
    using Comm = std::remove_reference_t<decltype(tp)>;
    Model m(t.seed, tp, static_cast<Comm*>(nullptr), static_cast<Comm*>(nullptr), models::Part{},
            train::detail::trained_options(t.model));
    const auto n = static_cast<std::int64_t>(m.params().numel());
    optim::AdamW<T> adamw(m.specs(), n, {0.9, 0.999, 1e-8, t.weight_decay});
    std::vector<std::int32_t> in(static_cast<std::size_t>(t.batch) * t.seq), tg(in.size());
    for (int s = 0; s < t.steps; ++s) {
      t.data.fill(s, 0, t.batch, in.data(), tg.data());
      m.zero_grad();
      const typename Model::MicroBatch mb{in.data(), tg.data(), t.batch, t.seq, static_cast<std::uint64_t>(s), 0};
      r.losses.push_back(m.forward(0, mb, nullptr));
      m.backward(0, 1.0, nullptr);
      if (t.grad_clip > 0) optim::clip_grad_norm(m.grads(), t.grad_clip);
      adamw.step(m.params(), m.grads(), t.lr);
    }
    r.params.assign(m.params().data(), m.params().data() + n);
    for (const auto& [name, st] : adamw.state())
      if (name == "adamw.exp_avg" || name == "adamw.exp_avg_sq")
        r.state.insert(r.state.end(), st.data(), st.data() + n);
  });
  return r;
}

//! One rank's run of layout Cfg (ctx: its context), through train::Trainer: what it holds of the whole model.
template <class Cfg, class Model, class Ctx>
Run rank_run(Ctx& ctx, const Training<typename Model::Options>& t) {
  using M = model_on_t<Model, Cfg>;
  using T = typename M::value_type;
  using AdamW = optim::AdamW<T>;
  typename train::Trainer<Cfg, M, AdamW>::Options o;
  o.seed = t.seed, o.model = t.model, o.split = t.split;
  o.step.batch = t.batch, o.step.seq = t.seq, o.step.micro_batches = t.micro_batches, o.step.lr = t.lr;
  o.step.grad_clip = t.grad_clip;
  const double wd = t.weight_decay;
  train::Trainer<Cfg, M, AdamW> trainer(ctx, t.data, o, [wd](const auto& specs, std::int64_t n) {
    return AdamW(specs, n, {0.9, 0.999, 1e-8, wd});
  });
  Run r;
  for (int s = 0; s < t.steps; ++s) {
    const auto res = trainer.step(s);
    if (res.skipped) throw Error(loom::detail::cat("loom: step ", s, " was skipped on ", Cfg::name()));
    r.losses.push_back(res.loss);
  }
  const auto global = trainer.parts().front()->param_specs(0, true);
  const auto n = static_cast<std::size_t>(layers::numel_of_table(global));
  r.params.assign(n, 0.0);
  r.held.assign(n, 0);
  r.state.assign(2 * n, 0.0);
  for (std::size_t c = 0; c < trainer.parts().size(); ++c) {
    const auto& part = trainer.parts()[c];
    if constexpr (requires { part->first_layer(); part->last_layer(); }) {
      r.blocks.push_back(part->first_layer());
      r.blocks.push_back(part->last_layer());
    }
    const auto whole = part->gather(trainer.params_of_part(c).data());  // under ZeRO-3, from every rank's chunks
    std::vector<std::vector<loom::acc_t<T>>> moments;                    // gathered over DP (ZeRO), then TP
    for (const auto& [name, s] : trainer.optimizers()[c].state())
      if (name == "adamw.exp_avg" || name == "adamw.exp_avg_sq")
        moments.push_back(part->gather(trainer.state_of_part(c, s.data()).data()));
    for (const auto& s : part->specs()) {
      const auto& g = global[s.index];
      for (auto i = static_cast<std::size_t>(g.offset); i < static_cast<std::size_t>(g.offset + numel_of(g.shape));
           ++i) {
        r.params[i] = static_cast<double>(whole[i]), r.held[i] = 1;
        for (std::size_t k = 0; k < moments.size(); ++k) r.state[k * n + i] = static_cast<double>(moments[k][i]);
      }
    }
  }
  return r;
}

//! The ranks' runs put together: each element from the ranks that hold it, which must agree bit for bit (else
//! `disagreement` names the first that does not), every element held by some rank.
inline Run combine(const std::vector<Run>& runs, std::string& disagreement) {
  Run whole = runs.at(0);
  const std::size_t n = whole.params.size();
  std::vector<char> seen(n, 0);
  for (std::size_t r = 0; r < runs.size(); ++r) {
    if (runs[r].losses != runs[0].losses && disagreement.empty())
      disagreement = "rank " + std::to_string(r) + "'s losses differ from rank 0's";
    for (std::size_t i = 0; i < n; ++i) {
      if (!runs[r].held[i]) continue;
      if (seen[i] && whole.params[i] != runs[r].params[i] && disagreement.empty())
        disagreement = "ranks disagree on parameter element " + std::to_string(i);
      whole.params[i] = runs[r].params[i], seen[i] = 1;
      for (std::size_t k = 0; k < 2; ++k) whole.state[k * n + i] = runs[r].state[k * n + i];
    }
  }
  for (std::size_t i = 0; i < n; ++i)
    if (!seen[i] && disagreement.empty()) disagreement = "no rank holds parameter element " + std::to_string(i);
  whole.held.clear();
  return whole;
}

//! The model trained on layout Cfg, its ranks threads of this process; the ranks' runs put together (an error if
//! they disagree).
template <class Cfg, class Model>
Run on_layout(const Training<typename Model::Options>& t) {
  std::vector<Run> runs(Cfg::world_size);
  run_local<Cfg>([&](auto& ctx) { runs[static_cast<std::size_t>(ctx.rank())] = rank_run<Cfg, Model>(ctx, t); });
  std::string disagreement;
  Run whole = combine(runs, disagreement);
  if (!disagreement.empty()) throw Error("loom: on " + std::string(Cfg::name()) + ": " + disagreement);
  return whole;
}

//! How far a run is from the single-rank run: the largest loss difference relative to the loss, parameter
//! difference relative to the largest parameter, and moment difference relative to each moment's largest (each
//! infinite when the run holds another number of elements); ok when all are within tolerance<T>.
struct Comparison {
  std::string layout;
  double loss = 0, params = 0, state = 0, limit = 0;
  bool ok = false;
  std::string describe() const {
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s: loss %.3g, parameters %.3g, optimizer state %.3g (tolerance %.3g)%s",
                  layout.c_str(), loss, params, state, limit, ok ? "" : ": NOT the single-rank model");
    return buf;
  }
};

template <class Model>
Comparison compare(const Run& reference, const Run& run, std::string layout = {}) {
  Comparison c{std::move(layout)};
  c.limit = tolerance<typename Model::value_type>;
  for (std::size_t s = 0; s < reference.losses.size(); ++s)
    c.loss = std::max(c.loss, s < run.losses.size() ? std::abs(run.losses[s] - reference.losses[s]) /
                                                          std::abs(reference.losses[s])
                                                    : INFINITY);
  auto worst = [](const double* a, const double* b, std::size_t n) {
    double d = 0, scale = 0;
    for (std::size_t i = 0; i < n; ++i) d = std::max(d, std::abs(a[i] - b[i])), scale = std::max(scale, std::abs(b[i]));
    return scale > 0 ? d / scale : d;
  };
  const std::size_t n = reference.params.size();
  c.params = run.params.size() == n ? worst(run.params.data(), reference.params.data(), n) : INFINITY;
  if (run.state.size() != reference.state.size() || n == 0) c.state = INFINITY;
  else
    for (std::size_t k = 0; k * n < reference.state.size(); ++k)
      c.state = std::max(c.state, worst(run.state.data() + k * n, reference.state.data() + k * n, n));
  c.ok = c.loss <= c.limit && c.params <= c.limit && c.state <= c.limit;
  return c;
}

//! Every layout of Layouts (a std::tuple of Parallel<...> types) against the single-rank run of Model.
template <class Model, class Layouts>
std::vector<Comparison> check_layouts(const Training<typename Model::Options>& t) {
  const Run reference = single_rank<Model>(t);
  std::vector<Comparison> out;
  [&]<class... Cfg>(std::type_identity<std::tuple<Cfg...>>) {
    (out.push_back(compare<Model>(reference, on_layout<Cfg, Model>(t), std::string(Cfg::name()))), ...);
  }(std::type_identity<Layouts>{});
  return out;
}

}  // namespace loom::testing

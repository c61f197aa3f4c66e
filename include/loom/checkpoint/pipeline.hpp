// Training checkpoints of a pipeline-parallel run: the stages' parts put together into the whole model and optimizer
// state, in the single-rank layout, so that any layout resumes them; and resuming one into every part.
#pragma once

#include <loom/checkpoint/training.hpp>
#include <loom/train/pipeline_parallel.hpp>

namespace loom::checkpoint {

//! A collective over the tensor- and pipeline-parallel groups; the ranks with `write` write. `run` is stored as
//! trainer.json's "run" (see write_training).
template <models::GptShape S, class T, class Optimizer, class Ctx>
void save_training(const std::string& dir, train::PipelineTrainer<S, T, Optimizer, Ctx>& trainer, int next_step,
                   bool write = true, const nlohmann::json& run = nullptr) {
  using A = typename Optimizer::acc;
  auto& parts = trainer.parts();
  auto& opts = trainer.optimizers();
  const auto whole =
      trainer.template assemble<T>([&](std::size_t c) { return parts[c]->gather(parts[c]->params().data()); });
  std::vector<std::pair<std::string, std::vector<A>>> state;
  const auto names = opts.front().state();
  for (std::size_t k = 0; k < names.size(); ++k)
    state.emplace_back(names[k].first, trainer.template assemble<A>([&](std::size_t c) {
      return parts[c]->gather(opts[c].state()[k].second.data());
    }));
  if (!write) return;
  write_gpt<S>(dir, whole, parts.front()->options().ln_eps);
  write_training<Optimizer>(dir, state, opts.front().counter(), next_step, run);
}

//! Loads a training checkpoint (saved on any layout) into every part and its optimizer; returns the next step.
template <models::GptShape S, class T, class Optimizer, class Ctx>
int load_training(const std::string& dir, train::PipelineTrainer<S, T, Optimizer, Ctx>& trainer) {
  int next = 0;
  for (std::size_t c = 0; c < trainer.parts().size(); ++c)
    next = load_training(dir, *trainer.parts()[c], trainer.optimizers()[c]);
  return next;
}

}  // namespace loom::checkpoint

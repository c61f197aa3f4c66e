// Training checkpoints of a train::Trainer on any layout: its parts (with pipeline parallelism, every stage's) put
// together into the whole model and optimizer state, in the single-rank layout, so that any layout resumes them; and
// resuming one into every part.
#pragma once

#include <loom/checkpoint/training.hpp>
#include <loom/train/trainer.hpp>

namespace loom::checkpoint {

//! A collective over the tensor- and pipeline-parallel groups (and, under ZeRO, the data-parallel group); the
//! ranks with `write` write. `run` is stored as trainer.json's "run" (see write_training).
template <class Model, class Optimizer>
void save_training(const std::string& dir, train::TrainerOf<Model, Optimizer>& trainer, int next_step,
                   bool write = true, const nlohmann::json& run = nullptr) {
  if (!trainer.pipelined() && trainer.zero_stage() == 0)
    return save_training(dir, trainer.model(), trainer.optimizers().front(), next_step, write, run);
  using A = typename Optimizer::acc;
  static_assert(checkpointable<typename train::TrainerOf<Model, Optimizer>::Part>());
  auto& parts = trainer.parts();
  auto& opts = trainer.optimizers();
  const auto whole = trainer.whole_params();
  std::vector<std::pair<std::string, std::vector<A>>> state;
  const auto names = opts.front().state();
  for (std::size_t k = 0; k < names.size(); ++k)
    state.emplace_back(names[k].first, trainer.template assemble<A>([&](std::size_t c) {
      return trainer.gather_from_host(c, trainer.state_of_part(c, opts[c].state()[k].second.data()));
    }));
  if (!write) return;
  write_model(dir, *parts.front(), whole);
  write_training<Optimizer>(dir, state, opts.front().counter(), next_step, run);
}

//! Loads a training checkpoint (saved on any layout) into every part and its optimizer (under ZeRO, this rank's
//! shard of its state); returns the next step.
template <class Model, class Optimizer>
int load_training(const std::string& dir, train::TrainerOf<Model, Optimizer>& trainer) {
  int next = 0;
  for (std::size_t c = 0; c < trainer.parts().size(); ++c) {
    auto& part = *trainer.parts()[c];
    Optimizer& opt = trainer.optimizers()[c];
    if (trainer.zero_stage() == 0) {
      next = load_training(dir, part, opt);
      continue;
    }
    read_trainer_state(dir);
    read_model(dir, part);
    next = load_training_state(dir, opt, layers::numel_of_table(part.param_specs(0, true)),
                               [&](const auto* whole, auto* state) {
      const auto flat = trainer.scatter_to_host(c, whole);
      trainer.set_state_of_part(c, flat.data(), state);
    });
  }
  return next;
}

}  // namespace loom::checkpoint

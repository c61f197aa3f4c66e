// A training checkpoint: the model (DIR/model.safetensors, DIR/config.json), the optimizer's state
// (DIR/optimizer.safetensors) and where training stands (DIR/trainer.json: the next step). Resuming from it
// continues the same run: batches and dropout are keyed by the step, so the losses that follow are those the
// uninterrupted run would have had. Every file is written to a temporary name and renamed.
#pragma once

#include <loom/checkpoint/gpt.hpp>

#include <fstream>

namespace loom::checkpoint {

template <models::GptShape S, class T, class Optimizer>
void save_training(const std::string& dir, const models::Gpt<S, T>& model, const Optimizer& opt, int next_step) {
  save_gpt(dir, model);
  std::vector<std::pair<std::string, StoredTensor>> tensors;
  const auto state = opt.state();
  for (const auto& [name, t] : state) {
    StoredTensor s;
    s.dtype = dtype_of<typename std::remove_cvref_t<decltype(t)>::value_type>;
    s.shape = t.shape();
    s.data = t.data();
    s.byte_count = t.bytes();
    tensors.emplace_back(name, std::move(s));
  }
  write_safetensors(dir + "/optimizer.safetensors", tensors,
                    {{"optimizer", Optimizer::name}, {"counter", std::to_string(opt.counter())}});
  const std::string file = dir + "/trainer.json", tmp = file + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << nlohmann::json{{"next_step", next_step}, {"optimizer", Optimizer::name}, {"counter", opt.counter()}}.dump(2)
      << "\n";
    if (!f) throw Error("loom: writing " + tmp + " failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file, ec);
  if (ec) throw Error("loom: cannot rename " + tmp + " to " + file + ": " + ec.message());
}

//! Loads a training checkpoint into model and opt (same shape, same optimizer) and returns the step to continue at.
template <models::GptShape S, class T, class Optimizer>
int load_training(const std::string& dir, models::Gpt<S, T>& model, Optimizer& opt) {
  load_gpt(dir, model);
  const std::string file = dir + "/trainer.json";
  std::ifstream f(file);
  if (!f) throw Error("loom: " + dir + " is not a training checkpoint (no trainer.json); --init-from loads weights");
  const auto j = nlohmann::json::parse(f);
  const std::string saved = j.at("optimizer");
  if (saved != Optimizer::name)
    throw Error("loom: " + dir + " was saved with the optimizer " + saved + ", not " + Optimizer::name);
  auto stored = read_safetensors(dir + "/optimizer.safetensors");
  for (auto& [name, t] : opt.state()) {
    auto it = stored.find(name);
    if (it == stored.end()) throw Error("loom: " + dir + "/optimizer.safetensors has no tensor " + name);
    using A = typename std::remove_cvref_t<decltype(t)>::value_type;
    if (it->second.dtype != dtype_of<A> || it->second.shape != t.shape())
      throw Error("loom: " + dir + "/optimizer.safetensors: " + name + " has dtype " +
                  std::string(name_of(it->second.dtype)) + " and shape " + to_string(it->second.shape) +
                  ", the optimizer needs " + std::string(name_of(dtype_of<A>)) + " and " + to_string(t.shape()));
    std::memcpy(t.data(), it->second.bytes.data(), t.bytes());
  }
  opt.set_counter(j.at("counter").get<int>());
  return j.at("next_step").get<int>();
}

}  // namespace loom::checkpoint

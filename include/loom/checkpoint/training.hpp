// A training checkpoint: the model (DIR/model.safetensors, DIR/config.json), the optimizer's state
// (DIR/optimizer.safetensors) and where training stands (DIR/trainer.json: the next step). Resuming from it
// continues the same run: batches and dropout are keyed by the step, so the losses that follow are those the
// uninterrupted run would have had. Every file is written to a temporary name and renamed.
#pragma once

#include <loom/checkpoint/gpt.hpp>

#include <fstream>

namespace loom::checkpoint {

//! Writes the optimizer's state (each tensor whole, in the single-rank layout, so that any layout can resume it)
//! and where training stands.
template <class Optimizer, class A>
void write_training(const std::string& dir, const std::vector<std::pair<std::string, std::vector<A>>>& state,
                    int counter, int next_step) {
  std::vector<std::pair<std::string, StoredTensor>> tensors;
  for (const auto& [name, whole] : state) {
    StoredTensor s;
    s.dtype = dtype_of<A>;
    s.shape = {static_cast<std::int64_t>(whole.size())};
    s.data = whole.data();
    s.byte_count = whole.size() * sizeof(A);
    tensors.emplace_back(name, std::move(s));
  }
  write_safetensors(dir + "/optimizer.safetensors", tensors,
                    {{"optimizer", Optimizer::name}, {"counter", std::to_string(counter)}});
  const std::string file = dir + "/trainer.json", tmp = file + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << nlohmann::json{{"next_step", next_step}, {"optimizer", Optimizer::name}, {"counter", counter}}.dump(2)
      << "\n";
    if (!f) throw Error("loom: writing " + tmp + " failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file, ec);
  if (ec) throw Error("loom: cannot rename " + tmp + " to " + file + ": " + ec.message());
}

//! A training checkpoint of a model on any tensor-parallel layout: a collective over its tensor-parallel group;
//! only the ranks with `write` write.
template <models::GptShape S, class T, class Cfg, class Dev, class Optimizer>
void save_training(const std::string& dir, models::Gpt<S, T, Cfg, Dev>& model, const Optimizer& opt, int next_step,
                   bool write = true) {
  save_gpt(dir, model, write);
  using A = typename Optimizer::acc;
  std::vector<std::pair<std::string, std::vector<A>>> state;
  for (const auto& [name, t] : opt.state()) state.emplace_back(name, model.gather(t.data()));
  if (write) write_training<Optimizer>(dir, state, opt.counter(), next_step);
}

//! Loads a training checkpoint into model and opt (same shape, same optimizer) and returns the step to continue at.
template <models::GptShape S, class T, class Cfg, class Dev, class Optimizer>
int load_training(const std::string& dir, models::Gpt<S, T, Cfg, Dev>& model, Optimizer& opt) {
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
    const Shape whole{S.params()};
    if (it->second.dtype != dtype_of<A> || it->second.shape != whole)
      throw Error("loom: " + dir + "/optimizer.safetensors: " + name + " has dtype " +
                  std::string(name_of(it->second.dtype)) + " and shape " + to_string(it->second.shape) +
                  ", the optimizer needs " + std::string(name_of(dtype_of<A>)) + " and " + to_string(whole));
    std::vector<A> buf(static_cast<std::size_t>(S.params()));
    std::memcpy(buf.data(), it->second.bytes.data(), buf.size() * sizeof(A));
    model.scatter(buf.data(), t.data());
  }
  opt.set_counter(j.at("counter").get<int>());
  return j.at("next_step").get<int>();
}

}  // namespace loom::checkpoint

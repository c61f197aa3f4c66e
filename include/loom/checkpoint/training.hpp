// A training checkpoint: the model (DIR/model.safetensors, DIR/config.json), the optimizer's state
// (DIR/optimizer.safetensors) and where training stands (DIR/trainer.json: the next step, the optimizer, its step
// counter and, under "run", whatever settings the caller records to check a resumed run against). Resuming from it
// continues the same run: batches and dropout are keyed by the step, so the losses that follow are those the
// uninterrupted run would have had. Every file is written to a temporary name and renamed.
#pragma once

#include <loom/checkpoint/safetensors.hpp>
#include <loom/train/concepts.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <limits>
#include <type_traits>

namespace loom::checkpoint {

//! What a checkpoint needs of a model beside train::TrainableModel, as free functions found by argument-dependent
//! lookup (for models::Gpt in <loom/models/gpt/checkpoint.hpp>): model_config(model), the JSON that describes it
//! (config.json, and a sharded checkpoint's "model"); write_model(dir, model, whole), its files from the whole
//! model's parameters in the single-rank layout; read_model(dir, model), each rank's part from those files.
template <class M>
concept CheckpointModel =
    train::TrainableModel<M> && requires(M& m, const M& cm, const std::string& dir,
                                         const std::vector<typename M::value_type>& whole) {
      { model_config(cm) } -> std::convertible_to<nlohmann::ordered_json>;
      write_model(dir, cm, whole);
      read_model(dir, m);
    };

//! The message of a checkpoint of a model that is not a CheckpointModel.
template <class M>
constexpr bool checkpointable() {
  static_assert(CheckpointModel<M>,
                "loom: a checkpoint needs model_config(model), write_model(dir, model, whole) and read_model(dir, "
                "model) for the model, found by argument-dependent lookup (for models::Gpt: include "
                "<loom/models/gpt/checkpoint.hpp>) (checkpoint::CheckpointModel)");
  return true;
}

//! DIR/trainer.json, parsed; a file that cannot be opened, is not JSON or holds no object is refused with its name.
inline nlohmann::json read_trainer_json(const std::string& dir) {
  const std::string file = dir + "/trainer.json";
  std::ifstream f(file);
  if (!f)
    throw Error("loom: cannot open " + file + ": " + dir + " is not a training checkpoint (--init-from loads weights "
                "alone)");
  nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw Error("loom: " + file + " is not valid JSON");
  if (!j.is_object()) throw Error("loom: " + file + " holds " + j.dump() + ", not a JSON object");
  return j;
}

//! The value of `key` in j, an object read from `file`, as V (bool, an integer, a floating-point type or
//! std::string); dots separate nested keys ("run.seed"). A missing key, or a value of another type or out of V's
//! range, is refused naming the file and the key.
template <class V>
V json_value(const nlohmann::json& j, const std::string& file, const std::string& key) {
  const nlohmann::json* at = &j;
  for (std::size_t from = 0;;) {
    const std::size_t dot = key.find('.', from);
    const std::string part = key.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
    if (!at->is_object() || !at->contains(part)) throw Error("loom: " + file + " has no key '" + key + "'");
    at = &(*at)[part];
    if (dot == std::string::npos) break;
    from = dot + 1;
  }
  const nlohmann::json& v = *at;
  auto wrong = [&](const char* what) {
    return Error("loom: " + file + ": '" + key + "' must be " + what + ", got " + v.dump());
  };
  if constexpr (std::is_same_v<V, bool>) {
    if (!v.is_boolean()) throw wrong("true or false");
    return v.get<bool>();
  } else if constexpr (std::is_same_v<V, std::string>) {
    if (!v.is_string()) throw wrong("a string");
    return v.get<std::string>();
  } else if constexpr (std::is_integral_v<V>) {
    using L = std::numeric_limits<V>;
    if (v.is_number_unsigned()) {
      const auto u = v.get<std::uint64_t>();
      if (u <= static_cast<std::uint64_t>(L::max())) return static_cast<V>(u);
    } else if (v.is_number_integer()) {
      const auto i = v.get<std::int64_t>();
      if (i >= 0 ? static_cast<std::uint64_t>(i) <= static_cast<std::uint64_t>(L::max())
                 : std::is_signed_v<V> && i >= static_cast<std::int64_t>(L::min()))
        return static_cast<V>(i);
    }
    throw wrong(("an integer from " + std::to_string(L::min()) + " to " + std::to_string(L::max())).c_str());
  } else {
    static_assert(std::is_floating_point_v<V>, "json_value reads bool, integers, floating-point numbers and strings");
    if (!v.is_number()) throw wrong("a number");
    return v.get<V>();
  }
}

//! Writes the optimizer's state (each tensor whole, in the single-rank layout, so that any layout can resume it)
//! and where training stands; `run` (a JSON object, or null for none) is stored as trainer.json's "run".
template <class Optimizer, class A>
void write_training(const std::string& dir, const std::vector<std::pair<std::string, std::vector<A>>>& state,
                    int counter, int next_step, const nlohmann::json& run = nullptr) {
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
    nlohmann::json j{{"next_step", next_step}, {"optimizer", Optimizer::name}, {"counter", counter}};
    if (!run.is_null()) j["run"] = run;
    f << j.dump(2) << "\n";
    if (!f) throw Error("loom: writing " + tmp + " failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file, ec);
  if (ec) throw Error("loom: cannot rename " + tmp + " to " + file + ": " + ec.message());
}

//! A training checkpoint of a model on any tensor-parallel layout: a collective over its tensor-parallel group;
//! only the ranks with `write` write. `run` is stored as trainer.json's "run" (see write_training).
template <class Model, class Optimizer>
  requires train::TrainableModel<Model>
void save_training(const std::string& dir, Model& model, const Optimizer& opt, int next_step, bool write = true,
                   const nlohmann::json& run = nullptr) {
  static_assert(checkpointable<Model>());
  const auto whole = model.gather(model.params().data());
  if (write) write_model(dir, model, whole);
  using A = typename Optimizer::acc;
  std::vector<std::pair<std::string, std::vector<A>>> state;
  for (const auto& [name, t] : opt.state()) state.emplace_back(name, model.gather(t.data()));
  if (write) write_training<Optimizer>(dir, state, opt.counter(), next_step, run);
}

//! Where a training checkpoint stands: DIR/trainer.json's next step, optimizer and step counter, each checked.
struct TrainerState {
  int next_step = 0;
  std::string optimizer;
  int counter = 0;
};

//! Reads trainer.json's next_step, optimizer and counter (from j, read from `file`; or from DIR's); a missing or
//! mistyped key, or a negative step or counter, is refused naming the file and the key.
inline TrainerState read_trainer_state(const nlohmann::json& j, const std::string& file) {
  TrainerState s{json_value<int>(j, file, "next_step"), json_value<std::string>(j, file, "optimizer"),
                 json_value<int>(j, file, "counter")};
  if (s.next_step < 0) throw Error(loom::detail::cat("loom: ", file, ": 'next_step' must not be negative, got ",
                                                     s.next_step));
  if (s.counter < 0) throw Error(loom::detail::cat("loom: ", file, ": 'counter' must not be negative, got ",
                                                   s.counter));
  return s;
}
inline TrainerState read_trainer_state(const std::string& dir) {
  return read_trainer_state(read_trainer_json(dir), dir + "/trainer.json");
}

//! Reads DIR's trainer state and optimizer state for Optimizer (the same one, for a model of `params` elements) and
//! sets opt's step counter; place(whole, state) puts each stored tensor (the whole model's, in host memory) into
//! the optimizer's tensor of the same name. Returns the step to continue at.
template <class Optimizer, class Place>
int load_training_state(const std::string& dir, Optimizer& opt, std::int64_t params, Place&& place) {
  const TrainerState ts = read_trainer_state(dir);
  const std::string& saved = ts.optimizer;
  if (saved != Optimizer::name)
    throw Error("loom: " + dir + " was saved with the optimizer " + saved + ", not " + Optimizer::name);
  auto stored = read_safetensors(dir + "/optimizer.safetensors");
  for (auto& [name, t] : opt.state()) {
    auto it = stored.find(name);
    if (it == stored.end()) throw Error("loom: " + dir + "/optimizer.safetensors has no tensor " + name);
    using A = typename std::remove_cvref_t<decltype(t)>::value_type;
    const Shape whole{params};
    if (it->second.dtype != dtype_of<A> || it->second.shape != whole)
      throw Error("loom: " + dir + "/optimizer.safetensors: " + name + " has dtype " +
                  std::string(name_of(it->second.dtype)) + " and shape " + to_string(it->second.shape) +
                  ", the optimizer needs " + std::string(name_of(dtype_of<A>)) + " and " + to_string(whole));
    std::vector<A> buf(static_cast<std::size_t>(params));
    std::memcpy(buf.data(), it->second.bytes.data(), buf.size() * sizeof(A));
    place(static_cast<const A*>(buf.data()), t.data());
  }
  opt.set_counter(ts.counter);
  return ts.next_step;
}

//! Loads a training checkpoint into model and opt (same shape, same optimizer) and returns the step to continue at.
template <class Model, class Optimizer>
  requires train::TrainableModel<Model>
int load_training(const std::string& dir, Model& model, Optimizer& opt) {
  static_assert(checkpointable<Model>());
  read_trainer_state(dir);  // a directory that is no training checkpoint is refused before the weights are read
  read_model(dir, model);
  return load_training_state(dir, opt, layers::numel_of_table(model.param_specs(0, true)),
                             [&](const auto* whole, auto* state) { model.scatter(whole, state); });
}

}  // namespace loom::checkpoint

// A sharded checkpoint of the library's transformers written as Hugging Face's files of its family: GPT-2's as they
// are stored (their names are GPT2LMHeadModel's), Llama's and Mixtral's in transformers' names and layouts
// (models/gpt/hf.hpp). What `loom-ckpt export-hf` runs; and the whole model of a checkpoint read into memory, for
// what does not train (loom-generate).
#pragma once

#include <loom/checkpoint/sharded.hpp>
#include <loom/models/gpt/checkpoint.hpp>

#include <string>
#include <type_traits>
#include <vector>

namespace loom::checkpoint {

//! Writes the model of checkpoint `path` (ROOT or a checkpoint directory) to OUT as transformers writes its family
//! (the index's model_type): one tensor read at a time for GPT-2 (export_stored), the whole model in its stored
//! dtype for Llama and Mixtral, whose tensors are split and transposed on the way.
inline void export_hf(const std::string& path, const std::string& out) {
  const std::string dir = resolve_checkpoint(path);
  const ShardedIndex ix = read_index(dir);
  const std::string type = ix.model.value("model_type", std::string("gpt2"));
  if (type == "llama" || type == "mixtral") {  // Hugging Face's names and layouts (models/gpt/hf.hpp)
    double eps = 1e-5;
    const models::GptShape shape = llama_shape(ix.model, dir + "/index.json", &eps);
    const auto& first = ix.tensors.at("wte.weight");
    visit_dtype(first.dtype, [&](auto tag) {
      using U = typename decltype(tag)::type;
      if constexpr (std::is_floating_point_v<U> || std::is_same_v<U, bf16> || std::is_same_v<U, fp16>) {
        std::vector<U> whole(static_cast<std::size_t>(shape.params()));
        for (const auto& s : models::gpt_param_specs<U>(shape, 1, 0, {})) {
          const auto& t = ix.tensors.at(s.name);
          LOOM_CHECK(t.dtype == first.dtype, dir, " holds ", s.name, " as ", safetensors_dtype(t.dtype),
                     " and wte.weight as ", safetensors_dtype(first.dtype), ": export-hf writes one dtype");
          read_tensor(dir, ix, s.name, reinterpret_cast<char*>(whole.data() + s.offset));
        }
        write_llama(out, shape, whole, eps);
      } else {
        throw Error("loom: " + dir + " holds wte.weight as " + safetensors_dtype(first.dtype) +
                    ", not a floating-point dtype");
      }
    });
    return;
  }
  export_stored(path, out);
}

//! The whole model of checkpoint `path` (ROOT or a checkpoint directory) in the single-rank layout, converted to T,
//! with its shape and its norms' epsilon (from the index's model config): what a model that does not train reads
//! (loom-generate). A tensor missing, of another shape or of an integer dtype is refused, naming it.
template <class T>
std::vector<T> read_checkpoint_model(const std::string& path, models::GptShape& shape, double& eps) {
  const std::string dir = resolve_checkpoint(path);
  const ShardedIndex ix = read_index(dir);
  shape = config_shape(ix.model, dir + "/index.json", &eps);
  std::vector<T> whole(static_cast<std::size_t>(shape.params()));
  std::vector<char> bytes;
  for (const auto& s : models::gpt_param_specs<T>(shape, 1, 0, {})) {
    const auto it = ix.tensors.find(s.name);
    LOOM_CHECK(it != ix.tensors.end(), dir, " holds no tensor ", s.name, " of the model its index.json describes");
    const TensorIndex& t = it->second;
    LOOM_CHECK(t.shape == s.shape, dir, " holds ", s.name, " of shape ", to_string(t.shape), " but the model needs ",
               to_string(s.shape));
    const auto n = static_cast<std::size_t>(numel_of(s.shape));
    bytes.resize(n * size_of(t.dtype));
    read_tensor(dir, ix, s.name, bytes.data());
    visit_dtype(t.dtype, [&](auto tag) {
      using U = typename decltype(tag)::type;
      if constexpr (std::is_floating_point_v<U>) {
        const U* u = reinterpret_cast<const U*>(bytes.data());
        for (std::size_t i = 0; i < n; ++i) whole[std::size_t(s.offset) + i] = static_cast<T>(u[i]);
      } else if constexpr (std::is_same_v<U, bf16> || std::is_same_v<U, fp16>) {
        const U* u = reinterpret_cast<const U*>(bytes.data());
        for (std::size_t i = 0; i < n; ++i) whole[std::size_t(s.offset) + i] = static_cast<T>(static_cast<float>(u[i]));
      } else {
        throw Error("loom: " + dir + " holds " + s.name + " as " + safetensors_dtype(t.dtype) +
                    ", not a floating-point dtype");
      }
    });
  }
  return whole;
}

}  // namespace loom::checkpoint

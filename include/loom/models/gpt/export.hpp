// A sharded checkpoint of the library's transformers written as Hugging Face's files of its family: GPT-2's as they
// are stored (their names are GPT2LMHeadModel's), Llama's and Mixtral's in transformers' names and layouts
// (models/gpt/hf.hpp). What `loom-ckpt export-hf` runs.
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

}  // namespace loom::checkpoint

// A model's checkpoint as Hugging Face writes its family: GPT-2's, DIR/model.safetensors with the tensors named and
// shaped as GPT2Model's (wte.weight, h.0.attn.c_attn.weight [d, 3d], ...) and DIR/config.json with GPT2Config's
// keys; Llama's and Mixtral's as models/gpt/hf.hpp writes them. A model whose parts are no Hugging Face family's is
// written in loom's names with GPT-2's keys and its parts (loom_parts) in config.json. With them the three functions
// by which the library's checkpoints (checkpoint/training.hpp, trainer.hpp, sharded.hpp) read and write any model,
// found by argument-dependent lookup: model_config, write_model and read_model of models::GptModel.
#pragma once

#include <loom/checkpoint/safetensors.hpp>
#include <loom/models/gpt.hpp>
#include <loom/models/gpt/hf.hpp>

#include <filesystem>
#include <fstream>

namespace loom::checkpoint {

//! A shape in words, for messages: "layers 2, heads 4/2, d_model 16, d_ff 24, vocabulary 23, max_seq 32, ..."
inline std::string describe(const models::GptShape& s) {
  std::string out = "layers " + std::to_string(s.layers) + ", heads " + std::to_string(s.heads) + "/" +
                    std::to_string(s.kv_heads) + ", d_model " + std::to_string(s.d_model) + ", d_ff " +
                    std::to_string(s.ffn()) + ", vocabulary " + std::to_string(s.vocab) + ", max_seq " +
                    std::to_string(s.max_seq);
  if (s.experts > 0) out += ", " + std::to_string(s.experts) + " experts of " + std::to_string(s.expert_width()) +
                            ", top-" + std::to_string(s.top_k);
  if (s.rope()) {
    char buf[160];
    std::snprintf(buf, sizeof buf, ", rope_theta %g, rope scaling %g/%g/%g/%d", s.rope_theta, s.rope_scaling.factor,
                  s.rope_scaling.low_freq_factor, s.rope_scaling.high_freq_factor, s.rope_scaling.original_max);
    out += buf;
  }
  return out + (s.tied ? ", tied" : ", untied") + (s.bias ? ", biases" : "");
}

//! The parts of a shape that is no Hugging Face family's, as config.json's loom_parts names them.
inline nlohmann::ordered_json loom_parts(const models::GptShape& s) {
  using namespace models;
  return {{"norm", s.norm == NormKind::rms ? "rms" : "layer"},
          {"positions", s.rope() ? "rope" : "learned"},
          {"mlp", s.gated() ? "swiglu" : "gelu"},
          {"bias", s.bias},
          {"tied", s.tied},
          {"renormalize", s.renormalize},
          {"rope_theta", s.rope_theta},
          {"rope_scaling", {s.rope_scaling.factor, s.rope_scaling.low_freq_factor, s.rope_scaling.high_freq_factor,
                            s.rope_scaling.original_max}}};
}

//! config.json of a model's shape: a Llama's or Mixtral's with transformers' keys (llama_config), else GPT2Config's
//! (n_kv_head only where it differs from n_head), with loom_parts where the parts are not GPT-2's.
inline nlohmann::ordered_json gpt_config(const models::GptShape& s, double ln_eps = 1e-5) {
  const HfFamily family = hf_family(s);
  if (family == HfFamily::llama || family == HfFamily::mixtral) return llama_config(s, ln_eps);
  nlohmann::ordered_json c = {{"model_type", "gpt2"},         {"architectures", {"GPT2LMHeadModel"}},
                              {"n_layer", s.layers},          {"n_head", s.heads},
                              {"n_embd", s.d_model},          {"n_positions", s.max_seq},
                              {"n_ctx", s.max_seq},           {"vocab_size", s.vocab},
                              {"layer_norm_epsilon", ln_eps}, {"activation_function", "gelu_new"},
                              {"tie_word_embeddings", true}};
  if (s.kv_heads != s.heads) c["n_kv_head"] = s.kv_heads;
  if (s.ffn() != 4 * s.d_model) c["n_inner"] = s.ffn();
  if (s.experts > 0) {  // a mixture of experts, in Mixtral's and DeepSeek's names
    c["num_local_experts"] = s.experts, c["num_experts_per_tok"] = s.top_k, c["moe_layer_freq"] = s.moe_every;
    c["moe_intermediate_size"] = s.expert_width(), c["n_shared_experts"] = s.shared_experts;
  }
  if (family == HfFamily::none) c["model_type"] = "loom", c["architectures"] = {"loom"}, c["loom_parts"] = loom_parts(s);
  return c;
}

//! Writes DIR/model.safetensors and DIR/config.json from the whole model's parameters in the single-rank layout,
//! each file under a temporary name that is then renamed.
template <class T>
void write_gpt(const std::string& dir, const models::GptShape& shape, const std::vector<T>& whole, double ln_eps) {
  const HfFamily family = hf_family(shape);
  if (family == HfFamily::llama || family == HfFamily::mixtral) return write_llama(dir, shape, whole, ln_eps);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error("loom: cannot create the directory " + dir + ": " + ec.message());
  std::vector<std::pair<std::string, StoredTensor>> tensors;
  for (const auto& s : models::gpt_param_specs<T>(shape, 1, 0, {})) {
    StoredTensor t;
    t.dtype = dtype_of<T>;
    t.shape = s.shape;
    t.data = whole.data() + s.offset;
    t.byte_count = static_cast<std::size_t>(numel_of(s.shape)) * sizeof(T);
    tensors.emplace_back(s.name, std::move(t));
  }
  write_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  const std::string cfg = dir + "/config.json", tmp = cfg + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << gpt_config(shape, ln_eps).dump(2) << "\n";
    if (!f) throw Error("loom: writing " + tmp + " failed");
  }
  std::filesystem::rename(tmp, cfg, ec);
  if (ec) throw Error("loom: cannot rename " + tmp + " to " + cfg + ": " + ec.message());
}

//! Writes the model's checkpoint (write_gpt), whatever its layout: a collective over the model's tensor-parallel
//! group, where only the ranks with `write` write.
template <class T, class Cfg, class Dev>
void save_gpt(const std::string& dir, models::GptModel<T, Cfg, Dev>& model, bool write = true) {
  const auto whole = model.gather(model.params().data());
  if (write) write_gpt(dir, model.shape(), whole, model.options().ln_eps);
}

//! Reads DIR into model, each rank taking its part. The shape in DIR/config.json must be the model's (a key that is
//! missing or not an integer is an error naming it); every parameter must be present with its shape, in a
//! floating-point dtype (converted to T; an integer tensor is refused). Names may carry Hugging Face's
//! "transformer." prefix.
template <class T, class Cfg, class Dev>
void load_gpt(const std::string& dir, models::GptModel<T, Cfg, Dev>& model) {
  const models::GptShape& S = model.shape();
  const std::string cfg_file = dir + "/config.json";
  const HfFamily family = hf_family(S);
  const nlohmann::json c = read_config(cfg_file);
  using loom::detail::cat;
  const std::string type = c.value("model_type", std::string("gpt2"));
  if (type != hf_model_type(family))
    throw Error(cat("loom: ", cfg_file, " has model_type '", type, "' but the model is ", hf_model_type(family),
                    "'s (its parts: ", loom_parts(S).dump(), ")"));
  if (family == HfFamily::llama || family == HfFamily::mixtral) {
    const models::GptShape file = llama_shape(c, cfg_file);
    if (!(file == S)) throw Error(cat("loom: ", cfg_file, " describes ", describe(file), " but the model is ",
                                      describe(S)));
    model.scatter(read_llama<T>(dir, S).data(), model.params().data());
    return;
  }
  if (family == HfFamily::none && (!c.contains("loom_parts") || c["loom_parts"] != nlohmann::json(loom_parts(S))))
    throw Error(cat("loom: ", cfg_file, " has loom_parts ", c.value("loom_parts", nlohmann::json()).dump(),
                    " but the model's are ", loom_parts(S).dump()));
  // Each key must hold the model's value, as an integer. n_kv_head may be missing (GPT-2 has none: n_head) and
  // n_inner missing or null (GPT-2's 4 n_embd).
  auto expect = [&](const char* key, int value) {
    if (!c.contains(key))
      throw Error(cat("loom: ", cfg_file, " has no ", key, " (the model has ", key, " = ", value, ")"));
    const auto& j = c[key];
    if (!j.is_number_integer())
      throw Error(cat("loom: ", cfg_file, " has ", key, " = ", j.dump(), ", which is not an integer (the model has ",
                      key, " = ", value, ")"));
    const bool same = j.is_number_unsigned() ? j.get<std::uint64_t>() == static_cast<std::uint64_t>(value)
                                             : j.get<std::int64_t>() == value;
    if (!same) throw Error(cat("loom: ", cfg_file, " has ", key, " = ", j.dump(), " but the model has ", value));
  };
  expect("n_layer", S.layers);
  expect("n_head", S.heads);
  expect("n_embd", S.d_model);
  expect("n_positions", S.max_seq);
  expect("vocab_size", S.vocab);
  if (S.experts > 0) {
    expect("num_local_experts", S.experts);
    expect("num_experts_per_tok", S.top_k);
    expect("moe_layer_freq", S.moe_every);
    expect("moe_intermediate_size", S.expert_width());
    expect("n_shared_experts", S.shared_experts);
  } else if (c.contains("num_local_experts")) {
    throw Error(cat("loom: ", cfg_file, " has num_local_experts = ", c["num_local_experts"].dump(),
                    " but the model has no experts"));
  }
  if (c.contains("n_kv_head")) expect("n_kv_head", S.kv_heads);
  else if (S.kv_heads != S.heads)
    throw Error(cat("loom: ", cfg_file, " has no n_kv_head (so n_kv_head = n_head = ", S.heads,
                    ") but the model has n_kv_head = ", S.kv_heads));
  if (c.contains("n_inner") && !c["n_inner"].is_null()) expect("n_inner", S.ffn());
  else if (S.ffn() != 4 * S.d_model)
    throw Error(cat("loom: ", cfg_file, " has no n_inner (so n_inner = 4 n_embd = ", 4 * S.d_model,
                    ") but the model has n_inner = ", S.ffn()));
  auto stored = read_safetensors(dir + "/model.safetensors");
  const auto global = model.param_specs(0, true);
  std::vector<T> whole(static_cast<std::size_t>(S.params()));
  for (const auto& s : global) {
    auto it = stored.find(s.name);
    if (it == stored.end()) it = stored.find("transformer." + s.name);
    if (it == stored.end()) throw Error("loom: " + dir + "/model.safetensors has no tensor " + s.name);
    const StoredTensor& t = it->second;
    if (!is_floating(t.dtype))
      throw Error("loom: " + dir + "/model.safetensors: tensor '" + it->first + "' has dtype " +
                  safetensors_dtype(t.dtype) + ", an integer dtype, where the model reads floating-point weights " +
                  "into " + safetensors_dtype(dtype_of<T>));
    if (t.shape != s.shape)
      throw Error("loom: " + dir + "/model.safetensors: " + s.name + " has shape " + to_string(t.shape) +
                  " but the model needs " + to_string(s.shape));
    read_floats(t, whole.data() + s.offset, static_cast<std::size_t>(numel_of(s.shape)));
  }
  model.scatter(whole.data(), model.params().data());
}

}  // namespace loom::checkpoint

namespace loom::models {

//! What a checkpoint records of the model: config.json's keys (checkpoint::gpt_config).
template <class T, class Cfg, class Dev>
nlohmann::ordered_json model_config(const GptModel<T, Cfg, Dev>& model) {
  return checkpoint::gpt_config(model.shape(), model.options().ln_eps);
}
//! Writes the whole model's parameters (in the single-rank layout) as DIR/model.safetensors and DIR/config.json in
//! its family's Hugging Face names (checkpoint::write_gpt).
template <class T, class Cfg, class Dev>
void write_model(const std::string& dir, const GptModel<T, Cfg, Dev>& model, const std::vector<T>& whole) {
  checkpoint::write_gpt(dir, model.shape(), whole, model.options().ln_eps);
}
//! Reads DIR's parameters into the model, each rank its part (checkpoint::load_gpt).
template <class T, class Cfg, class Dev>
void read_model(const std::string& dir, GptModel<T, Cfg, Dev>& model) {
  checkpoint::load_gpt(dir, model);
}

}  // namespace loom::models

// Hugging Face's files for the Llama and Mixtral families (LlamaForCausalLM, MixtralForCausalLM): config.json with
// transformers' keys (rope_scaling included) and the tensors under their names and layouts (nn.Linear weights are
// [out, in], loom's are [in, out]; q, k and v are three tensors where loom fuses them, as are SwiGLU's gate and up
// projections), in one model.safetensors or in shards listed by model.safetensors.index.json. GPT-2's files are
// models/gpt/checkpoint.hpp's; write_gpt and load_gpt there take every family.
#pragma once

#include <loom/checkpoint/safetensors.hpp>
#include <loom/models/gpt/param_table.hpp>
#include <loom/models/gpt/shape.hpp>

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace loom::checkpoint {

//! The Hugging Face architecture a shape is: GPT-2 (GPT-2's parts), Llama (Llama 3's parts, dense), Mixtral (Llama's
//! parts with a mixture of experts in every block and no shared experts); any other mix of parts has none.
enum class HfFamily { gpt2, llama, mixtral, none };

inline HfFamily hf_family(const models::GptShape& s) {
  using namespace models;
  // GPT-2's parts, without what GPT2LMHeadModel does not have (experts, fewer key/value heads): transformers would
  // load such a model as a dense GPT-2, its experts ignored, so it is loom's own ("loom").
  if (s.norm == NormKind::layer && s.positions == PositionKind::learned && s.mlp == MlpKind::gelu && s.bias &&
      s.tied && s.experts == 0 && s.kv_heads == s.heads)
    return HfFamily::gpt2;
  const bool llama_parts = s.norm == NormKind::rms && s.positions == PositionKind::rope && s.mlp == MlpKind::swiglu;
  if (llama_parts && s.experts == 0) return HfFamily::llama;
  if (llama_parts && !s.bias && s.moe_every == 1 && s.shared_experts == 0 && s.renormalize) return HfFamily::mixtral;
  return HfFamily::none;
}

//! "gpt2", "llama", "mixtral": model_type in config.json.
inline const char* hf_model_type(HfFamily f) {
  return f == HfFamily::gpt2 ? "gpt2" : f == HfFamily::llama ? "llama" : f == HfFamily::mixtral ? "mixtral" : "loom";
}

//! config.json of a Llama or Mixtral shape, norm epsilon eps, parameters stored as `dtype`.
inline nlohmann::ordered_json llama_config(const models::GptShape& s, double eps, DType dtype = DType::f32) {
  const HfFamily f = hf_family(s);
  const bool moe = f == HfFamily::mixtral;
  nlohmann::ordered_json c = {
      {"model_type", hf_model_type(f)},
      {"architectures", {moe ? "MixtralForCausalLM" : "LlamaForCausalLM"}},
      {"vocab_size", s.vocab},
      {"hidden_size", s.d_model},
      {"intermediate_size", moe ? s.expert_width() : s.ffn()},
      {"num_hidden_layers", s.layers},
      {"num_attention_heads", s.heads},
      {"num_key_value_heads", s.kv_heads},
      {"head_dim", s.head_dim()},
      {"max_position_embeddings", s.max_seq},
      {"rms_norm_eps", eps},
      {"rope_theta", s.rope_theta},
      {"hidden_act", "silu"},
      {"tie_word_embeddings", s.tied},
      {"torch_dtype", dtype == DType::f64 ? "float64" : dtype == DType::bf16 ? "bfloat16"
                      : dtype == DType::f16 ? "float16" : "float32"}};
  if (s.rope_scaling.factor != 0)
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", s.rope_scaling.factor},
                         {"low_freq_factor", s.rope_scaling.low_freq_factor},
                         {"high_freq_factor", s.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", s.rope_scaling.original_max}};
  else
    c["rope_scaling"] = nullptr;
  if (moe) {
    c["num_local_experts"] = s.experts, c["num_experts_per_tok"] = s.top_k;
    c["router_aux_loss_coef"] = 0.0, c["output_router_logits"] = false, c["sliding_window"] = nullptr;
  } else {
    c["attention_bias"] = s.bias, c["mlp_bias"] = s.bias;
  }
  return c;
}

namespace detail {

inline const nlohmann::json& hf_key(const nlohmann::json& c, const std::string& file, const char* key) {
  if (!c.contains(key)) throw Error("loom: " + file + " has no " + key);
  return c[key];
}
inline int hf_int(const nlohmann::json& c, const std::string& file, const char* key) {
  const auto& j = hf_key(c, file, key);
  if (!j.is_number_integer()) throw Error("loom: " + file + " has " + key + " = " + j.dump() + ", not an integer");
  return j.get<int>();
}
inline double hf_number(const nlohmann::json& c, const std::string& file, const char* key) {
  const auto& j = hf_key(c, file, key);
  if (!j.is_number()) throw Error("loom: " + file + " has " + key + " = " + j.dump() + ", not a number");
  return j.get<double>();
}

}  // namespace detail

//! A config.json, parsed; an error names the file when it cannot be opened, is not JSON or not an object.
inline nlohmann::json read_config(const std::string& file) {
  std::ifstream in(file);
  if (!in) throw Error("loom: cannot open " + file);
  nlohmann::json c;
  try {
    c = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw Error("loom: " + file + " is not valid JSON: " + e.what());
  }
  if (!c.is_object()) throw Error("loom: " + file + " is not a JSON object");
  return c;
}

//! A stored tensor's n elements as T (any floating-point dtype, converted through double), into dst.
template <class T>
void read_floats(const StoredTensor& t, T* dst, std::size_t n) {
  visit_dtype(t.dtype, [&](auto tag) {
    using U = typename decltype(tag)::type;
    std::vector<U> src(n);
    std::memcpy(src.data(), t.bytes.data(), n * sizeof(U));
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<double>(src[i]));
  });
}

//! The shape (and, in eps, the norm's epsilon) a Llama or Mixtral config.json describes; an error names what it
//! lacks or what loom does not build (another model_type, another rope_type, a head_dim other than hidden_size /
//! num_attention_heads, different attention and MLP biases).
inline models::GptShape llama_shape(const nlohmann::json& c, const std::string& file, double* eps = nullptr) {
  using detail::hf_int, detail::hf_number;
  const std::string type = c.value("model_type", std::string());
  if (type != "llama" && type != "mixtral")
    throw Error("loom: " + file + " has model_type '" + type + "'; loom reads llama, mixtral and gpt2");
  models::GptShape s{hf_int(c, file, "num_hidden_layers"),   hf_int(c, file, "num_attention_heads"),
                     c.contains("num_key_value_heads") && !c["num_key_value_heads"].is_null()
                         ? hf_int(c, file, "num_key_value_heads")
                         : hf_int(c, file, "num_attention_heads"),
                     hf_int(c, file, "hidden_size"),         hf_int(c, file, "vocab_size"),
                     hf_int(c, file, "max_position_embeddings"), hf_int(c, file, "intermediate_size")};
  const double theta = c.contains("rope_theta") ? hf_number(c, file, "rope_theta") : 10000.0;
  models::RopeScaling scaling{};
  if (c.contains("rope_scaling") && !c["rope_scaling"].is_null()) {
    const auto& r = c["rope_scaling"];
    const std::string kind = r.value("rope_type", r.value("type", std::string()));
    if (kind != "llama3" && kind != "default")
      throw Error("loom: " + file + " has rope_scaling of rope_type '" + kind + "'; loom reads llama3 and default");
    if (kind == "llama3")
      scaling = {hf_number(r, file, "factor"), hf_number(r, file, "low_freq_factor"),
                 hf_number(r, file, "high_freq_factor"), hf_int(r, file, "original_max_position_embeddings")};
  }
  s = models::llama3_spec(s, theta, scaling);
  s.tied = c.value("tie_word_embeddings", false);
  if (type == "mixtral") {
    s.experts = hf_int(c, file, "num_local_experts"), s.top_k = hf_int(c, file, "num_experts_per_tok");
    s.expert_ff = s.d_ff, s.moe_every = 1;
  } else {
    const bool attn = c.value("attention_bias", false), mlp = c.value("mlp_bias", false);
    if (attn != mlp)
      throw Error("loom: " + file + " has attention_bias = " + (attn ? "true" : "false") + " and mlp_bias = " +
                  (mlp ? "true" : "false") + "; loom's blocks have biases on both or neither");
    s.bias = attn;
  }
  if (c.contains("head_dim") && !c["head_dim"].is_null() && hf_int(c, file, "head_dim") * s.heads != s.d_model)
    throw Error("loom: " + file + " has head_dim = " + c["head_dim"].dump() + " but hidden_size / num_attention_heads = " +
                std::to_string(s.d_model / s.heads) + "; loom's heads are hidden_size / num_attention_heads wide");
  const std::string act = c.value("hidden_act", std::string("silu"));
  if (act != "silu") throw Error("loom: " + file + " has hidden_act '" + act + "'; loom's SwiGLU is silu's");
  if (eps) *eps = c.contains("rms_norm_eps") ? hf_number(c, file, "rms_norm_eps") : 1e-6;
  return s;
}

//! The shape a config.json's keys describe (model_type llama, mixtral or gpt2, or loom for a model of parts no
//! Hugging Face family has; read from `file`, which messages name), and in eps its norms' epsilon.
inline models::GptShape config_shape(const nlohmann::json& c, const std::string& file, double* eps = nullptr) {
  const std::string type = c.value("model_type", std::string());
  if (type != "gpt2" && type != "loom") return llama_shape(c, file, eps);
  using detail::hf_int;
  const int d = hf_int(c, file, "n_embd");
  models::GptShape s{hf_int(c, file, "n_layer"), hf_int(c, file, "n_head"),
                     c.contains("n_kv_head") ? hf_int(c, file, "n_kv_head") : hf_int(c, file, "n_head"), d,
                     hf_int(c, file, "vocab_size"), hf_int(c, file, "n_positions"),
                     c.contains("n_inner") && !c["n_inner"].is_null() ? hf_int(c, file, "n_inner") : 4 * d};
  if (c.contains("num_local_experts")) {  // loom's GPT with a mixture of experts (checkpoint::gpt_config)
    s.experts = hf_int(c, file, "num_local_experts"), s.top_k = hf_int(c, file, "num_experts_per_tok");
    s.moe_every = hf_int(c, file, "moe_layer_freq"), s.expert_ff = hf_int(c, file, "moe_intermediate_size");
    s.shared_experts = hf_int(c, file, "n_shared_experts");
  }
  if (type == "loom") {  // the parts of a model no Hugging Face family has (checkpoint::loom_parts)
    const auto& p = detail::hf_key(c, file, "loom_parts");
    auto is = [&](const char* key, const char* value) {
      const auto& v = detail::hf_key(p, file + ": loom_parts", key);
      return v.is_string() && v.get<std::string>() == value;
    };
    auto flag = [&](const char* key) {
      const auto& v = detail::hf_key(p, file + ": loom_parts", key);
      if (!v.is_boolean()) throw Error("loom: " + file + ": loom_parts." + key + " = " + v.dump() + ", not a boolean");
      return v.get<bool>();
    };
    using namespace models;
    s.norm = is("norm", "rms") ? NormKind::rms : NormKind::layer;
    s.positions = is("positions", "rope") ? PositionKind::rope : PositionKind::learned;
    s.mlp = is("mlp", "swiglu") ? MlpKind::swiglu : MlpKind::gelu;
    s.bias = flag("bias"), s.tied = flag("tied"), s.renormalize = flag("renormalize");
    s.rope_theta = detail::hf_number(p, file + ": loom_parts", "rope_theta");
    const auto& r = detail::hf_key(p, file + ": loom_parts", "rope_scaling");
    if (!r.is_array() || r.size() != 4)
      throw Error("loom: " + file + ": loom_parts.rope_scaling = " + r.dump() + ", not [factor, low, high, original]");
    s.rope_scaling = {r[0].get<double>(), r[1].get<double>(), r[2].get<double>(), r[3].get<int>()};
  }
  if (eps) *eps = c.contains("layer_norm_epsilon") ? detail::hf_number(c, file, "layer_norm_epsilon") : 1e-5;
  return s;
}

//! Whether DIR is a Hugging Face model directory (config.json and model.safetensors, or its shards' index), not a
//! loom checkpoint.
inline bool hugging_face_dir(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::exists(dir + "/config.json", ec) &&
         (std::filesystem::exists(dir + "/model.safetensors", ec) ||
          std::filesystem::exists(dir + "/model.safetensors.index.json", ec));
}

//! The shape of the model in a Hugging Face directory (DIR/config.json of model_type llama, mixtral or gpt2), and in
//! eps its norms' epsilon.
inline models::GptShape hf_shape(const std::string& dir, double* eps = nullptr) {
  const std::string file = dir + "/config.json";
  return config_shape(read_config(file), file, eps);
}

//! One Hugging Face tensor's share of a loom parameter: its rows (transposed: its columns) fill `extent` of the loom
//! parameter's last dimension (transposed) or first (not) from `offset`; a vector fills elements [offset, offset +
//! extent).
struct HfPiece {
  std::string name;
  bool transposed;
  std::int64_t offset, extent;
};

//! The Hugging Face tensors that make loom's parameter `name` in a Llama or Mixtral model of shape s.
inline std::vector<HfPiece> hf_pieces(const models::GptShape& s, const std::string& name) {
  auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  const std::int64_t hd = s.head_dim(), q = s.heads * hd, kv = s.kv_heads * hd;
  if (name == "wte.weight") return {{"model.embed_tokens.weight", false, 0, s.vocab}};
  if (name == "ln_f.weight") return {{"model.norm.weight", false, 0, s.d_model}};
  if (name == "lm_head.weight") return {{"lm_head.weight", false, 0, s.vocab}};
  if (name.compare(0, 2, "h.") != 0) throw Error("loom: no Hugging Face tensor holds " + name);
  const auto dot = name.find('.', 2);
  const std::string layer = "model.layers." + name.substr(2, dot - 2) + ".", rest = name.substr(dot + 1);
  const bool w = ends_with(".weight");
  const std::string kind = w ? ".weight" : ".bias";
  if (rest == "ln_1.weight") return {{layer + "input_layernorm.weight", false, 0, s.d_model}};
  if (rest == "ln_2.weight") return {{layer + "post_attention_layernorm.weight", false, 0, s.d_model}};
  const std::string a = layer + "self_attn.";
  if (rest == "attn.c_attn" + kind)
    return {{a + "q_proj" + kind, w, 0, q}, {a + "k_proj" + kind, w, q, kv}, {a + "v_proj" + kind, w, q + kv, kv}};
  if (rest == "attn.c_proj" + kind) return {{a + "o_proj" + kind, w, 0, s.d_model}};
  const std::int64_t f = s.ffn();
  if (rest == "mlp.c_fc" + kind)
    return {{layer + "mlp.gate_proj" + kind, w, 0, f}, {layer + "mlp.up_proj" + kind, w, f, f}};
  if (rest == "mlp.c_proj" + kind) return {{layer + "mlp.down_proj" + kind, w, 0, s.d_model}};
  const std::string m = layer + "block_sparse_moe.";
  if (rest == "mlp.router.weight") return {{m + "gate.weight", true, 0, s.experts}};
  const std::string e = "mlp.experts.";
  if (rest.compare(0, e.size(), e) == 0 && w) {
    const auto at = rest.find('.', e.size());
    const std::string x = m + "experts." + rest.substr(e.size(), at - e.size()) + ".", part = rest.substr(at + 1);
    const std::int64_t fe = s.expert_width();
    if (part == "c_fc.weight") return {{x + "w1.weight", true, 0, fe}, {x + "w3.weight", true, fe, fe}};
    if (part == "c_proj.weight") return {{x + "w2.weight", true, 0, s.d_model}};
  }
  throw Error("loom: no Hugging Face tensor of " + std::string(s.experts ? "Mixtral" : "Llama") + " holds " + name);
}

//! The shape of a piece as Hugging Face stores it, for loom's parameter of shape `loom`.
inline std::vector<std::int64_t> hf_piece_shape(const HfPiece& p, const Shape& loom) {
  if (loom.size() == 1) return {p.extent};
  return p.transposed ? std::vector<std::int64_t>{p.extent, loom[0]} : std::vector<std::int64_t>{p.extent, loom[1]};
}

//! Copies between a loom parameter (`whole`, of shape `loom`, row-major) and a piece's tensor (`hf`), in either
//! direction (to_loom).
template <class T>
void hf_copy(const HfPiece& p, const Shape& loom, T* whole, T* hf, bool to_loom) {
  auto move = [&](std::int64_t li, std::int64_t hi) {
    if (to_loom) whole[li] = hf[hi];
    else hf[hi] = whole[li];
  };
  if (loom.size() == 1) {
    for (std::int64_t j = 0; j < p.extent; ++j) move(p.offset + j, j);
    return;
  }
  const std::int64_t rows = loom[0], cols = loom[1];
  if (p.transposed) {  // hf [extent, rows]: loom[i, offset + j] = hf[j, i]
    for (std::int64_t j = 0; j < p.extent; ++j)
      for (std::int64_t i = 0; i < rows; ++i) move(i * cols + p.offset + j, j * rows + i);
  } else {  // hf [extent, cols]: loom[offset + i, :] = hf[i, :]
    for (std::int64_t i = 0; i < p.extent; ++i)
      for (std::int64_t j = 0; j < cols; ++j) move((p.offset + i) * cols + j, i * cols + j);
  }
}

//! The tensors of a Llama or Mixtral model from its whole parameters in loom's single-rank layout, in Hugging Face's
//! names and layouts, in the order loom's parameters are declared.
template <class T>
std::vector<std::pair<std::string, std::vector<T>>> hf_tensors(const models::GptShape& s, const std::vector<T>& whole,
                                                               std::vector<std::vector<std::int64_t>>* shapes) {
  std::vector<std::pair<std::string, std::vector<T>>> out;
  for (const auto& spec : models::gpt_param_specs<T>(s, 1, 0, {})) {
    for (const auto& p : hf_pieces(s, spec.name)) {
      const auto shape = hf_piece_shape(p, spec.shape);
      std::vector<T> t(static_cast<std::size_t>(numel_of(shape)));
      hf_copy(p, spec.shape, const_cast<T*>(whole.data()) + spec.offset, t.data(), false);
      out.emplace_back(p.name, std::move(t));
      if (shapes) shapes->push_back(shape);
    }
  }
  return out;
}

//! Writes a Llama or Mixtral model as Hugging Face does: DIR/config.json and the tensors in DIR/model.safetensors,
//! or, past max_shard_bytes, in DIR/model-0000k-of-0000n.safetensors listed by DIR/model.safetensors.index.json;
//! every file under a temporary name that is then renamed.
template <class T>
void write_llama(const std::string& dir, const models::GptShape& s, const std::vector<T>& whole, double eps,
                 std::size_t max_shard_bytes = std::size_t{5} << 30) {
  const HfFamily f = hf_family(s);
  LOOM_CHECK(f == HfFamily::llama || f == HfFamily::mixtral, "this model's parts are neither Llama's nor Mixtral's "
             "(", s.experts > 0 && s.shared_experts > 0 ? "shared experts have no place in Mixtral's files" : "a "
             "spec of its own", "): it has no Hugging Face architecture to be written as");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error("loom: cannot create the directory " + dir + ": " + ec.message());
  std::vector<std::vector<std::int64_t>> shapes;
  const auto tensors = hf_tensors(s, whole, &shapes);
  // Shards of at most max_shard_bytes each (a tensor larger than that alone in its own).
  std::vector<std::vector<std::size_t>> shards(1);
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::size_t b = tensors[i].second.size() * sizeof(T);
    if (!shards.back().empty() && bytes + b > max_shard_bytes) shards.emplace_back(), bytes = 0;
    shards.back().push_back(i), bytes += b;
  }
  auto write_text = [&](const std::string& file, const std::string& text) {
    const std::string tmp = file + ".tmp";
    {
      std::ofstream o(tmp, std::ios::trunc);
      o << text << "\n";
      if (!o) throw Error("loom: writing " + tmp + " failed");
    }
    std::filesystem::rename(tmp, file, ec);
    if (ec) throw Error("loom: cannot rename " + tmp + " to " + file + ": " + ec.message());
  };
  nlohmann::ordered_json map;
  for (std::size_t k = 0; k < shards.size(); ++k) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    const std::string file = shards.size() == 1 ? "model.safetensors" : name;
    std::vector<std::pair<std::string, StoredTensor>> out;
    for (std::size_t i : shards[k]) {
      StoredTensor t;
      t.dtype = dtype_of<T>;
      t.shape = shapes[i];
      t.data = tensors[i].second.data();
      t.byte_count = tensors[i].second.size() * sizeof(T);
      out.emplace_back(tensors[i].first, std::move(t));
      map[tensors[i].first] = file;
    }
    write_safetensors(dir + "/" + file, out, {{"format", "pt"}});
  }
  if (shards.size() > 1) {
    std::size_t total = 0;
    for (const auto& t : tensors) total += t.second.size() * sizeof(T);
    const nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
    write_text(dir + "/model.safetensors.index.json", index.dump(2));
  }
  write_text(dir + "/config.json", llama_config(s, eps, dtype_of<T>).dump(2));
}

//! Every tensor of a Hugging Face directory: DIR/model.safetensors, or the shards DIR/model.safetensors.index.json
//! lists.
inline std::map<std::string, StoredTensor> read_hf_tensors(const std::string& dir) {
  const std::string index = dir + "/model.safetensors.index.json";
  if (!std::filesystem::exists(dir + "/model.safetensors") && std::filesystem::exists(index)) {
    std::ifstream in(index);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(in);
    } catch (const std::exception& e) {
      throw Error("loom: " + index + " is not valid JSON: " + e.what());
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw Error("loom: " + index + " has no weight_map object");
    std::map<std::string, std::string> files;
    for (const auto& [name, file] : j["weight_map"].items()) files[file.get<std::string>()] = name;
    std::map<std::string, StoredTensor> all;
    for (const auto& [file, any] : files) all.merge(read_safetensors(dir + "/" + file));
    return all;
  }
  return read_safetensors(dir + "/model.safetensors");
}

//! The whole parameters, in loom's single-rank layout as T, of a Llama or Mixtral model of shape s from the tensors
//! of a Hugging Face directory: each must be there with its shape, in a floating-point dtype; a tied model may lack
//! lm_head.weight.
template <class T>
std::vector<T> read_llama(const std::string& dir, const models::GptShape& s) {
  const auto stored = read_hf_tensors(dir);
  std::vector<T> whole(static_cast<std::size_t>(s.params()));
  for (const auto& spec : models::gpt_param_specs<T>(s, 1, 0, {})) {
    for (const auto& p : hf_pieces(s, spec.name)) {
      const auto it = stored.find(p.name);
      if (it == stored.end()) throw Error("loom: " + dir + " has no tensor " + p.name);
      const StoredTensor& t = it->second;
      const auto shape = hf_piece_shape(p, spec.shape);
      if (!is_floating(t.dtype))
        throw Error("loom: " + dir + ": tensor '" + p.name + "' has dtype " + safetensors_dtype(t.dtype) +
                    ", where the model reads floating-point weights");
      if (t.shape != shape)
        throw Error("loom: " + dir + ": " + p.name + " has shape " + to_string(t.shape) + " but the model needs " +
                    to_string(shape));
      std::vector<T> hf(static_cast<std::size_t>(numel_of(shape)));
      read_floats(t, hf.data(), hf.size());
      hf_copy(p, spec.shape, whole.data() + spec.offset, hf.data(), true);
    }
  }
  return whole;
}

}  // namespace loom::checkpoint

// The model families against Hugging Face transformers (tests/hf_reference.py, in the virtual environment that
// scripts/install-deps makes): for random small Llama (grouped-query attention, RoPE with Llama 3's scaling, an untied
// output layer), Mixtral (top-2 of 4 SwiGLU experts) and GPT-2 models made by transformers, loom imports the weights
// from their Hugging Face directory and matches the logits, the loss and the gradient of every parameter after one
// backward, and the parameters after 3 AdamW steps; then exports its model, which transformers' from_pretrained
// loads and computes the same logits from. Double precision throughout: transformers' float32 spots (RMSNorm's
// statistics, the rotary tables, Mixtral's router softmax) are computed in double by the reference script, with
// the same formulas. Greedy decoding with the key/value cache gives the tokens of transformers' greedy loop over its
// forward, from the logits it chose them from. Exits 77 (skipped) where the environment is missing.
#include <loom/models/gpt/checkpoint.hpp>
#include <loom/models/gpt.hpp>
#include <loom/models/gpt/generate.hpp>
#include <loom/optim/optimizers.hpp>

#include "temp_dir.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#ifndef LOOM_SOURCE_DIR
#define LOOM_SOURCE_DIR "."
#endif
#ifndef LOOM_HF_PYTHON
#define LOOM_HF_PYTHON "python3"
#endif

using namespace loom;

namespace {

const double tolerance = 1e-9;
int failures = 0;

//! The largest difference of `mine` from `theirs`, relative to theirs' largest magnitude; a failure past tolerance.
double compare(const std::string& what, const std::vector<double>& mine, const nlohmann::json& theirs) {
  if (mine.size() != theirs.size()) {
    std::fprintf(stderr, "FAILED %s: %zu values, transformers has %zu\n", what.c_str(), mine.size(), theirs.size());
    ++failures;
    return 1;
  }
  double scale = 1e-300, worst = 0;
  for (const auto& v : theirs) scale = std::max(scale, std::abs(v.get<double>()));
  std::size_t at = 0;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const double e = std::abs(mine[i] - theirs[i].get<double>()) / scale;
    if (e > worst) worst = e, at = i;
  }
  if (worst > tolerance) {
    std::fprintf(stderr, "FAILED %s: element %zu is %.17g, transformers %.17g (difference %.3g of the largest)\n",
                 what.c_str(), at, mine[at], theirs[at].get<double>(), worst);
    ++failures;
  }
  return worst;
}

int run(const std::string& command) {
  const int rc = std::system(command.c_str());
  if (rc != 0) std::fprintf(stderr, "FAILED: %s (status %d)\n", command.c_str(), rc);
  return rc;
}

//! Loom's values of each Hugging Face tensor of the whole model's buffer `whole` (loom's single-rank layout).
std::map<std::string, std::vector<double>> as_hf(const models::GptShape& s, std::vector<double> whole) {
  std::map<std::string, std::vector<double>> out;
  if (checkpoint::hf_family(s) == checkpoint::HfFamily::gpt2) {
    for (const auto& spec : models::gpt_param_specs<double>(s, 1, 0, {}))
      out["transformer." + spec.name] = std::vector<double>(whole.begin() + spec.offset,
                                                            whole.begin() + spec.offset + numel_of(spec.shape));
    return out;
  }
  for (auto& [name, t] : checkpoint::hf_tensors(s, whole, nullptr)) out[name] = std::move(t);
  return out;
}

const std::string script = std::string(LOOM_HF_PYTHON) + " " + LOOM_SOURCE_DIR + "/tests/hf_reference.py";
const int B = 2, T = 7, vocab = 23;
const double lr = 1e-2, wd = 0.1;

//! The batch every model trains on, with the optimizer's hyper-parameters.
nlohmann::json batch() {
  std::vector<std::int32_t> ids, targets;
  for (int i = 0; i < B * T; ++i) ids.push_back((i * 7 + 3) % vocab), targets.push_back((i * 5 + 1) % vocab);
  return {{"B", B},  {"T", T},   {"vocab", vocab},         {"ids", ids}, {"targets", targets}, {"lr", lr},
          {"weight_decay", wd}, {"seed", 7}, {"prompt", {4, 19, 2, 11, 7}}, {"new_tokens", 24}};
}

//! Loom's run of the model transformers made in `dir` (reference.json): the comparisons; its trained model exported
//! to `out`, whose logits transformers computes afterwards (compare_export).
std::vector<double> check_family(const std::string& family, const std::string& dir, const std::string& out) {
  const auto b = batch();
  const auto ids = b["ids"].get<std::vector<std::int32_t>>(), targets = b["targets"].get<std::vector<std::int32_t>>();
  const auto ref = nlohmann::json::parse(std::ifstream(dir + "/reference.json"));

  // The shape from transformers' config.json, as train_gpt --init-from reads it.
  const auto config = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
  double eps = 1e-5;
  const models::GptShape shape =
      family == "gpt2" ? models::GptShape{2, 4, 4, 16, vocab, 32} : checkpoint::llama_shape(config, "config.json", &eps);
  models::GptOptions opts;
  opts.ln_eps = eps;
  opts.moe.capacity_factor = 0, opts.moe.aux_loss_coeff = 0;  // Mixtral routes every token (dropless)
  models::GptModel<double> m(shape, 1, opts);
  checkpoint::load_gpt(dir, m);

  // Greedy decoding with the cache (models::GptDecoder) against transformers' greedy loop over its forward.
  const auto prompt = b["prompt"].get<std::vector<std::int32_t>>();
  const auto greedy = ref["greedy"].get<std::vector<std::int32_t>>();
  models::GptDecoder<double> dec(m);
  const auto generated = dec.generate(prompt, b["new_tokens"].get<int>(), {});
  if (generated != greedy) std::fprintf(stderr, "FAILED %s: greedy generation differs from transformers'\n",
                                        family.c_str()), ++failures;
  double dgreedy = 0;
  dec.reset();
  std::span<const double> from = dec.feed(prompt);
  for (std::size_t i = 0; i < greedy.size(); ++i) {
    dgreedy = std::max(dgreedy, compare(family + " logits of generated token " + std::to_string(i),
                                        std::vector<double>(from.begin(), from.end()), ref["greedy_logits"][i]));
    if (i + 1 < greedy.size()) from = dec.feed(std::span<const std::int32_t>(&greedy[i], 1));
  }
  std::printf("%s: greedy generation of %zu tokens equal to transformers', logits %.2g\n", family.c_str(),
              greedy.size(), dgreedy);

  const double loss = m.forward(ids.data(), targets.data(), B, T);
  const std::vector<double> logits(m.logits(0), m.logits(0) + std::size_t(B) * T * vocab);
  const double dl = std::abs(loss - ref["loss"].get<double>()) / std::abs(ref["loss"].get<double>());
  if (dl > tolerance) std::fprintf(stderr, "FAILED %s loss: %.17g, transformers %.17g\n", family.c_str(), loss,
                                   ref["loss"].get<double>()), ++failures;
  const double dlogits = compare(family + " logits", logits, ref["logits"]);
  m.backward();
  double dgrads = 0;
  std::size_t checked = 0;
  for (auto& [name, g] : as_hf(shape, std::vector<double>(m.grads().data(), m.grads().data() + m.grads().numel()))) {
    if (!ref["grads"].contains(name)) {
      std::fprintf(stderr, "FAILED %s: transformers has no parameter %s\n", family.c_str(), name.c_str());
      ++failures;
      continue;
    }
    dgrads = std::max(dgrads, compare(family + " gradient of " + name, g, ref["grads"][name])), ++checked;
  }
  if (checked != ref["grads"].size()) {
    std::fprintf(stderr, "FAILED %s: %zu gradients compared, transformers has %zu parameters\n", family.c_str(),
                 checked, ref["grads"].size());
    ++failures;
  }

  // 3 AdamW steps (decay on matrices and embeddings), from the imported weights.
  checkpoint::load_gpt(dir, m);
  optim::AdamW<double> opt(m.specs(), m.params().numel(), {0.9, 0.95, 1e-8, wd});
  for (int step = 0; step < 3; ++step) {
    m.zero_grad();
    m.forward(ids.data(), targets.data(), B, T);
    m.backward();
    opt.step(m.params(), m.grads(), lr);
  }
  double dparams = 0;
  for (auto& [name, p] : as_hf(shape, std::vector<double>(m.params().data(), m.params().data() + m.params().numel())))
    dparams = std::max(dparams, compare(family + " parameter " + name + " after 3 AdamW steps", p,
                                        ref["params_after"][name]));

  // Export; transformers' from_pretrained must compute the same logits.
  checkpoint::save_gpt(out, m);
  std::ofstream(out + "/batch.json") << b.dump();
  m.forward(ids.data(), targets.data(), B, T);
  std::printf("%s: loss %.15g (transformers %.15g); largest difference, relative to each tensor's largest entry: "
              "logits %.2g, gradients %.2g (%zu tensors), parameters after 3 AdamW steps %.2g\n",
              family.c_str(), loss, ref["loss"].get<double>(), dlogits, dgrads, checked, dparams);
  return std::vector<double>(m.logits(0), m.logits(0) + std::size_t(B) * T * vocab);
}

}  // namespace

int main() {
  if (std::system((std::string(LOOM_HF_PYTHON) + " -c 'import transformers' 2>/dev/null").c_str()) != 0) {
    std::printf("SKIPPED: %s has no transformers (scripts/install-deps makes the environment)\n", LOOM_HF_PYTHON);
    return 77;
  }
  const loom::test::TempDir scratch("hf-families");
  const std::vector<std::string> families{"llama", "mixtral", "gpt2"};
  std::string make = script + " make", logits = script + " logits";
  for (const auto& f : families) {
    const std::string dir = scratch.path().string() + "/" + f;
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/batch.json") << batch().dump();
    make += " " + f + " " + dir, logits += " " + dir + "-export";
  }
  if (run(make) != 0) return 1;
  std::vector<std::vector<double>> mine;
  for (const auto& f : families) {
    const std::string dir = scratch.path().string() + "/" + f;
    mine.push_back(check_family(f, dir, dir + "-export"));
  }
  if (run(logits) != 0) return 1;
  for (std::size_t k = 0; k < families.size(); ++k) {
    const std::string out = scratch.path().string() + "/" + families[k] + "-export";
    const double d = compare(families[k] + " logits after export", mine[k],
                             nlohmann::json::parse(std::ifstream(out + "/logits.json"))["logits"]);
    std::printf("%s: logits of loom's export in transformers: largest difference %.2g\n", families[k].c_str(), d);
  }
  std::printf("%s\n", failures ? "test_hf_families: FAILED" : "test_hf_families: loom and transformers agree");
  return failures ? 1 : 0;
}

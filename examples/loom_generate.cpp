// loom-generate: text from a trained model, decoded with a key/value cache (models::GptDecoder) on one rank or over a
// tensor-parallel group of threads.
//   loom-generate DIR --prompt TEXT [--tokenizer FILE] [--max-new-tokens K] [--temperature T] [--top-k K]
//                 [--top-p P] [--seed S] [--parallel tpN] [--dtype f32|f64] [--json FILE] [--no-stop]
// DIR is a loom checkpoint (train_gpt --save's root or one of its checkpoints) or a Hugging Face directory of GPT-2,
// Llama or Mixtral, of any size: the shape is read from it at run time. Prints the prompt and the generated text,
// and on stderr the tokens per second of the prompt and of the generation. Exit status 0 on success, 1 with a
// message on stderr otherwise, 2 for a wrong command line.
#include <loom/comm/local.hpp>
#include <loom/data/tokenizer.hpp>
#include <loom/models/gpt/export.hpp>
#include <loom/models/gpt/generate.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace loom;

const char* usage =
    "usage: loom-generate DIR (--prompt TEXT | --prompt-ids I,J,...) [--tokenizer FILE] [--max-new-tokens K]\n"
    "                     [--temperature T] [--top-k K] [--top-p P] [--seed S] [--parallel tp1|tp2|tp4]\n"
    "                     [--dtype f32|f64] [--json FILE] [--no-stop]\n"
    "DIR: a loom checkpoint (train_gpt --save's root, or one checkpoint directory) or a Hugging Face directory\n"
    "     (config.json, model.safetensors or its index) of GPT-2, Llama or Mixtral; the shape is read from it.\n"
    "--prompt TEXT       the text to continue, encoded with the tokenizer: --tokenizer FILE, else DIR's\n"
    "                    tokenizer.json, else the one the checkpoint's run trained with; without one, bytes\n"
    "--prompt-ids LIST   the prompt as token ids instead\n"
    "--max-new-tokens K  tokens to generate (64); generation stops early after the tokenizer's end-of-text or\n"
    "                    document-separating token unless --no-stop\n"
    "--temperature T     0 (the default): greedy; else sampled from softmax(logits / T)\n"
    "--top-k K           sample from the K most likely tokens only (0: all)\n"
    "--top-p P           sample from the fewest most likely tokens whose probabilities reach P (1: all)\n"
    "--seed S            the draws' seed (0)\n"
    "--parallel tpN      decode over N tensor-parallel ranks (threads): tp1 (the default), tp2, tp4\n"
    "--dtype f32|f64     the element type the model computes in (f32)\n"
    "--json FILE         writes the prompt's and the generated token ids, the texts and the speeds\n";

struct Args {
  std::string dir, prompt, tokenizer, json, parallel = "tp1", dtype = "f32";
  std::vector<std::int32_t> prompt_ids;
  bool has_prompt = false, has_ids = false, stop = true;
  int max_new = 64;
  models::Sampling sampling;
};

//! The model read from DIR: its shape and options, and its parameters (a loom checkpoint's, read whole) or, for a
//! Hugging Face directory, none (each rank reads its part).
struct Source {
  models::GptShape shape;
  models::GptOptions options;
  bool hugging_face = false;
  nlohmann::json run;  //!< a loom checkpoint's run record
};

//! The tokenizer file to use: --tokenizer, DIR/tokenizer.json, the run's --tokenizer (where it still exists), or
//! none (bytes).
std::string tokenizer_file(const Args& a, const Source& src) {
  if (!a.tokenizer.empty()) return a.tokenizer;
  std::error_code ec;
  if (std::filesystem::exists(a.dir + "/tokenizer.json", ec)) return a.dir + "/tokenizer.json";
  if (src.run.is_object() && src.run.contains("tokenizer")) {
    const std::string t = src.run["tokenizer"].get<std::string>();
    if (std::filesystem::exists(t, ec)) return t;
  }
  return {};
}

struct Result {
  std::vector<std::int32_t> generated;
  double prompt_s = 0, generate_s = 0;  //!< the prefill, and the tokens after the first
};

//! Every rank of layout Cfg builds its part of the model and decodes; rank 0's result.
template <class T, class Cfg>
Result decode(const Args& a, const Source& src, const std::vector<T>& whole, const std::vector<std::int32_t>& prompt,
              const std::vector<std::int32_t>& stop) {
  Result out;
  auto rank = [&](models::GptModel<T, Cfg>& m, bool lead) {
    if (src.hugging_face) checkpoint::load_gpt(a.dir, m);
    else m.scatter(whole.data(), m.params().data());
    models::GptDecoder<T, Cfg> dec(m);
    const auto t0 = std::chrono::steady_clock::now();
    auto first = t0;
    int n = 0;
    auto gen = dec.generate(prompt, a.max_new, a.sampling, stop, [&](std::int32_t) {
      if (n++ == 0) first = std::chrono::steady_clock::now();
    });
    const auto end = std::chrono::steady_clock::now();
    if (!lead) return;
    out.generated = std::move(gen);
    out.prompt_s = std::chrono::duration<double>(first - t0).count();
    out.generate_s = std::chrono::duration<double>(end - first).count();
  };
  models::GptOptions opt = src.options;
  opt.write_buffers = false;  // every parameter is read
  if constexpr (Cfg::world_size == 1) {
    models::GptModel<T, Cfg> m(src.shape, 0, opt);
    rank(m, true);
  } else {
    run_local<Cfg>([&](auto& ctx) {
      models::GptModel<T, Cfg> m(src.shape, 0, ctx.template comm<Axis::tp>(), opt);
      rank(m, ctx.rank() == 0);
    });
  }
  return out;
}

template <class T>
Result decode(const Args& a, const Source& src, const std::vector<std::int32_t>& prompt,
              const std::vector<std::int32_t>& stop) {
  double eps = src.options.ln_eps;
  models::GptShape shape;
  const std::vector<T> whole =
      src.hugging_face ? std::vector<T>{} : checkpoint::read_checkpoint_model<T>(a.dir, shape, eps);
  if (a.parallel == "tp2") return decode<T, Parallel<TP<2>>>(a, src, whole, prompt, stop);
  if (a.parallel == "tp4") return decode<T, Parallel<TP<4>>>(a, src, whole, prompt, stop);
  return decode<T, Parallel<>>(a, src, whole, prompt, stop);
}

std::vector<std::int32_t> parse_ids(const std::string& s) {
  std::vector<std::int32_t> ids;
  std::size_t at = 0;
  while (at <= s.size()) {
    const std::size_t comma = std::min(s.find(',', at), s.size());
    const std::string one = s.substr(at, comma - at);
    std::size_t used = 0;
    long v = -1;
    try {
      v = std::stol(one, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    LOOM_CHECK(used == one.size() && !one.empty() && v >= 0 && v <= INT32_MAX, "--prompt-ids: '", one,
               "' is not a token id (give ids as 1,2,3)");
    ids.push_back(static_cast<std::int32_t>(v));
    at = comma + 1;
  }
  return ids;
}

//! The command line; exits 2 with the usage for a wrong one.
Args parse(int argc, char** argv) {
  Args a;
  auto wrong = [](const std::string& why) {
    std::fprintf(stderr, "loom-generate: %s\n%s", why.c_str(), usage);
    std::exit(2);
  };
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "-h" || f == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (f == "--no-stop") {
      a.stop = false;
      continue;
    }
    if (f.rfind("--", 0) != 0) {
      if (!a.dir.empty()) wrong("two directories given: " + a.dir + " and " + f);
      a.dir = f;
      continue;
    }
    if (i + 1 >= argc) wrong(f + " needs a value");
    const std::string v = argv[++i];
    auto number = [&](auto& out) {
      try {
        std::size_t used = 0;
        if constexpr (std::is_integral_v<std::remove_reference_t<decltype(out)>>) out = std::stoll(v, &used);
        else out = std::stod(v, &used);
        if (used != v.size()) throw std::invalid_argument(v);
      } catch (const std::exception&) {
        wrong(f + " " + v + ": not a number");
      }
    };
    if (f == "--prompt") a.prompt = v, a.has_prompt = true;
    else if (f == "--prompt-ids") {
      try {
        a.prompt_ids = parse_ids(v), a.has_ids = true;
      } catch (const std::exception& e) {
        wrong(e.what());
      }
    }
    else if (f == "--tokenizer") a.tokenizer = v;
    else if (f == "--max-new-tokens") number(a.max_new);
    else if (f == "--temperature") number(a.sampling.temperature);
    else if (f == "--top-k") number(a.sampling.top_k);
    else if (f == "--top-p") number(a.sampling.top_p);
    else if (f == "--seed") number(a.sampling.seed);
    else if (f == "--parallel") a.parallel = v;
    else if (f == "--dtype") a.dtype = v;
    else if (f == "--json") a.json = v;
    else wrong("unknown option " + f);
  }
  if (a.dir.empty()) wrong("no model directory given");
  if (a.has_prompt == a.has_ids) wrong("give the prompt as --prompt TEXT or as --prompt-ids LIST (one of them)");
  if (a.parallel != "tp1" && a.parallel != "tp2" && a.parallel != "tp4")
    wrong("--parallel " + a.parallel + ": loom-generate decodes on tp1, tp2 or tp4");
  if (a.dtype != "f32" && a.dtype != "f64") wrong("--dtype " + a.dtype + ": f32 or f64");
  if (a.max_new < 1) wrong("--max-new-tokens " + std::to_string(a.max_new) + ": at least 1");
  return a;
}

//! The text of token ids: decoded by the tokenizer, or bytes.
std::string text_of(const std::optional<data::Tokenizer>& tok, const std::vector<std::int32_t>& ids) {
  if (tok) return tok->decode(ids);
  std::string s;
  for (std::int32_t t : ids) s.push_back(static_cast<char>(t));
  return s;
}

int run(const Args& a) {
  Source src;
  std::error_code ec;
  LOOM_CHECK(std::filesystem::is_directory(a.dir, ec), a.dir, " is not a directory (give a loom checkpoint or a "
             "Hugging Face model directory)");
  if (checkpoint::hugging_face_dir(a.dir)) {
    src.hugging_face = true;
    src.shape = checkpoint::hf_shape(a.dir, &src.options.ln_eps);
  } else {
    const checkpoint::ShardedIndex ix = checkpoint::read_index(checkpoint::resolve_checkpoint(a.dir));
    src.shape = checkpoint::config_shape(ix.model, a.dir + "/index.json", &src.options.ln_eps);
    src.run = ix.run;
    if (src.run.is_object() && src.run.value("router", std::string()) == "sigmoid") src.options.moe.sigmoid = true;
  }
  a.sampling.check();
  std::optional<data::Tokenizer> tok;
  const std::string tf = tokenizer_file(a, src);
  if (!tf.empty()) {
    tok.emplace(tf);
    LOOM_CHECK(tok->size() <= src.shape.vocab, "the tokenizer ", tf, " has ", tok->size(),
               " tokens but the model's vocabulary is ", src.shape.vocab);
  }
  std::vector<std::int32_t> prompt = a.prompt_ids;
  if (a.has_prompt) {
    if (tok) {
      prompt = tok->encode(a.prompt);
    } else {
      LOOM_CHECK(src.shape.vocab >= 256, "no tokenizer for ", a.dir, " (give --tokenizer FILE), and its vocabulary of ",
                 src.shape.vocab, " does not hold the prompt's bytes");
      for (unsigned char c : a.prompt) prompt.push_back(c);
    }
  }
  LOOM_CHECK(!prompt.empty(), "the prompt is empty");
  for (std::size_t i = 0; i < prompt.size(); ++i)
    LOOM_CHECK(prompt[i] < src.shape.vocab, "prompt token ", prompt[i], " at position ", i,
               " is outside the model's vocabulary 0..", src.shape.vocab - 1);
  LOOM_CHECK(std::int64_t(prompt.size()) + a.max_new - 1 <= src.shape.max_seq, "a prompt of ", prompt.size(),
             " tokens and --max-new-tokens ", a.max_new, " exceed the model's ", src.shape.max_seq,
             " positions (max_seq)");
  // Generation stops where a text ends: the tokenizer's end-of-text token, or the token that separates the
  // documents of the data a loom model trained on (loom-tokenize puts it before each).
  std::vector<std::int32_t> stop;
  if (tok && a.stop)
    for (int id : {tok->end_of_text(), tok->document_separator()})
      if (id >= 0 && std::find(stop.begin(), stop.end(), id) == stop.end()) stop.push_back(id);
  const Result r = a.dtype == "f64" ? decode<double>(a, src, prompt, stop) : decode<float>(a, src, prompt, stop);
  const std::string prompt_text = text_of(tok, prompt), text = text_of(tok, r.generated);
  std::printf("%s%s\n", prompt_text.c_str(), text.c_str());
  std::fflush(stdout);  // before the report on stderr
  const double prompt_rate = double(prompt.size()) / r.prompt_s;
  const double rate = r.generated.size() > 1 ? double(r.generated.size() - 1) / r.generate_s : 0;
  std::fprintf(stderr, "loom-generate: %s, %s on %s: prompt %zu tokens in %.3f s (%.0f tokens/s), %zu new tokens "
               "(%.1f tokens/s after the first)%s\n", checkpoint::describe(src.shape).c_str(), a.dtype.c_str(),
               a.parallel.c_str(), prompt.size(), r.prompt_s, prompt_rate, r.generated.size(), rate,
               !r.generated.empty() && std::find(stop.begin(), stop.end(), r.generated.back()) != stop.end()
                   ? ", stopped at the end of the text"
                   : "");
  if (!a.json.empty()) {
    const nlohmann::json j = {{"prompt_ids", prompt}, {"generated_ids", r.generated}, {"prompt", prompt_text},
                              {"text", text}, {"prompt_tokens_per_s", prompt_rate}, {"tokens_per_s", rate},
                              {"temperature", a.sampling.temperature}, {"top_k", a.sampling.top_k},
                              {"top_p", a.sampling.top_p}, {"seed", a.sampling.seed}, {"parallel", a.parallel},
                              {"dtype", a.dtype}};
    const std::string tmp = a.json + ".tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      LOOM_CHECK(f.good(), "cannot write --json file ", tmp);
      f << j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";  // bad UTF-8 as U+FFFD
      LOOM_CHECK(f.good(), "cannot write --json file ", tmp);
    }
    std::filesystem::rename(tmp, a.json, ec);
    LOOM_CHECK(!ec, "cannot rename ", tmp, " to ", a.json, ": ", ec.message());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

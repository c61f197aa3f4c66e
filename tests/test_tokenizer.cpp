// loom::data::Tokenizer against Hugging Face `tokenizers` (in scripts/install-deps' virtual environment; skipped,
// exit 77, where it is missing): the same ids for a text with non-ASCII letters, emoji, runs of spaces and newlines,
// digits, contractions and special tokens, for a tokenizer of GPT-2's pattern and one of Llama 3's (both trained by
// scripts/train-tokenizer, in tests/tokenizers); decode(encode(x)) == x; an unsupported file refused by name.
#include "temp_dir.hpp"

#include <loom/data/tokenizer.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#ifndef LOOM_HF_PYTHON
#define LOOM_HF_PYTHON "python3"
#endif

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) ++failures;
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what.c_str());
}

const std::string text =
    "Hello world! It's a test: we're here, they'll see, I'd say you've won, I'm sure.\n\n"
    "Numbers 12345 and 3.14159 or 1,000,000 items;  two  spaces,   three   spaces\t\ttabs\n"
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00dcber Stra\u00dfe \u0417\u0434\u0440\u0430\u0432\u0441\u0442\u0432\u0443"
    "\u0439\u0442\u0435 \u03ba\u03cc\u03c3\u03bc\u03b5 \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 "
    "\xf0\x9f\x98\x80\xf0\x9f\x9a\x80 emoji\n<|endoftext|>The next document<|begin_of_text|>and another.\n"
    "   leading spaces and trailing   \n\n\n";

void compare(const std::string& file, const loom::test::TempDir& dir) {
  const loom::data::Tokenizer tok(file);
  const auto ids = tok.encode(text);
  const std::string text_file = dir / "text.txt", out = dir / "ids.json";
  std::ofstream(text_file, std::ios::binary) << text;
  const std::string cmd = std::string(LOOM_HF_PYTHON) + " " + LOOM_SOURCE_DIR + "/tests/tokenizer_reference.py " +
                          file + " " + text_file + " " + out;
  check(std::system(cmd.c_str()) == 0, "tokenizers encodes the text with " + file);
  const auto ref = nlohmann::json::parse(std::ifstream(out));
  const auto want = ref["ids"].get<std::vector<std::int32_t>>();
  std::size_t first = 0;
  while (first < ids.size() && first < want.size() && ids[first] == want[first]) ++first;
  check(ids == want, file + ": " + std::to_string(ids.size()) + " ids, tokenizers " + std::to_string(want.size()) +
                         (ids == want ? "" : ", first difference at " + std::to_string(first)));
  check(tok.decode(ids) == text, file + ": decode(encode(text)) is the text");
  check(tok.decode(ids) == ref["decoded"].get<std::string>(), file + ": decode is tokenizers' decode");
}

}  // namespace

int main() {
  if (std::system((std::string(LOOM_HF_PYTHON) + " -c 'import tokenizers' 2>/dev/null").c_str()) != 0) {
    std::printf("SKIPPED: %s has no tokenizers (scripts/install-deps makes the environment)\n", LOOM_HF_PYTHON);
    return 77;
  }
  const loom::test::TempDir dir("tokenizer");
  const std::string root = std::string(LOOM_SOURCE_DIR) + "/tests/tokenizers/";
  compare(root + "gpt2-512.json", dir);
  compare(root + "llama3-512.json", dir);
  compare(std::string(LOOM_SOURCE_DIR) + "/examples/corpus-tokenizer.json", dir);  // the shipped one
  const loom::data::Tokenizer gpt2(root + "gpt2-512.json");
  check(gpt2.document_separator() == gpt2.token_id("<|endoftext|>") && gpt2.document_separator() >= 0,
        "GPT-2's documents are separated by <|endoftext|>");
  std::ofstream(dir / "wordpiece.json") << R"({"model": {"type": "WordPiece", "vocab": {}}})";
  std::string error;
  try {
    loom::data::Tokenizer bad(dir / "wordpiece.json");
  } catch (const std::exception& e) {
    error = e.what();
  }
  check(error.find("wordpiece.json: the model type WordPiece is not supported") != std::string::npos,
        "a WordPiece tokenizer is refused: " + error);
  std::printf("%d failed\n", failures);
  return failures == 0 ? 0 : 1;
}

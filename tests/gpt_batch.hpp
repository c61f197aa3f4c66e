// A deterministic batch of token ids and targets for the GPT tests: B sequences of T tokens of a vocabulary, varied
// by a salt.
#pragma once

#include <cstdint>
#include <vector>

namespace loom::test {

struct Batch {
  std::vector<std::int32_t> ids, targets;
};

inline Batch batch(int B, int T, int vocab, int salt = 0) {
  Batch b;
  for (int i = 0; i < B * T; ++i) {
    b.ids.push_back((i * 7 + salt) % vocab);
    b.targets.push_back((i * 5 + 3 + salt) % vocab);
  }
  return b;
}

}  // namespace loom::test

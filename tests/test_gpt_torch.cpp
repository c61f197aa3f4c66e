// The GPT against PyTorch: the same parameters (saved by save_gpt, read by bench/gpt_torch.py), the same batch; the
// loss and every gradient must agree in double precision. Exits 77 (skipped) where /usr/bin/python3 has no torch.
#include <loom/models/gpt/checkpoint.hpp>
#include <loom/models/gpt.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#ifndef LOOM_SOURCE_DIR
#define LOOM_SOURCE_DIR "."
#endif

using namespace loom;

template <models::GptShape S>
int compare(const char* label) {
  const auto dir = (std::filesystem::temp_directory_path() / (std::string("loom-torch-") + label)).string();
  std::filesystem::create_directories(dir);
  models::Gpt<S, double> m(99);
  checkpoint::save_gpt(dir, m);
  const int B = 3, T = S.max_seq;
  nlohmann::json batch = {{"B", B}, {"T", T}};
  std::vector<std::int32_t> ids, tg;
  for (int i = 0; i < B * T; ++i) ids.push_back((i * 11 + 1) % S.vocab), tg.push_back((i * 3 + 2) % S.vocab);
  batch["ids"] = ids;
  batch["targets"] = tg;
  std::ofstream(dir + "/batch.json") << batch.dump();
  const std::string cmd = std::string("/usr/bin/python3 ") + LOOM_SOURCE_DIR + "/bench/gpt_torch.py reference " + dir +
                          " " + dir + "/batch.json > " + dir + "/torch.json";
  if (std::system(cmd.c_str()) != 0) {
    std::fprintf(stderr, "FAILED: %s\n", cmd.c_str());
    return 1;
  }
  const auto ref = nlohmann::json::parse(std::ifstream(dir + "/torch.json"));
  m.zero_grad();
  const double loss = m.forward(ids.data(), tg.data(), B, T);
  m.backward();
  int bad = 0;
  const double want = ref.at("loss");
  if (std::abs(loss - want) > 1e-13 * std::abs(want)) {
    std::fprintf(stderr, "%s: loss %.15g, PyTorch %.15g\n", label, loss, want);
    ++bad;
  }
  double worst = 0;
  for (const auto& s : m.specs()) {
    const auto& g = ref.at("grads").at(s.name);
    const double* mine = m.grads().data() + s.offset;
    double scale = 0;
    for (std::size_t i = 0; i < g.size(); ++i) scale = std::max(scale, std::abs(g[i].template get<double>()));
    for (std::size_t i = 0; i < g.size(); ++i) {
      const double err = std::abs(mine[i] - g[i].template get<double>()) / (scale + 1e-30);
      worst = std::max(worst, err);
      if (err > 1e-12) {
        if (bad < 10) std::fprintf(stderr, "%s: %s[%zu] = %.15g, PyTorch %.15g\n", label, s.name.c_str(), i, mine[i],
                                   g[i].template get<double>());
        ++bad;
      }
    }
  }
  std::printf("%s: loss %.15g (PyTorch %.15g); largest gradient difference %.3g of the tensor's largest entry\n",
              label, loss, want, worst);
  return bad ? 1 : 0;
}

int main() {
  if (std::system("/usr/bin/python3 -c 'import torch, numpy' 2>/dev/null") != 0) {
    std::printf("SKIPPED: /usr/bin/python3 has no torch (apt-get install python3-torch)\n");
    return 77;
  }
  constexpr models::GptShape mha{2, 2, 2, 16, 19, 9}, gqa{2, 4, 1, 16, 23, 7};
  const int rc = compare<mha>("mha") | compare<gqa>("gqa");
  std::printf("%s\n", rc ? "test_gpt_torch: FAILED" : "test_gpt_torch: loom and PyTorch agree");
  return rc;
}

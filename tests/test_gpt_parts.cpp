// A GPT split into parts (the blocks a pipeline stage holds) computes the whole model: micro-batches passed from
// part to part, each kept in its own activation slot until its backward, give the whole model's losses and
// gradients, with the tied embedding's gradient the sum of the first and last parts'; on one rank and on a
// tensor-parallel group, with dropout and with recompute.
#include "catch.hpp"

#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>

#include <cmath>
#include <map>
#include <string>
#include <vector>

using namespace loom;

namespace {

constexpr models::GptShape S{4, 4, 2, 16, 29, 8};
constexpr int micro = 3, B = 2, T = 8;

std::vector<std::int32_t> tokens(int salt) {
  std::vector<std::int32_t> t(B * T);
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::int32_t>((i * 7 + salt * 13 + i * i) % S.vocab);
  return t;
}

//! Gradients by name, the whole model's, gathered over tensor parallelism.
template <class M>
std::map<std::string, std::vector<double>> grads_by_name(M& m) {
  const auto whole = m.gather(m.grads().data());
  std::map<std::string, std::vector<double>> out;
  const auto global = M::param_specs(0, true);
  for (const auto& s : m.specs()) {
    const auto& g = global[s.index];
    out[s.name].assign(whole.begin() + g.offset, whole.begin() + g.offset + numel_of(g.shape));
  }
  return out;
}

//! What one rank found; checked on the test's thread (assertions are not thread-safe).
struct Found {
  std::vector<double> want, got;
  double worst = 0, scale = 0;
  std::size_t names = 0, ref_names = 0;
};

//! split: each backward as B (input gradients, every micro-batch, last first) then W (weight gradients, in
//! another order), as zero-bubble schedules run it.
template <class Cfg>
void check_parts(models::GptOptions opt, std::vector<models::GptPart> parts, bool split = false) {
  std::vector<Found> found(Cfg::world_size);
  run_local<Cfg>([&](auto& ctx) {
    Found& f = found[ctx.rank()];
    auto& tp = ctx.template comm<Axis::tp>();
    std::vector<std::vector<std::int32_t>> ids, tgt;
    for (int m = 0; m < micro; ++m) ids.push_back(tokens(m)), tgt.push_back(tokens(m + 5));
    // The whole model, micro-batch after micro-batch.
    models::Gpt<S, double, Cfg> whole(7, tp, opt);
    std::vector<double> want;
    for (int m = 0; m < micro; ++m) {
      want.push_back(whole.forward(ids[m].data(), tgt[m].data(), B, T, 3, m * B));
      whole.backward(1.0 / micro);
    }
    // The parts: every micro-batch forward through them all (each in its own slot), then every backward.
    std::vector<std::unique_ptr<models::Gpt<S, double, Cfg>>> p;
    for (auto part : parts) {
      p.push_back(std::make_unique<models::Gpt<S, double, Cfg>>(7, tp, part, opt));
      p.back()->set_slots(micro);
    }
    std::vector<double> got(micro);
    for (int m = 0; m < micro; ++m) {
      const typename models::Gpt<S, double, Cfg>::MicroBatch mb{ids[m].data(), tgt[m].data(), B, T, 3, m * B};
      for (std::size_t i = 0; i < p.size(); ++i) got[m] = p[i]->forward(m, mb, i ? p[i - 1]->output(m) : nullptr);
    }
    for (int m = micro; m-- > 0;)
      for (std::size_t i = p.size(); i-- > 0;) {
        const double* dout = i + 1 < p.size() ? p[i + 1]->input_grad(m) : nullptr;
        if (split) p[i]->backward_inputs(m, 1.0 / micro, dout);
        else p[i]->backward(m, 1.0 / micro, dout);
      }
    if (split)
      for (int m = 0; m < micro; ++m)
        for (auto& part : p) part->backward_weights(m);
    auto ref = grads_by_name(whole);
    std::map<std::string, std::vector<double>> sum;
    for (auto& part : p)
      for (auto& [name, g] : grads_by_name(*part)) {
        auto& s = sum[name];
        if (s.empty()) s.assign(g.size(), 0.0);
        for (std::size_t i = 0; i < g.size(); ++i) s[i] += g[i];
      }
    f.want = want, f.got = got, f.names = sum.size(), f.ref_names = ref.size();
    if (sum.size() != ref.size()) return;
    for (auto& [name, g] : ref)
      for (std::size_t i = 0; i < g.size(); ++i) {
        f.worst = std::max(f.worst, std::abs(sum.at(name)[i] - g[i]));
        f.scale = std::max(f.scale, std::abs(g[i]));
      }
  });
  for (std::size_t r = 0; r < found.size(); ++r) {
    const Found& f = found[r];
    INFO("rank " << r << ": largest gradient difference " << f.worst << " of " << f.scale);
    REQUIRE(f.names == f.ref_names);
    for (int m = 0; m < micro; ++m) CHECK(f.got.at(m) == Approx(f.want.at(m)).epsilon(1e-12));
    CHECK(f.scale > 0);
    CHECK(f.worst <= 1e-12 * f.scale);
  }
}

}  // namespace

TEST_CASE("parts of the model compute the whole model", "[model][pipeline]") {
  models::GptOptions opt;
  opt.dropout = 0.1f;
  const std::vector<models::GptPart> three{{0, 1}, {1, 3}, {3, 4}}, two{{0, 2}, {2, -1}};
  SECTION("one rank, three parts") { check_parts<Parallel<>>(opt, three); }
  SECTION("one rank, two parts, recompute") {
    opt.recompute = models::Recompute::full;
    check_parts<Parallel<>>(opt, two);
  }
  SECTION("tp2 with sequence parallelism, three parts") { check_parts<Parallel<TP<2, SequenceParallel>>>(opt, three); }
  SECTION("tp4, two parts") { check_parts<Parallel<TP<4>>>(opt, two); }
  SECTION("split backward, one rank") { check_parts<Parallel<>>(opt, three, true); }
  SECTION("split backward, tp2 with sequence parallelism") {
    check_parts<Parallel<TP<2, SequenceParallel>>>(opt, three, true);
  }
  SECTION("split backward, tp4 (shared kv heads)") { check_parts<Parallel<TP<4>>>(opt, two, true); }
}

TEST_CASE("a part holds its blocks' parameters and the embedding where it is used", "[model][pipeline]") {
  using M = models::Gpt<S, double>;
  const auto first = M::param_specs(0, false, {0, 1}), middle = M::param_specs(0, false, {1, 3}),
             last = M::param_specs(0, false, {3, 4});
  CHECK(first.front().name == "wte.weight");
  CHECK(first[1].name == "wpe.weight");
  CHECK(first.size() == 2 + 12);
  CHECK(middle.front().name == "h.1.ln_1.weight");
  CHECK(middle.size() == 24);
  CHECK(last.front().name == "wte.weight");
  CHECK(last.back().name == "ln_f.bias");
  CHECK(last.size() == 1 + 12 + 2);
  CHECK(middle.front().index == 2 + 12);  // numbered as in the whole model, which keys initialisation
  models::Gpt<S, double> whole(1);
  run_local<Parallel<>>([&](auto& ctx) {  // one rank: one thread asserts at a time
    models::Gpt<S, double> mid(1, ctx.template comm<Axis::tp>(), models::GptPart{1, 3});
    CHECK(!mid.embedding());
    CHECK(!mid.head());
    CHECK(mid.backward_chunks() == 2);
    const auto a = mid.param("h.2.mlp.c_fc.weight"), b = whole.param("h.2.mlp.c_fc.weight");
    CHECK(std::equal(a.data(), a.data() + a.numel(), b.data()));
    std::string msg;
    try {
      std::vector<std::int32_t> ids(T, 1);
      mid.forward(ids.data(), ids.data(), 1, T);
    } catch (const Error& e) {
      msg = e.what();
    }
    CHECK(msg.find("runs the whole model; this part holds blocks 1..2 of 4") != std::string::npos);
  });
}

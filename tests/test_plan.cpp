// The planner's walk of a model's parameters (plan::detail::each_param) against the model's own table
// (models::gpt_param_specs) for every shape train_gpt knows, tensor-parallel degrees, pipeline parts and expert
// splits; its layouts against the types; its memory formulas against hand-computed figures.
#include "catch.hpp"

#include <loom/models/gpt/param_table.hpp>
#include <loom/plan.hpp>

#include <string>
#include <vector>

using namespace loom;

TEST_CASE("each_param walks gpt_param_specs' parameters with their local sizes", "[plan]") {
  for (const char* name : {"tiny", "small", "gpt2", "tiny-moe", "small-moe", "llama-tiny", "llama-small",
                           "mixtral-tiny", "mixtral-small"}) {
    const auto s = *plan::model_named(name);
    for (int tp : {1, 2, 4})
      for (int parts : {1, 2}) {
        const int per = s.layers / parts;
        for (int k = 0; k < parts; ++k)
          for (int ep : {1, 2}) {
            if (s.experts == 0 && ep > 1) continue;
            for (int r = 0; r < tp; ++r) {
              const models::Part part{k * per, (k + 1) * per};
              const auto specs = models::gpt_param_specs<float>(s, tp, r, part, ep, 0);
              std::vector<std::int64_t> want, got;
              std::vector<bool> want_expert, got_expert;
              for (const auto& p : specs) want.push_back(numel_of(p.shape)), want_expert.push_back(p.expert);
              plan::detail::each_param(s, tp, r, part.first, part.last, ep, [&](plan::detail::ParamDecl p) {
                got.push_back(p.numel), got_expert.push_back(p.expert);
              });
              INFO(name << " tp " << tp << " rank " << r << " part " << k << " of " << parts << " ep " << ep);
              CHECK(got == want);
              CHECK(got_expert == want_expert);
            }
          }
      }
  }
}

TEST_CASE("a layout by name is the layout of its type", "[plan]") {
  CHECK(plan::layout_named("tp2,sp,pp4,zb-v,dp8,zero1") == plan::layout_of<LayoutOf<"tp2.sp.pp4.zb-v.dp8.zero1">>());
  CHECK(plan::layout_named("pp2.v2.dp2") == plan::layout_of<LayoutOf<"pp2.v2.dp2">>());
  CHECK(plan::layout_named("cp2.ulysses.dp4.zero3.shard2.ep2") ==
        plan::layout_of<LayoutOf<"cp2.ulysses.dp4.zero3.shard2.ep2">>());
  CHECK(plan::layout_named("tp8,pp64,dp6", "interleaved").schedule == Schedule::interleaved);
  CHECK(plan::layout_named("tp8,pp16,v4,dp64").name() == "tp8.pp16.v4.dp64");
  CHECK_THROWS_WITH(plan::layout_named("tp2,xx4"), Catch::Contains("'xx4' is not one of"));
}

TEST_CASE("memory: Megatron-LM's 18 bytes per parameter and Korthikanti's activation formula", "[plan]") {
  // 22B on tp8: parameters per rank from the walk; 2 + 4 + 12 bytes each.
  const auto s = *plan::model_named("megatron-22b");
  plan::Run r;
  r.batch = 4, r.seq = 2048, r.micro_batches = 1, r.dtype = plan::Dtype::bf16, r.recipe = plan::Recipe::megatron;
  const plan::Layout l = plan::layout_named("tp8,sp");
  std::int64_t params = 0;
  plan::detail::each_param(s, 8, 0, 0, s.layers, 1, [&](plan::detail::ParamDecl p) { params += p.numel; });
  const plan::Memory m = plan::memory(s, l, r);
  CHECK(m.bytes.parameters + m.bytes.gradients + m.bytes.optimizer == Approx(18.0 * double(params)));
  // Sequence parallelism, no recomputation: (sbh/t)(34 + 5as/h) per layer, 48 layers, b = 4.
  const double sbh = 2048.0 * 4 * 6144, per_layer = sbh / 8 * (34 + 5.0 * 64 * 2048 / 6144);
  CHECK(m.bytes.activations == Approx(48 * per_layer));
  r.recompute = plan::Recompute::selective;
  CHECK(plan::memory(s, l, r).bytes.activations == Approx(48 * sbh / 8 * 34));
  // ZeRO-1 (the distributed optimizer) over 8 ranks: 6 + 12/8 bytes per parameter.
  const plan::Layout z = plan::layout_named("tp8,sp,dp8,zero1");
  r.batch = 32;
  std::int64_t zp = 0;
  plan::detail::each_param(s, 8, 0, 0, s.layers, 1, [&](plan::detail::ParamDecl p) { zp += p.numel; });
  CHECK(plan::memory(s, z, r).bytes.state() == Approx((6 + 12.0 / 8) * double(zp)));
  // Interleaved over 4 stages of 2 chunks: the first stage holds 4 (1 + 3/8) micro-batches of its 12 layers, but
  // never more than the step has.
  const plan::Layout pipe = plan::layout_named("tp8,sp,pp4,v2");
  r.recompute = plan::Recompute::selective;
  const double layer = sbh / 8 * 34;  // micro-batches of 4 sequences
  r.batch = 32, r.micro_batches = 8;
  CHECK(plan::memory_by_stage(s, pipe, r).front().bytes.activations == Approx(4 * (1 + 3.0 / 8) * 12 * layer));
  r.batch = 16, r.micro_batches = 4;
  CHECK(plan::memory_by_stage(s, pipe, r).front().bytes.activations == Approx(4 * 12 * layer));
}

TEST_CASE("memory: llama3-1b under tp2.dp4.zero3, category by category, is docs/models.md's formula", "[plan]") {
  // Llama 3.2 1B: 16 blocks of d 2048, 32 heads of 64 (8 for keys and values), FFN 8192 (SwiGLU), vocabulary
  // 128256 tied, f32. Tensor parallelism 2 halves the heads, the FFN and the vocabulary; the norms are whole.
  const auto s = *plan::model_named("llama3-1b");
  const std::int64_t d = 2048, L = 16, hq = 16, hd = 64, kv = 4, f = 4096, Vr = 128256 / 2, qkv = (hq + 2 * kv) * hd;
  const std::int64_t block = 2 * d + d * qkv + hq * hd * d + 3 * d * f, embedding = Vr * d;
  const std::int64_t psi_t = embedding + L * block + d;  // + the final norm
  CHECK(psi_t == 617'940'992);
  // ZeRO-3 over 4 ranks, units the embedding, each block and the final norm: rank 0 owns a quarter of each.
  const std::int64_t psi_r = embedding / 4 + L * (block / 4) + d / 4;
  // Gathered at once: the tied table and the final norm, and two blocks (the one computing, the next one fetched).
  const std::int64_t window = 3 * (embedding + d) / 4 + 2 * (3 * block / 4);
  plan::Run r;
  r.batch = 16, r.seq = 1024, r.micro_batches = 2;  // two sequences of 1024 per micro-batch on each rank
  const plan::Memory m = plan::memory(s, plan::layout_named("tp2,dp4,zero3"), r);
  const double T = 4, A = 4;
  CHECK(m.held.parameters == T * double(psi_r));
  CHECK(m.held.gradients == T * double(psi_r));
  CHECK(m.held.optimizer == 2 * A * double(psi_r));
  CHECK(m.bytes.parameters == T * double(psi_r + window));
  CHECK(m.bytes.gradients == T * double(psi_t));  // accumulated whole over the two micro-batches
  CHECK(m.bytes.optimizer == 2 * A * double(psi_r));
  // Activations of one micro-batch of N tokens: each block keeps its input, two norms' outputs and the attention
  // output (4Nd), q|k|v, the attention core's output, the SwiGLU's gate|up and product (3Nf), four statistics per
  // row and the softmax's log-sum-exp per head and token; the head keeps its input, the final norm's output and
  // statistics, the logits over the rank's vocabulary rows and the targets' losses; backward's branch gradients
  // are scratch for one block at a time.
  const std::int64_t N = 2 * 1024, B = 2;
  const double per_block = T * double(4 * N * d + N * qkv + N * hq * hd + 3 * N * f) + A * double(4 * N + B * hq * 1024);
  const double head = T * double(N * d) + 4 * A * double(N) + T * double(N * Vr + N);
  const double scratch = T * double(N * d + N) + T * double(4 * N * d + N * hq * hd + N * qkv + 3 * N * f);
  CHECK(m.bytes.activations == double(L) * per_block + 2 * T * double(N * d) + head + scratch);
}

TEST_CASE("a shape and run that do not fit a layout are refused with the rule", "[plan]") {
  const auto s = *plan::model_named("small");
  plan::Run r;
  r.batch = 8, r.seq = 64, r.micro_batches = 2;
  CHECK(plan::violation(s, plan::layout_named("tp3"), r) == "heads must be divisible by TP");
  CHECK(plan::violation(s, plan::layout_named("dp3"), r).find("does not split into dp 3") != std::string::npos);
  CHECK(plan::violation(s, plan::layout_named("cp4"), r).empty());
  CHECK(plan::violation(s, plan::layout_named("pp2,v2"), r).empty());
  CHECK(!plan::violation(s, plan::layout_named("pp4,v2"), r).empty());  // 2 micro-batches on 4 stages, interleaved
}

// The compile-time check: a layout that fits, and its constexpr breakdown.
constexpr plan::Run llama_run{64, 8192, 8, plan::Dtype::bf16};
static_assert(plan::fits<LayoutOf<"tp8.pp2.dp4.zero1">, *plan::model_named("llama3-8b"), plan::devices::H100_80GB,
                         llama_run>);
static_assert(!plan::fits<LayoutOf<"dp8">, *plan::model_named("llama3-8b"), plan::devices::H100_80GB, llama_run>);
static_assert(plan::CheckFits<LayoutOf<"tp8.pp2.dp4.zero1">, *plan::model_named("llama3-8b"),
                              plan::devices::H100_80GB, llama_run>::ok);

// Published training runs the planner is checked against: each run's model, layout, batch, recipe and cluster, and
// the figure its paper measured (achieved TFLOP/s per GPU, or seconds per iteration). Where a paper does not give a
// value the planner needs (a micro-batch count, the interleaved chunks) the row says what it assumes.
#pragma once

#include <loom/plan/cluster.hpp>
#include <loom/plan/layout.hpp>
#include <loom/plan/model.hpp>
#include <loom/plan/time.hpp>

#include <string_view>
#include <vector>

namespace loom::plan {

struct PublishedRun {
  std::string_view source;  //!< paper and table
  std::string_view model;   //!< model_named's name
  std::string_view layout;  //!< layout_named's spelling
  int batch, seq, micro_batch_size;
  Recompute recompute;
  std::string_view cluster;
  //! What was measured: TFLOP/s per GPU by the paper's own count, seconds per iteration, or GiB per GPU of the
  //! training state (parameters, gradients and optimizer state) or of the activations.
  enum class Figure { tflops_narayanan, tflops_palm, seconds, state_gib, activations_gib } figure;
  double value;
  std::string_view note;  //!< what the row assumes
};

//! The runs: Narayanan et al. 2021 (SC'21) Table 1, A100 80GB, full recomputation, fp16, with the micro-batch sizes
//! and interleaving of Megatron-LM's script for the table (their TFLOP/s count the recomputation:
//! 96 B s l h^2 (1 + s/6h + V/16lh) per iteration);
//! Korthikanti et al. 2022 Table 5, iteration seconds with full recomputation and with sequence parallelism plus
//! selective recomputation; Llama 3 (2024) Table 4, 405B on H100 (TFLOP/s per GPU by 6N + 12 L h s).
inline const std::vector<PublishedRun>& published_runs() {
  using F = PublishedRun::Figure;
  constexpr auto full = Recompute::full, sel = Recompute::selective, none = Recompute::none;
  // A row of Narayanan et al.'s Table 1: sequences of 2048, full recomputation, TFLOP/s per GPU on A100s.
  auto table1 = [](std::string_view model, std::string_view layout, int batch, int micro_batch_size, double tflops) {
    return PublishedRun{"Narayanan 2021 T1", model, layout, batch, 2048, micro_batch_size, Recompute::full,
                        "a100-80gb",         F::tflops_narayanan, tflops, ""};
  };
  static const std::vector<PublishedRun> runs = {
      // Micro-batch sizes and interleaving as Megatron-LM's examples/sc21/run_table_1.sh sets them (the paper gives
      // neither); fp16 gradients, all-reduced by PyTorch's DDP during backward without a pipeline, after it with one.
      table1("megatron-1.7b", "dp32", 512, 16, 137),      table1("megatron-3.6b", "tp2.dp32", 512, 16, 138),
      table1("megatron-7.5b", "tp4.dp32", 512, 16, 142),  table1("megatron-18b", "tp8.dp32", 1024, 8, 135),
      table1("megatron-39b", "tp8.pp2.dp32", 1536, 4, 138), table1("megatron-76b", "tp8.pp4.v3.dp32", 1792, 2, 140),
      table1("megatron-146b", "tp8.pp8.v2.dp24", 2304, 2, 148),
      table1("megatron-310b", "tp8.pp16.v2.dp15", 2160, 1, 155),
      table1("megatron-530b", "tp8.pp35.v3.dp9", 2520, 1, 163), table1("megatron-1t", "tp8.pp64.dp6", 3072, 1, 163),
      {"Korthikanti 2022 T5", "megatron-22b", "tp8", 4, 2048, 4, full, "a100-80gb", F::seconds, 1.42, ""},
      {"Korthikanti 2022 T5", "megatron-22b", "tp8.sp", 4, 2048, 4, sel, "a100-80gb", F::seconds, 1.10, ""},
      {"Korthikanti 2022 T5", "gpt3-175b", "tp8.pp8.v3", 64, 2048, 1, full, "a100-80gb", F::seconds, 18.13,
       "interleaved with 3 chunks assumed"},
      {"Korthikanti 2022 T5", "gpt3-175b", "tp8.sp.pp8.v3", 64, 2048, 1, sel, "a100-80gb", F::seconds, 13.75,
       "interleaved with 3 chunks assumed"},
      {"Korthikanti 2022 T5", "megatron-530b", "tp8.pp35.v3", 280, 2048, 1, full, "a100-80gb", F::seconds, 49.05,
       "interleaved with 3 chunks assumed"},
      {"Korthikanti 2022 T5", "megatron-530b", "tp8.sp.pp35.v3", 280, 2048, 1, sel, "a100-80gb", F::seconds, 37.83,
       "interleaved with 3 chunks assumed"},
      {"Korthikanti 2022 T5", "megatron-1t", "tp8.pp64", 512, 2048, 1, full, "a100-80gb", F::seconds, 94.42, ""},
      {"Korthikanti 2022 T5", "megatron-1t", "tp8.sp.pp64", 512, 2048, 1, sel, "a100-80gb", F::seconds, 71.49, ""},
      // Korthikanti et al. 2022 Figure 1 (as read off the figure by Calculon's validation, GiB): the first pipeline
      // stage's memory per GPU, the training state of its transformer layers, and the activations of tensor
      // parallelism alone and of sequence parallelism with selective recomputation (the figure's values are the
      // paper's formula, which the planner's Megatron recipe uses).
      {"Korthikanti 2022 F1", "megatron-22b", "tp8", 4, 2048, 4, full, "a100-80gb", F::state_gib, 45.5625, ""},
      {"Korthikanti 2022 F1", "gpt3-175b", "tp8.pp8.v3", 64, 2048, 1, full, "a100-80gb", F::state_gib, 45.5625, ""},
      {"Korthikanti 2022 F1", "megatron-530b", "tp8.pp35.v3", 280, 2048, 1, full, "a100-80gb", F::state_gib, 31.640625,
       ""},
      {"Korthikanti 2022 F1", "megatron-1t", "tp8.pp64", 512, 2048, 1, full, "a100-80gb", F::state_gib, 32.958984375,
       ""},
      {"Korthikanti 2022 F1", "megatron-22b", "tp8", 4, 2048, 4, none, "a100-80gb", F::activations_gib, 59.25, ""},
      {"Korthikanti 2022 F1", "megatron-22b", "tp8.sp", 4, 2048, 4, sel, "a100-80gb", F::activations_gib, 9.5625, ""},
      {"Korthikanti 2022 F1", "gpt3-175b", "tp8.pp8.v3", 64, 2048, 1, none, "a100-80gb", F::activations_gib, 66.84375,
       ""},
      {"Korthikanti 2022 F1", "gpt3-175b", "tp8.sp.pp8.v3", 64, 2048, 1, sel, "a100-80gb", F::activations_gib,
       12.3515625, ""},
      {"Korthikanti 2022 F1", "megatron-530b", "tp8.pp35.v3", 280, 2048, 1, none, "a100-80gb", F::activations_gib,
       114.0234375, ""},
      {"Korthikanti 2022 F1", "megatron-530b", "tp8.sp.pp35.v3", 280, 2048, 1, sel, "a100-80gb", F::activations_gib,
       23.076171875, ""},
      {"Korthikanti 2022 F1", "megatron-1t", "tp8.pp64", 512, 2048, 1, none, "a100-80gb", F::activations_gib, 131.25,
       ""},
      {"Korthikanti 2022 F1", "megatron-1t", "tp8.sp.pp64", 512, 2048, 1, sel, "a100-80gb", F::activations_gib, 26.5625,
       ""},
      {"Llama 3 2024 T4", "llama3-405b", "tp8.sp.pp16.v8.dp64.zero2", 2048, 8192, 1, Recompute::none, "h100-80gb",
       F::tflops_palm, 430, "8 chunks a stage of one block each, the embedding and the output layer alone; FSDP; no dropout"},
      {"Llama 3 2024 T4", "llama3-405b", "tp8.sp.pp16.v8.dp128.zero2", 2048, 8192, 1, Recompute::none, "h100-80gb",
       F::tflops_palm, 400, "8 chunks a stage of one block each, the embedding and the output layer alone; FSDP; no dropout"},
      {"Llama 3 2024 T4", "llama3-405b", "tp8.sp.cp16.pp16.v8.dp8.zero2", 128, 131072, 1, Recompute::none, "h100-80gb",
       F::tflops_palm, 380, "8 chunks a stage of one block each, the embedding and the output layer alone; FSDP; no dropout"},
  };
  return runs;
}

//! The run a published row describes, under Megatron-LM's recipe.
inline Run run_of(const PublishedRun& p, const Layout& l) {
  Run r;
  r.batch = p.batch, r.seq = p.seq, r.recompute = p.recompute, r.dtype = Dtype::bf16, r.recipe = Recipe::megatron;
  r.micro_batches = p.batch / (l.dp * p.micro_batch_size);
  r.flash = p.figure == PublishedRun::Figure::tflops_palm;  // the Llama 3 rows
  // Narayanan et al.'s 2021 runs: fp16, PyTorch's DDP without a pipeline (Megatron's own, after backward, with one).
  r.fp16_grads = p.figure == PublishedRun::Figure::tflops_narayanan;
  r.overlap_grad_reduce = r.fp16_grads && l.pp == 1;
  // Llama 3: no dropout; its pipeline's first and last parts hold the embedding and the output layer alone; its
  // context parallelism all-gathers keys and values.
  const bool llama = p.figure == PublishedRun::Figure::tflops_palm;
  r.dropout = !llama, r.ends_alone = r.cp_all_gather = llama;
  return r;
}

//! The cluster a published row ran on: `instead` where its name is the row's (a calibration of that cluster), else
//! the built-in one.
inline Cluster cluster_of_run(const PublishedRun& p, const Cluster* instead = nullptr) {
  return instead && instead->name == p.cluster ? *instead : *cluster_named(p.cluster);
}

//! What the planner predicts for a published row, in the row's unit (on `instead` for its cluster, when given).
inline double predicted_figure(const PublishedRun& p, const Cluster* instead = nullptr) {
  const GptShape s = *model_named(p.model);
  const Layout l = layout_named(p.layout);
  const Run r = run_of(p, l);
  const double gib = double(1 << 30);
  if (p.figure == PublishedRun::Figure::activations_gib)  // the first stage, which holds the most activations
    return memory_by_stage(s, l, r).front().bytes.activations / gib;
  if (p.figure == PublishedRun::Figure::state_gib) {
    // The figure counts a stage's transformer layers (its 18 bytes per parameter), not the embedding: the blocks'
    // parameters (units 1 .. blocks) of the first stage's chunks.
    std::int64_t params = 0;
    const int parts = l.pp * l.chunks();
    for (int c = 0; c < l.chunks(); ++c) {
      const detail::PartSpan p = detail::part_span(s, parts, detail::part_of(l, 0, c), r.ends_alone);
      detail::each_param(s, l.tp, 0, p.first, p.last, p.embedding, p.head, l.ep, [&](detail::ParamDecl d) {
        if (d.unit >= 1 && d.unit <= p.last - p.first) params += d.numel;
      });
    }
    return 18.0 * double(params) / gib;
  }
  const StepTime t = step_time(s, l, r, cluster_of_run(p, instead));
  const double B = p.batch, S = p.seq, L = s.layers, h = s.d_model, V = s.vocab;
  switch (p.figure) {
    case PublishedRun::Figure::state_gib:
    case PublishedRun::Figure::activations_gib: return 0;
    case PublishedRun::Figure::seconds: return t.step;
    case PublishedRun::Figure::tflops_narayanan:
      return 96 * B * S * L * h * h * (1 + S / (6 * h) + V / (16 * L * h)) / t.step / l.world() / 1e12;
    case PublishedRun::Figure::tflops_palm:
      return (6.0 * double(s.params()) + 12.0 * L * h * S) * B * S / t.step / l.world() / 1e12;
  }
  return 0;
}

}  // namespace loom::plan

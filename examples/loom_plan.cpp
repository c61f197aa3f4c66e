// loom-plan: the memory per rank and the step time of a model under a layout on a cluster, before a single step;
// with --search, every layout of a device count ranked, and why each rejected one fails; with --validate, the
// planner against published runs; with --calibrate FILE, this machine measured into a cluster file. The flags that
// change memory or time are spelled as train_gpt spells them.
#include "loom_plan_calibrate.hpp"

#include <loom/models/gpt/hf.hpp>
#include <loom/plan.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

using namespace loom;
using namespace loom::plan;

namespace {

const char* const usage =
    "usage: loom-plan --model NAME|config.json [--parallel SPEC | --search --gpus N] [--schedule NAME]\n"
    "                 [--batch B] [--seq T] [--micro-batches M] [--dtype f64|f32|bf16]\n"
    "                 [--recompute none|selective|full] [--optimizer adamw|sgd] [--capacity-factor F] [--dropout P]\n"
    "                 [--bucket-mb MB] [--recipe loom|megatron] [--flash] [--cluster NAME|FILE] [--top K]\n"
    "                 [--json FILE] | --validate [--cluster FILE] [--json FILE] | --calibrate FILE\n";

struct Args {
  std::string model, parallel, schedule, cluster = "h100-80gb", json, recipe = "loom", calibrate, calibrate_mpi;
  Run run;
  int gpus = 0, top = 10;
  bool search = false, validate = false, micro_given = false;
};

double number(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  LOOM_CHECK(end && *end == '\0' && !v.empty(), "loom-plan: ", flag, " takes a number, got '", v, "'");
  return x;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--help" || f == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (f == "--search") { a.search = true; continue; }
    if (f == "--validate") { a.validate = true; continue; }
    if (f == "--flash") { a.run.flash = true; continue; }
    LOOM_CHECK(i + 1 < argc, "loom-plan: ", f, " needs a value\n", usage);
    const std::string v = argv[++i];
    if (f == "--model") a.model = v;
    else if (f == "--parallel") a.parallel = v;
    else if (f == "--schedule") a.schedule = v;
    else if (f == "--cluster") a.cluster = v;
    else if (f == "--json") a.json = v;
    else if (f == "--recipe") a.recipe = v;
    else if (f == "--calibrate") a.calibrate = v;
    else if (f == "--calibrate-mpi") a.calibrate_mpi = v;  // the child mpirun starts
    else if (f == "--gpus") a.gpus = int(number(f, v));
    else if (f == "--top") a.top = int(number(f, v));
    else if (f == "--batch") a.run.batch = int(number(f, v));
    else if (f == "--seq") a.run.seq = int(number(f, v));
    else if (f == "--micro-batches") a.run.micro_batches = int(number(f, v)), a.micro_given = true;
    else if (f == "--capacity-factor") a.run.capacity_factor = number(f, v);
    else if (f == "--dropout") a.run.dropout = number(f, v) > 0;
    else if (f == "--bucket-mb") a.run.bucket_bytes = std::int64_t(number(f, v) * (1 << 20));
    else if (f == "--dtype") {
      const auto d = dtype_named(v);
      LOOM_CHECK(d.has_value(), "loom-plan: --dtype takes f64, f32 or bf16, got '", v, "'");
      a.run.dtype = *d;
    } else if (f == "--recompute") {
      const auto r = models::recompute_named(v);
      LOOM_CHECK(r.has_value(), "loom-plan: --recompute takes none, selective or full, got '", v, "'");
      a.run.recompute = *r;
    } else if (f == "--optimizer") {
      LOOM_CHECK(v == "adamw" || v == "sgd", "loom-plan: --optimizer takes adamw or sgd, got '", v, "'");
      a.run.sgd = v == "sgd";
    } else {
      throw Error(loom::detail::cat("loom-plan: unknown flag ", f, "\n", usage));
    }
  }
  LOOM_CHECK(a.recipe == "loom" || a.recipe == "megatron", "loom-plan: --recipe takes loom or megatron, got '",
             a.recipe, "'");
  a.run.recipe = a.recipe == "loom" ? Recipe::loom : Recipe::megatron;
  return a;
}

GptShape model_of(const std::string& name) {
  if (auto s = model_named(name)) return *s;
  if (name.ends_with(".json") && std::filesystem::exists(name))
    return checkpoint::config_shape(checkpoint::read_config(name), name);
  throw Error(loom::detail::cat("loom-plan: unknown model '", name, "': a config.json, or one of ", model_names()));
}

Cluster cluster_of(const std::string& name) {
  if (auto c = cluster_named(name)) return *c;
  LOOM_CHECK(std::filesystem::exists(name), "loom-plan: unknown cluster '", name, "': a cluster file, or one of ",
             cluster_names);
  std::ifstream in(name);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  LOOM_CHECK(!j.is_discarded() && j.is_object(), "loom-plan: ", name, " is not a JSON object");
  auto base = cluster_named(j.value("base", std::string("h100-80gb")));
  LOOM_CHECK(base.has_value(), "loom-plan: ", name, ": unknown base cluster");
  Cluster c = *base;
  c.name = j.value("name", name);
  c.devices_per_node = j.value("devices_per_node", c.devices_per_node);
  c.memory_bytes = j.value("memory_bytes", c.memory_bytes);
  if (j.contains("peak_flops")) c.peak_flops = j["peak_flops"].get<std::array<double, 3>>();
  c.memory_bandwidth = j.value("memory_bandwidth", c.memory_bandwidth);
  c.matmul_efficiency = j.value("matmul_efficiency", c.matmul_efficiency);
  c.attention_efficiency = j.value("attention_efficiency", c.attention_efficiency);
  c.memory_efficiency = j.value("memory_efficiency", c.memory_efficiency);
  c.launch = j.value("launch", c.launch);
  c.intra = {j.value("intra_bandwidth", c.intra.bandwidth), j.value("intra_latency", c.intra.latency)};
  c.inter = {j.value("inter_bandwidth", c.inter.bandwidth), j.value("inter_latency", c.inter.latency)};
  c.collective_base = j.value("collective_base", c.collective_base);
  c.overlap_efficiency = j.value("overlap_efficiency", c.overlap_efficiency);
  c.shared_threads = j.value("shared_threads", c.shared_threads);
  c.oversubscribed_latency = j.value("oversubscribed_latency", c.oversubscribed_latency);
  c.compute_overhead = j.value("compute_overhead", c.compute_overhead);
  c.usable = j.value("usable", c.usable);
  if (j.contains("speedup")) c.speedup = j["speedup"].get<std::array<double, 3>>();
  return c;
}

//! A cluster as the file cluster_of reads.
void write_cluster(const Cluster& c, const std::string& file) {
  nlohmann::ordered_json j;
  j["name"] = c.name, j["base"] = "cpu", j["devices_per_node"] = c.devices_per_node;
  j["memory_bytes"] = c.memory_bytes, j["peak_flops"] = c.peak_flops, j["memory_bandwidth"] = c.memory_bandwidth;
  j["matmul_efficiency"] = c.matmul_efficiency, j["attention_efficiency"] = c.attention_efficiency;
  j["memory_efficiency"] = c.memory_efficiency, j["launch"] = c.launch;
  j["intra_bandwidth"] = c.intra.bandwidth, j["intra_latency"] = c.intra.latency;
  j["inter_bandwidth"] = c.inter.bandwidth, j["inter_latency"] = c.inter.latency;
  j["collective_base"] = c.collective_base, j["overlap_efficiency"] = c.overlap_efficiency;
  j["shared_threads"] = c.shared_threads, j["speedup"] = c.speedup;
  j["oversubscribed_latency"] = c.oversubscribed_latency, j["compute_overhead"] = c.compute_overhead;
  j["usable"] = c.usable;
  const std::string tmp = file + ".tmp";
  {
    std::ofstream out(tmp);
    LOOM_CHECK(out.good(), "loom-plan: cannot write ", tmp);
    out << j.dump(2) << '\n';
    LOOM_CHECK(out.good(), "loom-plan: writing ", tmp, " failed");
  }
  std::filesystem::rename(tmp, file);
}

constexpr double gib = double(1 << 30);

nlohmann::ordered_json record(const plan::Layout& l, const Run& r, const Memory& m, const StepTime& t, const Cluster& c) {
  nlohmann::ordered_json j;
  j["parallel"] = l.name();
  j["schedule"] = std::string(describe_schedule(l.schedule));
  j["micro_batches"] = r.micro_batches;
  j["recompute"] = std::string(models::describe_recompute(r.recompute));
  j["peak_bytes"] = m.peak;
  j["fits"] = m.peak <= c.memory_bytes;
  j["stage"] = m.stage;
  j["bytes"] = {{"parameters", m.bytes.parameters}, {"gradients", m.bytes.gradients},
                {"optimizer", m.bytes.optimizer},   {"activations", m.bytes.activations},
                {"buffers", m.bytes.buffers},       {"other", m.bytes.other}};
  j["held_bytes"] = {{"parameters", m.held.parameters}, {"gradients", m.held.gradients},
                     {"optimizer", m.held.optimizer}};
  j["step_s"] = t.step;
  j["mfu"] = t.mfu;
  j["tokens_per_s"] = t.tokens_per_s;
  j["time"] = {{"compute", t.compute}, {"tp_comm", t.tp_comm}, {"cp_comm", t.cp_comm}, {"ep_comm", t.ep_comm},
               {"pp_comm", t.pp_comm}, {"bubble", t.bubble},   {"dp_comm", t.dp_comm}, {"optimizer", t.optimizer}};
  return j;
}

void write_json(const std::string& file, const std::vector<nlohmann::ordered_json>& rows) {
  if (file.empty()) return;
  const std::string tmp = file + ".tmp";
  {
    std::ofstream out(tmp);
    LOOM_CHECK(out.good(), "loom-plan: cannot write ", tmp);
    for (const auto& r : rows) out << r.dump() << "\n";
  }
  std::filesystem::rename(tmp, file);
}

void print_one(const GptShape& s, const plan::Layout& l, const Run& r, const Cluster& c, const std::string& json) {
  const std::string why = violation(s, l, r);
  LOOM_CHECK(why.empty(), "loom-plan: ", l.name(), " cannot run this model: ", why);
  const std::vector<Memory> stages = memory_by_stage(s, l, r);
  const Memory m = most_loaded(stages);
  const StepTime t = step_time(s, l, r, c);
  std::printf("loom-plan: %s, %d ranks, %s, recipe %s, batch %d x %d tokens, %d micro-batches per rank, %s, "
              "recompute %s, on %s\n",
              l.name().c_str(), l.world(), describe_dtype(r.dtype).data(), describe_recipe(r.recipe).data(), r.batch,
              r.seq, r.micro_batches, r.sgd ? "sgd" : "adamw", models::describe_recompute(r.recompute).data(),
              c.name.c_str());
  std::printf("memory per rank (the most loaded: pipeline stage %d), GiB:\n", m.stage);
  const std::pair<const char*, double> rows[] = {{"parameters", m.bytes.parameters}, {"gradients", m.bytes.gradients},
                                                 {"optimizer", m.bytes.optimizer},   {"activations", m.bytes.activations},
                                                 {"buffers", m.bytes.buffers},       {"other", m.bytes.other}};
  for (const auto& [n, b] : rows) std::printf("  %-12s %10.3f\n", n, b / gib);
  std::printf("  %-12s %10.3f of %.1f on a device%s\n", "peak", m.peak / gib, c.memory_bytes / gib,
              m.peak > c.memory_bytes ? ": does not fit" : "");
  // The same figures as train_gpt's closing report gives them: each use's peak, the largest over the ranks (here over
  // the pipeline's stages), in the ledger's words, MiB to 3 places.
  Bytes most, held;
  for (const Memory& st : stages) most = most.max(st.bytes), held = held.max(st.held);
  // In the ledger's words and rounding (train_gpt prints the same two lines).
  auto by_use = [](std::initializer_list<std::pair<const char*, double>> ledger) {
    std::string uses;
    for (const auto& [n, b] : ledger) {
      if (b <= 0) continue;
      char buf[32];
      const auto e = std::to_chars(buf, buf + sizeof buf, std::round(b / double(1 << 20) * 1000) / 1000);
      uses += loom::detail::cat(uses.empty() ? "" : ", ", n, " ", std::string(buf, e.ptr));
    }
    return uses;
  };
  std::printf("loom-plan: peak per rank by use, MiB: %s\n",
              by_use({{"parameters", most.parameters}, {"gradients", most.gradients},
                      {"optimizer state", most.optimizer}, {"activations", most.activations},
                      {"communication buffers", most.buffers}, {"other", most.other}})
                  .c_str());
  std::printf("loom-plan: held between steps per rank, MiB: %s\n",
              by_use({{"parameters", held.parameters}, {"gradients", held.gradients},
                      {"optimizer state", held.optimizer}})
                  .c_str());
  std::printf("loom-plan: peak_bytes %.0f\n", m.peak);
  std::printf("step time %.4f s: compute %.4f, tp %.4f, cp %.4f, ep %.4f, pp %.4f, bubble %.4f, dp %.4f, "
              "optimizer %.4f\n",
              t.step, t.compute, t.tp_comm, t.cp_comm, t.ep_comm, t.pp_comm, t.bubble, t.dp_comm, t.optimizer);
  std::printf("%.0f tokens/s, MFU %.1f%%\n", t.tokens_per_s, 100 * t.mfu);
  write_json(json, {record(l, r, m, t, c)});
  if (m.peak > c.memory_bytes) {
    const auto [name, bytes] = m.largest();
    throw Error(loom::detail::cat("loom-plan: ", l.name(), " does not fit: ", bytes / gib, " GiB of ", name, " in ",
                                  m.peak / gib, " GiB on a ", c.memory_bytes / gib, " GiB device"));
  }
}

void search(const GptShape& s, const Args& a, const Cluster& c) {
  LOOM_CHECK(a.gpus >= 1, "loom-plan: --search needs --gpus N");
  const auto t0 = std::chrono::steady_clock::now();
  std::map<std::string, std::pair<int, std::string>> rejected;  // reason -> count, an example
  int tried = 0;
  SearchOptions o;
  o.micro_batch_size = a.micro_given ? 0 : 1;
  o.megatron_layouts = a.run.recipe == Recipe::megatron;
  const std::vector<Candidate> ok = plan::search(s, a.run, c, a.gpus, o, tried, [&](const std::string& why,
                                                                                      const plan::Layout& l) {
    auto& [n, example] = rejected[why];
    if (n++ == 0) example = l.name();
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("loom-plan: %d layouts of %d GPUs on %s tried in %.3f s: %zu fit, %d rejected\n", tried, a.gpus,
              c.name.c_str(), secs, ok.size(), tried - int(ok.size()));
  std::printf("%-4s %-34s %-10s %-9s %10s %10s %8s %12s\n", "rank", "parallel", "recompute", "micro", "peak GiB",
              "step s", "MFU %", "tokens/s");
  for (std::size_t i = 0; i < ok.size() && int(i) < a.top; ++i) {
    const Candidate& f = ok[i];
    std::printf("%-4zu %-34s %-10s %-9d %10.2f %10.4f %8.1f %12.0f\n", i + 1, f.l.name().c_str(),
                models::describe_recompute(f.r.recompute).data(), f.r.micro_batches, f.m.peak / gib, f.t.step,
                100 * f.t.mfu, f.t.tokens_per_s);
  }
  std::printf("rejected:\n");
  for (const auto& [why, v] : rejected) std::printf("  %6d  %s (e.g. %s)\n", v.first, why.c_str(), v.second.c_str());
  std::vector<nlohmann::ordered_json> rows;
  for (const Candidate& f : ok) rows.push_back(record(f.l, f.r, f.m, f.t, c));
  write_json(a.json, rows);
  LOOM_CHECK(!ok.empty(), "loom-plan: no layout of ", a.gpus, " GPUs fits ", a.model, " on ", c.name);
}

//! The planner against every published row: each row's error, then per kind (step time or throughput; memory) the
//! mean and worst, and Korthikanti et al.'s iteration times beside Calculon's errors on the same runs. Fails (exit
//! status 1) where a time row is more than 10% off, their mean more than 5%, or a memory row more than 5%.
bool validate(const std::string& json, const std::optional<Cluster>& instead) {
  const Cluster* other = instead ? &*instead : nullptr;
  struct Errors {
    double sum = 0, worst = 0;
    int n = 0;
    void add(double e) { sum += std::fabs(e), worst = std::max(worst, std::fabs(e)), ++n; }
    double mean() const { return n ? sum / n : 0; }
  } time, mem_err, t5;
  std::vector<nlohmann::ordered_json> rows;
  std::printf("%-20s %-14s %-30s %-10s %10s %10s %8s\n", "source", "model", "parallel", "recompute", "published",
              "predicted", "error");
  for (const PublishedRun& p : published_runs()) {
    const double pred = predicted_figure(p, other), err = pred / p.value - 1;
    const bool mem = p.figure == PublishedRun::Figure::state_gib || p.figure == PublishedRun::Figure::activations_gib;
    (mem ? mem_err : time).add(err);
    if (p.source == "Korthikanti 2022 T5") t5.add(err);
    const char* unit = p.figure == PublishedRun::Figure::seconds ? "s" : mem ? "GiB" : "TF/s";
    std::printf("%-20s %-14s %-30s %-10s %8.2f %-4s %8.2f %+7.1f%%\n", p.source.data(), p.model.data(),
                p.layout.data(), models::describe_recompute(p.recompute).data(), p.value, unit, pred, 100 * err);
    nlohmann::ordered_json j;
    j["source"] = std::string(p.source), j["model"] = std::string(p.model), j["parallel"] = std::string(p.layout);
    j["published"] = p.value, j["predicted"] = pred, j["error"] = err, j["unit"] = unit;
    rows.push_back(j);
  }
  std::printf("step time and throughput: mean absolute error %.2f%%, worst %.2f%% over %d runs\n",
              100 * time.mean(), 100 * time.worst, time.n);
  std::printf("memory: mean absolute error %.2f%%, worst %.2f%% over %d figures\n", 100 * mem_err.mean(),
              100 * mem_err.worst, mem_err.n);
  std::printf("Korthikanti et al. Table 5: mean %.2f%%, worst %.2f%% over %d runs (Calculon: 3.65%%, 8.87%%)\n",
              100 * t5.mean(), 100 * t5.worst, t5.n);
  // Search: each run's own layout against the fastest the planner finds among the layouts of its GPU count, with
  // the run's batch, micro-batch size and recomputation and the techniques it used (no ZB-V before 2024; no
  // distributed optimizer in 2021; sequence and context parallelism only where the run used them).
  std::printf("\n%-20s %-14s %-30s %-34s %8s\n", "source", "model", "parallel", "the planner's fastest", "gap");
  int near = 0, searched = 0;
  for (const PublishedRun& p : published_runs()) {
    if (p.figure == PublishedRun::Figure::state_gib || p.figure == PublishedRun::Figure::activations_gib) continue;
    const GptShape s = *model_named(p.model);
    const plan::Layout pl = layout_named(p.layout);
    const Run r = run_of(p, pl);
    const Cluster c = cluster_of_run(p, other);
    SearchOptions o;
    o.every_recompute = false, o.micro_batch_size = p.micro_batch_size, o.max_cp = pl.cp, o.megatron_layouts = true;
    o.overlap_without_pipeline = r.fp16_grads;  // 2021: PyTorch's DDP without a pipeline, Megatron's with one
    o.schedules = {Schedule::one_f_one_b, Schedule::interleaved};
    const bool llama = p.source.starts_with("Llama");
    o.zero_stages = llama ? std::vector<int>{2} : std::vector<int>{0};  // Llama 3's FSDP: ZeRO-2's sharding
    if (llama) o.chunks = {2, 4, 8};  // a stage's chunks of one block each, or of 2 or 4
    // Sequence parallelism came in 2022, and a run that did without it (Korthikanti et al.'s baselines) is searched
    // among the layouts without it: the question is whether the planner finds the run's layout for its techniques.
    o.sequence_parallel = pl.sp;
    int tried = 0;
    const std::vector<Candidate> found = plan::search(s, r, c, pl.world(), o, tried);
    ++searched;
    if (found.empty()) {
      std::printf("%-20s %-14s %-30s %-34s\n", p.source.data(), p.model.data(), p.layout.data(),
                  "(no layout fits the planner's memory)");
      continue;
    }
    const Memory pm = memory(s, pl, r, false);
    if (pm.peak > c.memory_bytes) {  // the planner's memory model has no room for the published layout
      std::printf("%-20s %-14s %-30s %-34s %8s (its %s: %.1f of %.1f GiB)\n", p.source.data(), p.model.data(),
                  p.layout.data(), found.front().l.name().c_str(), "no fit", pm.largest().first.data(),
                  pm.peak / gib, c.memory_bytes / gib);
      continue;
    }
    const double gap = step_time(s, pl, r, c).step / found.front().t.step - 1;
    near += gap <= 0.05;
    std::printf("%-20s %-14s %-30s %-34s %+7.1f%%\n", p.source.data(), p.model.data(), p.layout.data(),
                found.front().l.name().c_str(), 100 * gap);
  }
  std::printf("search: the published layout within 5%% of the planner's fastest in %d of %d runs\n", near, searched);
  write_json(json, rows);
  const bool ok = time.worst <= 0.10 && time.mean() <= 0.05 && mem_err.worst <= 0.05;
  if (!ok)
    std::fprintf(stderr, "loom-plan: --validate: the planner is off its targets (each time within 10%%, their mean "
                         "within 5%%, memory within 5%%)\n");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    if (!a.calibrate_mpi.empty()) return loom_plan::calibrate_mpi_child(argc, argv, a.calibrate_mpi);
    if (!a.calibrate.empty()) {
      Cluster c = loom_plan::calibrate(argv[0], stdout);
      // This machine's memory, for --search and fits.
      c.memory_bytes = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
      write_cluster(c, a.calibrate);
      std::printf("loom-plan: wrote %s (use it as --cluster %s)\n", a.calibrate.c_str(), a.calibrate.c_str());
      return 0;
    }
    if (a.validate) {
      // --cluster FILE: a cluster file whose name is a built-in cluster's stands for it in the rows run there.
      std::optional<Cluster> instead;
      if (!a.cluster.empty() && !cluster_named(a.cluster)) instead = cluster_of(a.cluster);
      return validate(a.json, instead) ? 0 : 1;
    }
    LOOM_CHECK(!a.model.empty(), "loom-plan: --model is required\n", usage);
    const GptShape s = model_of(a.model);
    const Cluster c = cluster_of(a.cluster);
    if (a.search) {
      search(s, a, c);
      return 0;
    }
    const plan::Layout l = layout_named(a.parallel.empty() ? "single" : a.parallel, a.schedule);
    LOOM_CHECK(a.gpus == 0 || a.gpus == l.world(), "loom-plan: --parallel ", l.name(), " has ", l.world(),
               " ranks but --gpus says ", a.gpus);
    print_one(s, l, a.run, c, a.json);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

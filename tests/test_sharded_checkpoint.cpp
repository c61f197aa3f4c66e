// Sharded checkpoints: boxes cut and meet as their elements say; a run resumed from a checkpoint on another layout
// (tensor, pipeline, data parallelism, ZeRO, one rank) gives the losses of the uninterrupted run (f64, 1e-9), the
// same layout bit for bit (f32 too); nothing is written twice; bad checkpoints are refused with the file and tensor.
#include "catch.hpp"

#include <loom/checkpoint/sharded.hpp>
#include <loom/checkpoint/snapshots.hpp>
#include <loom/checkpoint/trainer.hpp>
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/models/gpt.hpp>
#include <loom/models/gpt/export.hpp>
#include <loom/optim/optimizers.hpp>

#include "temp_dir.hpp"

#include <cmath>
#include <fstream>
#include <set>

using namespace loom;
using loom::checkpoint::Box;

namespace {

// -- boxes ---------------------------------------------------------------------------------------------------------

//! Every element of box b as global coordinates, in b's row-major order.
std::vector<std::vector<std::int64_t>> elements(const Box& b) {
  std::vector<std::vector<std::int64_t>> out;
  checkpoint::for_each_row(b, [&](const std::vector<std::int64_t>& at, std::int64_t len) {
    for (std::int64_t i = 0; i < len; ++i) {
      auto e = at;
      e.back() += i;
      out.push_back(e);
    }
  });
  if (b.sizes.empty()) out.assign(1, {});
  return out;
}

TEST_CASE("a window of a box is cut into boxes that hold exactly its elements, in order", "[checkpoint][sharded]") {
  for (const Box& b : {Box{{2, 1, 0}, {3, 4, 5}}, Box{{0, 3}, {4, 6}}, Box{{7}, {9}}}) {
    const auto all = elements(b);
    REQUIRE(all.size() == static_cast<std::size_t>(b.numel()));
    for (std::int64_t lo = 0; lo <= b.numel(); ++lo)
      for (std::int64_t hi = lo; hi <= b.numel(); ++hi) {
        std::vector<std::vector<std::int64_t>> got;
        int boxes = 0;
        checkpoint::split_window(b, lo, hi, [&](const Box& part) {
          ++boxes;
          for (auto& e : elements(part)) got.push_back(e);
        });
        INFO("window [" << lo << ", " << hi << ") of a box of " << b.numel());
        REQUIRE(got == std::vector<std::vector<std::int64_t>>(all.begin() + lo, all.begin() + hi));
        CHECK(boxes <= 2 * static_cast<int>(b.sizes.size()) - 1);
      }
  }
}

TEST_CASE("boxes meet in the elements both hold", "[checkpoint][sharded]") {
  const Box a{{0, 2}, {4, 5}}, b{{3, 0}, {3, 4}};
  const auto m = checkpoint::intersect(a, b);
  REQUIRE(m);
  CHECK(*m == Box{{3, 2}, {1, 2}});
  CHECK_FALSE(checkpoint::intersect(a, Box{{4, 0}, {1, 9}}));
  CHECK(checkpoint::flat_in(a, {1, 3}) == 6);
}

TEST_CASE("a layout's runs as boxes place every element where the layout puts it", "[checkpoint][sharded]") {
  // A [6, 8] weight split by columns into q, k, v segments over 2 ranks, and a replicated [5] bias.
  for (int r = 0; r < 2; ++r) {
    const Layout l({6, 8}, 1, {{1, 2}, {2, 3}}, 2, r);  // 1 unit of 2 columns (shared), 2 units of 3 (split)
    std::vector<double> global(48), local(static_cast<std::size_t>(l.local_numel()), -1);
    for (std::size_t i = 0; i < global.size(); ++i) global[i] = double(i);
    l.scatter(global.data(), local.data());
    for (const auto& run : checkpoint::run_boxes(l)) {
      std::int64_t k = 0;
      for (const auto& e : elements(run.box)) {
        CHECK(local[std::size_t(run.local(k))] == global[std::size_t(e[0] * 8 + e[1])]);
        ++k;
      }
      CHECK(checkpoint::first_holder(l, run, r) == (run.replicas == 1 || r == 0));
    }
  }
}

// -- resuming on another layout ------------------------------------------------------------------------------------

constexpr models::GptShape shape{8, 4, 2, 16, 37, 8};
constexpr int batch = 16, seq = 8;

train::Batches data() {
  std::vector<std::int32_t> tok(3000);
  for (std::size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<std::int32_t>((i * i + 3 * i) % shape.vocab);
  return train::Batches(tok, batch, seq, train::BatchOrder::shuffle, 11);
}

train::TrainerOptions<models::GptOptions> options(int micro_batches) {
  train::TrainerOptions<models::GptOptions> o;
  o.seed = 3;
  o.model.dropout = 0.1f;
  o.step.batch = batch, o.step.seq = seq, o.step.micro_batches = micro_batches, o.step.lr = 1e-2;
  o.step.grad_clip = 1.0;
  return o;
}

//! Trains steps [from, to) on layout Cfg, first loading `load` (a checkpoint root) when given and saving into `save`
//! at the end when given; the losses.
template <class Cfg, class T = double>
std::vector<double> train_on(int from, int to, int micro_batches, const std::string& load, const std::string& save) {
  using Model = models::Gpt<shape, T, models::ModelLayout<Cfg>>;
  using AdamW = optim::AdamW<T>;
  const auto d = data();
  std::vector<double> losses;
  run_local<Cfg>([&](auto& ctx) {
    train::Trainer<Cfg, Model, AdamW> trainer(ctx, d, options(micro_batches), [](const auto& specs, auto n) {
      return AdamW(specs, n, {0.9, 0.999, 1e-8, 0.1});
    });
    if (!load.empty()) {
      const int next = checkpoint::load_sharded(load, trainer);
      if (next != from) throw Error(loom::detail::cat("the checkpoint continues at step ", next, ", not ", from));
    }
    for (int s = from; s < to; ++s) {
      const auto r = trainer.step(s);
      if (ctx.rank() == 0) losses.push_back(r.loss);
    }
    if (!save.empty()) checkpoint::save_sharded(save, trainer, to, "test", {{"seed", 3}});
  });
  return losses;
}

//! 10 steps on X straight, against 5 on X, a checkpoint, and 5 on Y resumed from it.
template <class X, class Y, class T = double>
void check_resume(int micro_x, int micro_y, double tolerance) {
  test::TempDir dir("sharded");
  const auto straight = train_on<X, T>(0, 10, micro_x, "", "");
  const auto first = train_on<X, T>(0, 5, micro_x, "", dir.path().string());
  const auto resumed = train_on<Y, T>(5, 10, micro_y, dir.path().string(), "");
  REQUIRE(straight.size() == 10);
  REQUIRE(resumed.size() == 5);
  for (int i = 0; i < 5; ++i) {
    INFO("step " << i << ": " << first[std::size_t(i)] << " against " << straight[std::size_t(i)]);
    CHECK(first[std::size_t(i)] == straight[std::size_t(i)]);
  }
  for (int i = 0; i < 5; ++i) {
    const double a = straight[std::size_t(i + 5)], b = resumed[std::size_t(i)];
    INFO("step " << i + 5 << ": straight " << a << ", resumed " << b);
    if (tolerance == 0) CHECK(a == b);
    else CHECK(std::abs(a - b) <= tolerance * std::abs(a));
  }
}

}  // namespace

TEST_CASE("resuming on the same layout repeats the run bit for bit, f32 and f64", "[checkpoint][sharded]") {
  using L = Parallel<TP<2>, PP<2>, DP<2>>;
  check_resume<L, L, float>(2, 2, 0);
  using Z = Parallel<DP<4, ZeRO<3>>>;
  check_resume<Z, Z, double>(1, 1, 0);
}

TEST_CASE("tp2 pp2 dp2 resumes as dp4 with ZeRO-3", "[checkpoint][sharded]") {
  check_resume<Parallel<TP<2>, PP<2>, DP<2>>, Parallel<DP<4, ZeRO<3>>>>(2, 1, 1e-9);
}

TEST_CASE("dp8 with ZeRO-1 resumes as tp4 dp2", "[checkpoint][sharded]") {
  check_resume<Parallel<DP<8, ZeRO<1>>>, Parallel<TP<4>, DP<2>>>(1, 1, 1e-9);
}

TEST_CASE("pp4 with the ZB-V schedule resumes on one rank", "[checkpoint][sharded]") {
  check_resume<Parallel<PP<4, ZeroBubbleV>>, Parallel<>>(4, 1, 1e-9);
}

TEST_CASE("one rank resumes as tp2 with sequence parallelism, pp2, dp2", "[checkpoint][sharded]") {
  check_resume<Parallel<>, Parallel<TP<2, SequenceParallel>, PP<2>, DP<2>>>(1, 2, 1e-9);
}

TEST_CASE("a checkpoint holds each element once and its files hold nothing else", "[checkpoint][sharded]") {
  test::TempDir dir("sharded");
  using L = Parallel<TP<2>, PP<2>, DP<2, ZeRO<1>>>;
  train_on<L>(0, 1, 2, "", dir.path().string());
  const auto ckpt = checkpoint::resolve_checkpoint(dir.path().string());
  const auto ix = checkpoint::read_index(ckpt);
  CHECK(ix.next_step == 1);
  CHECK(ix.optimizer == "adamw");
  // Parameters, two moments: the whole model's elements three times, in f64.
  std::uint64_t elements = 0, bytes = 0;
  for (const auto& [name, t] : ix.tensors) {
    std::int64_t n = 0;
    for (const auto& c : t.chunks) n += c.box.numel();
    INFO(name);
    CHECK(n == numel_of(t.shape));  // with no chunk twice: the chunks hold the tensor exactly
    elements += static_cast<std::uint64_t>(n);
  }
  CHECK(elements == 3 * static_cast<std::uint64_t>(shape.params()));
  std::uint64_t data = 0;
  for (const auto& [file, size] : ix.files) {
    bytes += size;
    CHECK(std::filesystem::file_size(ckpt + "/" + file) == size);
  }
  for (const auto& [name, t] : ix.tensors)
    for (const auto& c : t.chunks) data += c.bytes;
  CHECK(data == elements * sizeof(double));
  CHECK(bytes > data);  // and the files' safetensors headers
  CHECK(bytes < data + 8 * 64 * 1024);
}

TEST_CASE("a corrupt, truncated or missing shard, a newer format, another model are refused", "[checkpoint][sharded]") {
  test::TempDir dir("sharded");
  using L = Parallel<TP<2>, DP<2>>;
  train_on<L>(0, 1, 1, "", dir.path().string());
  const auto ckpt = checkpoint::resolve_checkpoint(dir.path().string());
  const std::string file = ckpt + "/rank-00001.safetensors";
  auto load_error = [&] {
    try {
      train_on<L>(1, 1, 1, dir.path().string(), "");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  REQUIRE(load_error().empty());
  const auto original = [&] {
    std::ifstream f(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }();
  auto write = [&](const std::string& bytes) {
    std::ofstream f(file, std::ios::binary | std::ios::trunc);
    f << bytes;
  };
  {  // one flipped byte in the last tensor's data
    std::string bad = original;
    bad[bad.size() - 3] ^= 0x5a;
    write(bad);
    const auto e = load_error();
    CHECK_THAT(e, Catch::Contains("rank-00001.safetensors") && Catch::Contains("is corrupt") &&
                      Catch::Contains("tensor '"));
  }
  {
    write(original.substr(0, original.size() - 100));
    const auto e = load_error();
    CHECK_THAT(e, Catch::Contains("rank-00001.safetensors is truncated: it holds") && Catch::Contains("tensor '") &&
                      Catch::Contains("the checkpoint is damaged"));
  }
  {
    std::filesystem::remove(file);
    const auto e = load_error();
    CHECK_THAT(e, Catch::Contains("rank-00001.safetensors is missing"));
  }
  write(original);
  REQUIRE(load_error().empty());
  const std::string index = ckpt + "/index.json";
  const auto text = [&] {
    std::ifstream f(index);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }();
  auto edit = [&](auto&& change) {
    auto j = nlohmann::json::parse(text);
    change(j);
    std::ofstream(index, std::ios::trunc) << j.dump();
  };
  edit([](auto& j) { j["version"] = 7; });
  CHECK_THAT(load_error(), Catch::Contains("format version 7, newer than this build reads (1)"));
  edit([](auto& j) { j["model"]["n_embd"] = 32; });
  CHECK_THAT(load_error(), Catch::Contains("holds a model with n_embd = 32, this run's has 16"));
  edit([](auto& j) {  // a chunk said to lie beyond the end of its file
    auto& c = j["tensors"]["wpe.weight"]["chunks"][0];
    c["offset"] = j["files"][c["file"].template get<std::string>()].template get<std::uint64_t>() - 8;
  });
  CHECK_THAT(load_error(), Catch::Contains("tensor 'wpe.weight'") && Catch::Contains("which holds"));
  edit([](auto& j) { j["tensors"]["ln_f.bias"]["chunks"] = nlohmann::json::array(); });
  CHECK_THAT(load_error(), Catch::Contains("tensor 'ln_f.bias' holds 0 of the 16 elements"));
}

TEST_CASE("a sharded checkpoint exports the Hugging Face file the whole model writes, and verifies",
          "[checkpoint][sharded]") {
  test::TempDir dir("sharded");
  using Cfg = Parallel<TP<2>, PP<2>, DP<2, ZeRO<1>>>;
  using Model = models::Gpt<shape, double, models::ModelLayout<Cfg>>;
  using AdamW = optim::AdamW<double>;
  const auto d = data();
  const std::string sharded = dir / "sharded", whole = dir / "whole", hf = dir / "hf";
  run_local<Cfg>([&](auto& ctx) {
    train::Trainer<Cfg, Model, AdamW> trainer(ctx, d, options(2), [](const auto& specs, auto n) {
      return AdamW(specs, n, {0.9, 0.999, 1e-8, 0.1});
    });
    trainer.step(0);
    checkpoint::save_sharded(sharded, trainer, 1, "tp2.pp2.dp2.zero1");
    checkpoint::save_training(whole, trainer, 1, ctx.rank() == 0);
  });
  checkpoint::export_hf(sharded, hf);
  const auto want = checkpoint::read_safetensors(whole + "/model.safetensors");
  const auto got = checkpoint::read_safetensors(hf + "/model.safetensors");
  REQUIRE(got.size() == want.size());
  for (const auto& [name, t] : want) {
    INFO(name);
    REQUIRE(got.count(name) == 1);
    CHECK(got.at(name).shape == t.shape);
    CHECK(got.at(name).bytes == t.bytes);
  }
  CHECK(std::filesystem::exists(hf + "/config.json"));
  const auto ckpt = checkpoint::resolve_checkpoint(sharded);
  CHECK(checkpoint::verify_sharded(ckpt) == 3 * static_cast<std::uint64_t>(shape.params()) * sizeof(double));
  {  // a flipped byte in the middle of rank 3's file
    const std::string file = ckpt + "/rank-00003.safetensors";
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<std::streamoff>(std::filesystem::file_size(file));
    f.seekg(size - 40);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x21);
    f.seekp(size - 40);
    f.write(&c, 1);
  }
  CHECK_THROWS_WITH(checkpoint::verify_sharded(ckpt),
                    Catch::Contains("rank-00003.safetensors: tensor '") && Catch::Contains("is corrupt"));
}

//! The layout the background saves and the snapshots are tested on: tp2 dp2 with ZeRO-1, f32, AdamW.
struct Tp2Dp2Zero1 {
  using Cfg = Parallel<TP<2>, DP<2, ZeRO<1>>>;
  using Model = models::Gpt<shape, float, models::ModelLayout<Cfg>>;
  using AdamW = optim::AdamW<float>;
  //! Nine steps straight: what a run that saves or snapshots and resumes must repeat.
  static std::vector<double> straight() { return train_on<Cfg, float>(0, 9, 1, "", ""); }
};

TEST_CASE("checkpoints written in the background resume bit for bit; latest moves once one is whole",
          "[checkpoint][sharded]") {
  test::TempDir dir("sharded");
  using Cfg = Tp2Dp2Zero1::Cfg;
  using Model = Tp2Dp2Zero1::Model;
  using AdamW = Tp2Dp2Zero1::AdamW;
  const auto straight = Tp2Dp2Zero1::straight();
  const auto d = data();
  const std::string root = dir.path().string();
  auto latest = [&] {
    std::ifstream f(root + "/latest");
    std::string s;
    std::getline(f, s);
    return s;
  };
  std::vector<std::string> seen;  // what `latest` named after each save, and after finish
  int saves = 0;
  run_local<Cfg>([&](auto& ctx) {
    train::Trainer<Cfg, Model, AdamW> trainer(ctx, d, options(1), [](const auto& specs, auto n) {
      return AdamW(specs, n, {0.9, 0.999, 1e-8, 0.1});
    });
    checkpoint::CheckpointWriter writer(root, {.asynchronous = true, .keep = 2});
    for (int s = 0; s < 6; ++s) {
      trainer.step(s);
      if ((s + 1) % 2) continue;
      writer.save(trainer, s + 1, "tp2.dp2.zero1");
      trainer.barrier();
      if (ctx.rank() == 0) seen.push_back(latest());
      trainer.barrier();
    }
    writer.finish(trainer);
    if (ctx.rank() == 0) seen.push_back(latest()), saves = writer.saves();
    CHECK(writer.blocked_seconds() >= 0);
    CHECK(rank_memory().in_use(MemoryUse::checkpoint) == 0);  // the snapshot's host copy is freed once written
    CHECK(rank_memory().peak(MemoryUse::checkpoint) > 0);
  });
  // A save puts the previous one in place as it begins; finish puts the last.
  CHECK(seen == std::vector<std::string>{"", "step-00000002", "step-00000004", "step-00000006"});
  CHECK(saves == 3);
  CHECK_FALSE(std::filesystem::exists(root + "/step-00000002"));  // --keep 2
  CHECK(std::filesystem::exists(root + "/step-00000004/index.json"));
  const auto resumed = train_on<Cfg, float>(6, 9, 1, root, "");
  REQUIRE(resumed.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(resumed[std::size_t(i)] == straight[std::size_t(i + 6)]);
}

TEST_CASE("snapshot peers are in another failure domain: another host, else another process", "[checkpoint][snapshot]") {
  using checkpoint::Place;
  // Two hosts of two processes: a rank sends to the same place on the other host.
  const auto two = checkpoint::snapshot_peers({{"a", 1}, {"a", 2}, {"b", 3}, {"b", 4}});
  CHECK(two.peer == std::vector<int>{2, 3, 0, 1});
  CHECK(two.domain == std::vector<std::string>{"domain-a", "domain-a", "domain-b", "domain-b"});
  CHECK(two.separate);
  CHECK(two.senders(0) == std::vector<int>{2});
  // One host, three processes (one of them two ranks): each process's ranks send to the next process.
  const auto procs = checkpoint::snapshot_peers({{"a", 7}, {"a", 7}, {"a", 8}, {"a", 9}});
  CHECK(procs.peer == std::vector<int>{2, 2, 3, 0});
  CHECK(procs.domain[1] == "domain-a-7");
  CHECK(procs.senders(2) == std::vector<int>{0, 1});
  // Threads of one process: the next rank, in the same domain; one rank: no peer.
  const auto threads = checkpoint::snapshot_peers({{"a", 5}, {"a", 5}, {"a", 5}});
  CHECK(threads.peer == std::vector<int>{1, 2, 0});
  CHECK_FALSE(threads.separate);
  CHECK(checkpoint::snapshot_peers({{"a", 5}}).peer == std::vector<int>{-1});
}

TEST_CASE("in-memory snapshots resume bit for bit; a damaged or lost image is replaced by its peer's copy, else an "
          "older snapshot is taken", "[checkpoint][snapshot]") {
  test::TempDir dir("snapshots");
  using L = Tp2Dp2Zero1;
  const auto straight = L::straight();
  const auto d = data();
  const std::string store = (dir.path() / "store").string();
  std::vector<int> complete;  // after each snapshot, the newest complete one
  run_local<L::Cfg>([&](auto& ctx) {
    train::Trainer<L::Cfg, L::Model, L::AdamW> trainer(ctx, d, options(1), [](const auto& specs, auto n) {
      return L::AdamW(specs, n, {0.9, 0.999, 1e-8, 0.1});
    });
    checkpoint::SnapshotKeeper keeper(store, ctx.world());
    CHECK(keeper.peers().peer[std::size_t(ctx.rank())] == (ctx.rank() + 1) % 4);
    for (int s = 0; s < 6; ++s) {
      trainer.step(s);
      if ((s + 1) % 2) continue;
      keeper.take(trainer, ctx.world(), s + 1, "tp2.dp2.zero1", {{"seed", 3}});
      if (ctx.rank() == 0) complete.push_back(keeper.complete());
    }
    keeper.wait(ctx.world());
    if (ctx.rank() == 0) complete.push_back(keeper.complete());
    CHECK(rank_memory().in_use(MemoryUse::checkpoint) > 0);  // the images stay for the next snapshot
  });
  CHECK(complete == std::vector<int>{-1, 2, 4, 6});
  namespace fs = std::filesystem;
  const fs::path domain = fs::path(store) / ("domain-" + checkpoint::detail::host_name() + "-" +
                                             std::to_string(::getpid()));
  CHECK_FALSE(fs::exists(domain / "step-00000002"));  // older than the newest complete one when step 6 was taken
  REQUIRE(fs::exists(domain / "step-00000006/rank-00001.copy.safetensors"));
  auto resumed_from = [&](const checkpoint::FoundSnapshot& found) {
    REQUIRE(found.step >= 0);
    return train_on<L::Cfg, float>(found.step, 9, 1, found.dir, "");
  };
  const auto newest = checkpoint::find_snapshot(store);
  CHECK(newest.step == 6);
  CHECK(newest.notes.empty());
  const auto resumed = resumed_from(newest);
  REQUIRE(resumed.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(resumed[std::size_t(i)] == straight[std::size_t(i + 6)]);
  // Rank 1's own image damaged: its copy (written by rank 2) is taken, and the run goes on the same.
  {
    std::fstream f(domain / "step-00000006/rank-00001.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x5a');
  }
  const auto repaired = checkpoint::find_snapshot(store);
  CHECK(repaired.step == 6);
  REQUIRE(repaired.notes.size() == 2);
  CHECK_THAT(repaired.notes[0], Catch::Contains("snapshot step 6: rank 1's image") &&
                                    Catch::Contains("rank-00001.safetensors is corrupt: tensor"));
  CHECK_THAT(repaired.notes[1], Catch::Contains("snapshot step 6: rank 1's state is taken from its peer's copy") &&
                                    Catch::Contains("rank-00001.copy.safetensors"));
  CHECK(resumed_from(repaired) == resumed);
  // Its copy gone as well: step 6 is lost, step 4 is whole.
  fs::remove(domain / "step-00000006/rank-00001.copy.json");
  const auto older = checkpoint::find_snapshot(store);
  CHECK(older.step == 4);
  CHECK_THAT(older.notes.back(), Catch::Contains("snapshot step 6: rank 1's state is lost (no copy is whole)"));
  const auto from4 = resumed_from(older);
  REQUIRE(from4.size() == 5);
  for (int i = 0; i < 5; ++i) CHECK(from4[std::size_t(i)] == straight[std::size_t(i + 4)]);
  fs::remove_all(domain / "step-00000004");
  CHECK(checkpoint::find_snapshot(store).step == -1);
}

TEST_CASE("a rank loading a checkpoint holds its own part and one checksum block of the files",
          "[checkpoint][sharded]") {
  // Saved in place with 4 KiB blocks by one rank, which copies one chunk at a time (at most a whole tensor); loaded
  // by dp4 with ZeRO-3, whose ranks each hold a quarter of the model and of the optimizer state: a rank's peak over
  // the load is what it held before plus at most one block.
  test::TempDir dir("sharded");
  using One = Parallel<>;
  using Cfg = Parallel<DP<4, ZeRO<3>>>;
  using AdamW = optim::AdamW<double>;
  constexpr std::int64_t block = 4096;
  std::size_t save_buffers = 0;
  const auto d = data();
  const std::string root = dir.path().string();
  run_local<One>([&](auto& ctx) {
    train::Trainer<One, models::Gpt<shape, double, models::ModelLayout<One>>, AdamW> trainer(
        ctx, d, options(1), [](const auto& specs, auto n) { return AdamW(specs, n, {0.9, 0.999, 1e-8, 0.1}); });
    trainer.step(0);
    checkpoint::save_sharded(root, trainer, 1, "single", nullptr, {.block = block});
    save_buffers = rank_memory().peak(MemoryUse::checkpoint);
  });
  const std::uint64_t model_bytes = 3 * static_cast<std::uint64_t>(shape.params()) * sizeof(double);
  REQUIRE(model_bytes > 16 * block);  // the whole model would not fit in a rank's part and one block
  std::size_t largest = 0;
  for (const auto& [name, t] : checkpoint::read_index(checkpoint::resolve_checkpoint(root)).tensors)
    largest = std::max(largest, static_cast<std::size_t>(numel_of(t.shape)) * sizeof(double));
  INFO("saving held " << save_buffers << " bytes of checkpoint buffers; the largest tensor has " << largest);
  CHECK(save_buffers > 0);
  CHECK(save_buffers <= largest);
  std::vector<std::size_t> before(4), peak_before(4), after(4), peak(4), buffers(4), own(4);
  run_local<Cfg>([&](auto& ctx) {
    train::Trainer<Cfg, models::Gpt<shape, double, models::ModelLayout<Cfg>>, AdamW> trainer(
        ctx, d, options(1), [](const auto& specs, auto n) { return AdamW(specs, n, {0.9, 0.999, 1e-8, 0.1}); });
    const auto r = static_cast<std::size_t>(ctx.rank());
    before[r] = rank_memory().in_use(), peak_before[r] = rank_memory().peak();
    own[r] = rank_memory().in_use(MemoryUse::parameters) + rank_memory().in_use(MemoryUse::optimizer_state);
    CHECK(checkpoint::load_sharded(root, trainer) == 1);
    after[r] = rank_memory().in_use(), peak[r] = rank_memory().peak();
    buffers[r] = rank_memory().peak(MemoryUse::checkpoint);
  });
  for (std::size_t r = 0; r < 4; ++r) {
    INFO("rank " << r << ": held " << before[r] << " bytes (" << own[r] << " of parameters and state), peak "
                 << peak_before[r] << " before the load and " << peak[r] << " after; checkpoint buffers "
                 << buffers[r]);
    CHECK(own[r] < model_bytes / 2);
    CHECK(after[r] == before[r]);
    CHECK(buffers[r] > 0);
    CHECK(buffers[r] <= static_cast<std::size_t>(block));
    CHECK(peak[r] <= std::max(peak_before[r], before[r] + static_cast<std::size_t>(block)));
  }
}

TEST_CASE("an expert-parallel run saves the whole model and state, and a sharded checkpoint, which one rank and "
          "another expert-parallel layout resume as the run goes on", "[checkpoint][moe]") {
  test::TempDir dir("moe");
  constexpr models::GptShape moe{2, 4, 2, 16, shape.vocab, seq, 0, 4, 2, 1, 24, 1};
  using Cfg = Parallel<DP<2, ZeRO<1>>, EP<2>>;
  using AdamW = optim::AdamW<double>;
  const auto d = data();
  auto opt = [](const auto& specs, auto n) { return AdamW(specs, n, {0.9, 0.999, 1e-8, 0.1}); };
  const std::string whole = dir / "whole", sharded = dir / "sharded";
  std::vector<double> losses(4);
  run_local<Cfg>([&](auto& ctx) {
    train::Trainer<Cfg, models::Gpt<moe, double, models::ModelLayout<Cfg>>, AdamW> trainer(ctx, d, options(1), opt);
    for (int s = 0; s < 4; ++s) {
      const double l = trainer.step(s).loss;
      if (ctx.rank() == 0) losses[std::size_t(s)] = l;
      if (s == 1) checkpoint::save_training(whole, trainer, 2, ctx.rank() == 0);
      if (s == 1) checkpoint::save_sharded(sharded, trainer, 2, "dp2.zero1.ep2");
    }
  });
  // Each expert's tensors are written once, by its expert-data-parallel group: every chunk of them covers what one
  // rank of ep holds, and no tensor is written twice (the index's chunks add up to each tensor's elements).
  for (const auto& [name, t] : checkpoint::read_index(checkpoint::resolve_checkpoint(sharded)).tensors) {
    std::int64_t n = 0;
    for (const auto& c : t.chunks) n += c.box.numel();
    INFO(name);
    CHECK(n == numel_of(t.shape));
  }
  for (const bool from_sharded : {false, true}) {
    int next = -1;
    double resumed = 0;
    run_local<Parallel<>>([&](auto& ctx) {
      train::Trainer<Parallel<>, models::Gpt<moe, double>, AdamW> one(ctx, d, options(1), opt);
      next = from_sharded ? checkpoint::load_sharded(sharded, one) : checkpoint::load_training(whole, one);
      resumed = one.step(2).loss;
    });
    INFO((from_sharded ? "sharded" : "whole"));
    CHECK(next == 2);
    CHECK(resumed == Approx(losses[2]).epsilon(1e-12));
  }
  // On a layout without ZeRO (every rank one expert, the dense parameters replicated over four ranks and each expert
  // over one), which saves again: one rank resumes that too.
  using Other = Parallel<DP<4>, EP<4>>;
  const std::string again = dir / "again";
  std::vector<double> resumed(4);
  run_local<Other>([&](auto& ctx) {
    train::Trainer<Other, models::Gpt<moe, double, models::ModelLayout<Other>>, AdamW> t(ctx, d, options(1), opt);
    CHECK(checkpoint::load_sharded(sharded, t) == 2);
    resumed[std::size_t(ctx.rank())] = t.step(2).loss;
    checkpoint::save_sharded(again, t, 3, "dp4.ep4");
  });
  for (double l : resumed) CHECK(l == Approx(losses[2]).epsilon(1e-12));
  double last = 0;
  run_local<Parallel<>>([&](auto& ctx) {
    train::Trainer<Parallel<>, models::Gpt<moe, double>, AdamW> one(ctx, d, options(1), opt);
    CHECK(checkpoint::load_sharded(again, one) == 3);
    last = one.step(3).loss;
  });
  CHECK(last == Approx(losses[3]).epsilon(1e-12));
  // The checkpoint names its experts: a dense model of the same dimensions does not load it.
  models::Gpt<models::GptShape{2, 4, 2, 16, shape.vocab, seq}, double> dense(3);
  CHECK_THROWS_WITH(checkpoint::load_gpt(whole, dense),
                    "loom: " + whole + "/config.json has num_local_experts = 4 but the model has no experts");
}

// loom-ckpt: reads sharded checkpoints without training.
//   loom-ckpt info CKPT            the layout, step, optimizer, model, and every tensor with its shape, dtype, chunks
//   loom-ckpt verify CKPT          reads every chunk and checks every checksum block
//   loom-ckpt export-hf CKPT OUT   OUT/model.safetensors and OUT/config.json as Hugging Face writes GPT-2
// CKPT is a checkpoint directory (it holds index.json) or a --save root (its `latest` names one). Exit status 0 on
// success, 1 with a message on stderr otherwise, 2 for a wrong command line.
#include <loom/models/gpt/export.hpp>

#include <cstdio>
#include <string>

namespace {

const char* usage =
    "usage: loom-ckpt info CKPT\n"
    "       loom-ckpt verify CKPT\n"
    "       loom-ckpt export-hf CKPT OUT\n"
    "CKPT: a checkpoint directory (with index.json) or the root train_gpt --save wrote (its latest checkpoint)\n";

std::string mib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f MiB", bytes / (1 << 20));
  return b;
}

void info(const std::string& path) {
  using namespace loom;
  const std::string dir = checkpoint::resolve_checkpoint(path);
  const checkpoint::ShardedIndex ix = checkpoint::read_index(dir);
  std::uint64_t file_bytes = 0;
  for (const auto& [f, b] : ix.files) file_bytes += b;
  std::printf("checkpoint %s\n", dir.c_str());
  std::printf("format version %d, next step %d, optimizer %s (step counter %d), written on layout %s\n", ix.version,
              ix.next_step, ix.optimizer.c_str(), ix.counter, ix.layout.c_str());
  std::printf("model %s\n", ix.model.dump().c_str());
  if (!ix.run.is_null()) std::printf("run %s\n", ix.run.dump().c_str());
  std::printf("%zu files, %s; checksum block %lld bytes\n", ix.files.size(), mib(double(file_bytes)).c_str(),
              static_cast<long long>(ix.block));
  std::uint64_t params = 0, state = 0;
  std::size_t chunks = 0;
  for (const auto& [name, t] : ix.tensors) {
    const auto bytes = static_cast<std::uint64_t>(numel_of(t.shape)) * size_of(t.dtype);
    (name.find('/') == std::string::npos ? params : state) += bytes;
    chunks += t.chunks.size();
    std::printf("  %-44s %-5s %-16s %3zu chunk%s %12llu bytes\n", name.c_str(), std::string(name_of(t.dtype)).c_str(),
                to_string(t.shape).c_str(), t.chunks.size(), t.chunks.size() == 1 ? " " : "s",
                static_cast<unsigned long long>(bytes));
  }
  std::printf("%zu tensors in %zu chunks: parameters %s, optimizer state %s\n", ix.tensors.size(), chunks,
              mib(double(params)).c_str(), mib(double(state)).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "-h" || cmd == "--help") {
    std::fputs(usage, stdout);
    return 0;
  }
  const bool ok = (cmd == "info" && argc == 3) || (cmd == "verify" && argc == 3) || (cmd == "export-hf" && argc == 4);
  if (!ok) {
    std::fputs(usage, stderr);
    return 2;
  }
  try {
    if (cmd == "info") {
      info(argv[2]);
    } else if (cmd == "verify") {
      const std::string dir = loom::checkpoint::resolve_checkpoint(argv[2]);
      const std::uint64_t bytes = loom::checkpoint::verify_sharded(dir);
      std::printf("loom-ckpt: %s: every checksum matches (%llu bytes of tensors)\n", dir.c_str(),
                  static_cast<unsigned long long>(bytes));
    } else {
      loom::checkpoint::export_hf(argv[2], argv[3]);
      std::printf("loom-ckpt: wrote %s/model.safetensors and %s/config.json\n", argv[3], argv[3]);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}

// expect: loom: ZeRO's stages are 1, 2 and 3
#include <loom/models/gpt.hpp>
#include <loom/train/trainer.hpp>

using Model = loom::models::GptModel<double, loom::Parallel<>>;
#ifdef LOOM_FAIL
constexpr int stage = 4;
#else
constexpr int stage = 2;
#endif

static_assert(sizeof(loom::train::ShardedDataParallel<Model, loom::comm::LocalComm, stage>) > 0);
int main() {}

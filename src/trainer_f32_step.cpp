// loom::cpu_kernels: the training step over type-erased model parts (train::AnyPart<float, Host>) without a pipeline,
// with AdamW and SGD, under every ZeRO stage, over comm::AnyComm: for programs built with LOOM_EXTERN_KERNELS,
// which <loom/train/step.hpp> declares extern. The kernels it calls are the other objects'.
#define LOOM_EXTERN_KERNELS 1
#include <loom/train/step.hpp>

LOOM_TRAINER_CORES(, float, false)

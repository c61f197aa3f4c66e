// Where memory and computation live: the device tags Tensor<T, Device>, the kernels' Ops<Device> and the models
// take. Device-neutral: nothing here needs a device's runtime.
#pragma once

namespace loom {

struct Host {
  static constexpr const char* name = "host";
};
struct Cuda {
  static constexpr const char* name = "cuda";
};

}  // namespace loom

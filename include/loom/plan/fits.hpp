// Does a layout fit, at compile time: plan::fits<Cfg, Shape, Device, Run> is the planner's memory per rank
// (plan::memory, constexpr) against a device's memory, and plan::CheckFits<...> a static_assert that names, in its
// template arguments, the largest category, its GiB, the peak and the device's GiB when it does not.
#pragma once

#include <loom/plan/layout.hpp>
#include <loom/plan/memory.hpp>

namespace loom::plan {

//! A device's memory as a type, for the compile-time check.
template <long long Bytes>
struct DeviceMemory {
  static constexpr double memory_bytes = double(Bytes);
};
namespace devices {
using A100_80GB = DeviceMemory<80LL << 30>;
using H100_80GB = DeviceMemory<80LL << 30>;
using H200 = DeviceMemory<141000000000LL>;
}  // namespace devices

//! The planner's memory of the most loaded rank for layout type Cfg, shape S and run R.
template <class Cfg, GptShape S, Run R>
inline constexpr Memory memory_v = memory(S, layout_of<Cfg>(), R);

//! Whether the most loaded rank's peak fits the device.
template <class Cfg, GptShape S, class Device, Run R>
inline constexpr bool fits = memory_v<Cfg, S, R>.peak <= Device::memory_bytes;

namespace detail {
//! The categories' names, as CheckFits reports the largest.
enum class Largest { parameters, gradients, optimizer, activations, buffers, other };
constexpr Largest largest_of(const Memory& m) {
  const auto n = m.largest().first;
  return n == "parameters"    ? Largest::parameters
         : n == "gradients"   ? Largest::gradients
         : n == "optimizer"   ? Largest::optimizer
         : n == "activations" ? Largest::activations
         : n == "buffers"     ? Largest::buffers
                              : Largest::other;
}
template <Largest Category, long long CategoryGiB, long long PeakGiB, long long DeviceGiB, bool Ok>
struct DoesNotFit {
  static_assert(Ok, "loom: the layout does not fit the device's memory (DoesNotFit's template arguments: the largest "
                    "category, its GiB, the most loaded rank's peak GiB, the device's GiB): with activations the "
                    "largest use selective or full recompute, sequence parallelism or more pipeline stages; with "
                    "the optimizer or parameters, ZeRO or more tensor or pipeline ranks");
  static constexpr bool ok = Ok;
};
}  // namespace detail

//! static_assert(CheckFits<Cfg, S, Device, R>::ok): a loom: message when the layout does not fit, with the breakdown
//! in the failing check's template arguments.
template <class Cfg, GptShape S, class Device, Run R>
struct CheckFits {
  static constexpr Memory m = memory_v<Cfg, S, R>;
  static constexpr bool ok =
      detail::DoesNotFit<detail::largest_of(m), (long long)(m.largest().second / double(1 << 30)),
                         (long long)(m.peak / double(1 << 30)), (long long)(Device::memory_bytes / double(1 << 30)),
                         (m.peak <= Device::memory_bytes)>::ok;
};

}  // namespace loom::plan

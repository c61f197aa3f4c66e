// Counter-based random numbers: a value is a pure function of (seed, index), so a tensor initialised or masked
// element by element gives the same numbers however it is split across ranks.
#pragma once

#include <cmath>
#include <cstdint>

namespace loom::random {

//! splitmix64's finaliser: a bijective mix of 64 bits.
constexpr std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
//! A stream key from a seed and up to three more identifiers (a parameter's index, a step, a site).
constexpr std::uint64_t key(std::uint64_t seed, std::uint64_t a = 0, std::uint64_t b = 0, std::uint64_t c = 0) {
  return mix(mix(mix(mix(seed) ^ a) ^ b) ^ c);
}
//! Uniform in [0, 1) with 53 random bits.
inline double uniform(std::uint64_t key, std::uint64_t index) {
  return static_cast<double>(mix(key ^ mix(index)) >> 11) * 0x1.0p-53;
}
//! Standard normal (Box-Muller on two counter values).
inline double normal(std::uint64_t key, std::uint64_t index) {
  const double u1 = uniform(key, 2 * index) + 0x1.0p-54, u2 = uniform(key, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace loom::random

// loom/config/detail/name.hpp (private; include <loom/config.hpp>): the constexpr name of a layout, such as
// "tp2.pp4.dp2" or "dp8.zero1".
#pragma once

#ifndef LOOM_CONFIG_PARALLEL_INCLUDED
#error "loom: config/detail/ is private: include <loom/config.hpp>"
#endif

#include <array>
#include <cstddef>
#include <string_view>

#include <loom/config/axis.hpp>
#include <loom/config/options.hpp>
#include <loom/config/policies.hpp>

namespace loom::detail {

// Writes into out, or only counts when out is null, so the same code sizes the buffer and fills it.
struct NameWriter {
  char* out = nullptr;
  std::size_t n = 0;

  constexpr void put(std::string_view s) noexcept {
    for (char c : s) {
      if (out) out[n] = c;
      ++n;
    }
  }
  constexpr void put(int v) noexcept {
    if (v < 0) {
      put("-");
      v = -v;
    }
    char digits[12]{};
    int k = 0;
    do {
      digits[k++] = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v > 0);
    while (k > 0) put(std::string_view(&digits[--k], 1));
  }
};

template <class O>
constexpr void write_option(NameWriter& w) noexcept {
  if constexpr (Option<O>) {
    w.put(".");
    if constexpr (O::family == OptionFamily::zero) {
      w.put("zero");
      w.put(O::stage);
    } else if constexpr (O::family == OptionFamily::keep_gathered) {
      w.put("keep");
    } else if constexpr (O::family == OptionFamily::reduce_in) {
      w.put(std::is_same_v<typename O::type, float> ? "reduce-f32" : "reduce-bf16");
    } else if constexpr (O::family == OptionFamily::shard) {
      w.put("shard");
      w.put(O::group);
    } else if constexpr (O::family == OptionFamily::sequence_parallel) {
      w.put("sp");
    } else if constexpr (O::family == OptionFamily::interleaved) {
      w.put("v");
      w.put(O::virtual_stages);
    } else if constexpr (O::family == OptionFamily::schedule) {
      w.put(describe_schedule(O::schedule));
    } else {
      w.put(describe_cp_algorithm(O::algorithm));
    }
  }
}

template <class P, class Opts = typename P::options>
struct PolicyName;
template <class P, class... Os>
struct PolicyName<P, Options<Os...>> {
  static constexpr void write(NameWriter& w) noexcept {
    w.put(describe_axis(P::axis));
    w.put(P::size);
    (write_option<Os>(w), ...);
  }
};

template <class... Ps>
constexpr void write_name(NameWriter& w) noexcept {
  if constexpr (sizeof...(Ps) == 0) {
    w.put("single");
  } else {
    bool first = true;
    auto one = [&]<class P>() {
      if constexpr (AxisPolicy<P>) {
        if (!first) w.put(".");
        first = false;
        PolicyName<P>::write(w);
      }
    };
    (one.template operator()<Ps>(), ...);
  }
}

template <class... Ps>
struct LayoutName {
  static constexpr std::size_t length = [] {
    NameWriter w;
    write_name<Ps...>(w);
    return w.n;
  }();
  static constexpr std::array<char, length + 1> chars = [] {
    std::array<char, length + 1> a{};
    NameWriter w{a.data()};
    write_name<Ps...>(w);
    return a;
  }();
  static constexpr std::string_view value{chars.data(), length};
};

}  // namespace loom::detail

// loom::FunctionRef<R(A...)>: a reference to a callable that does not own it, for code compiled once (in
// loom::cpu_kernels) that calls back into its caller's code, as C++26's std::function_ref.
#pragma once

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

namespace loom {

template <class Signature>
class FunctionRef;

//! Refers to f, which must outlive every call (a lambda passed as an argument lives until the call returns).
template <class R, class... A>
class FunctionRef<R(A...)> {
 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef> && std::is_invocable_r_v<R, F&, A...>)
  FunctionRef(F&& f) noexcept
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, A... a) -> R { return std::invoke(*static_cast<std::remove_reference_t<F>*>(o),
                                                            std::forward<A>(a)...); }) {}

  R operator()(A... a) const { return call_(object_, std::forward<A>(a)...); }

 private:
  void* object_;
  R (*call_)(void*, A...);
};

}  // namespace loom

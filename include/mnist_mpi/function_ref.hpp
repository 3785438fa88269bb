// A callable passed down for the length of one call, not kept: a pointer to it and one to a
// function that calls it, so passing a lambda allocates nothing (std::function may, once its
// captures pass its small buffer; the step loop must not allocate). C++26's std::function_ref.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

namespace mnist_mpi {

template <class Signature>
class FunctionRef;

template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef> && std::is_invocable_r_v<R, F&, Args...>)
  FunctionRef(F&& f)  // NOLINT(google-explicit-constructor): taken as a lambda is
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

}  // namespace mnist_mpi

// comm::AnyComm: any communicator behind one type. It offers the same typed operations (Frontend) and hands each
// operation to the communicator it wraps through one virtual call, so that code written over it (a trainer, a
// training loop) is compiled once for every backend instead of once per backend.
#pragma once

#include <loom/comm/communicator.hpp>

#include <memory>
#include <utility>

namespace loom::comm {

//! Refers to a communicator (Local, Mpi, Nccl, ...) that must outlive it. What it issues is counted in its own
//! traffic() and in the wrapped communicator's (what a communicator counts is everything issued on it, through
//! wrappers or not).
class AnyComm : public Frontend<AnyComm> {
 public:
  template <class C>
    requires(!std::is_same_v<std::remove_cvref_t<C>, AnyComm>)
  explicit AnyComm(C& c) : impl_(std::make_unique<Impl<C>>(c)) {}
  //! Another AnyComm over c, with a traffic() of its own (c, which counts it too, must outlive it).
  static AnyComm referring_to(AnyComm& c) { return AnyComm(c, 0); }

  int rank() const { return impl_->rank(); }
  int size() const { return impl_->size(); }
  const GroupInfo& group() const { return impl_->group(); }
  Handle start(Op&& op, bool async) { return impl_->start(std::move(op), async); }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual const GroupInfo& group() const = 0;
    virtual Handle start(Op&& op, bool async) = 0;
  };
  template <class C>
  struct Impl final : Base {
    explicit Impl(C& c) : c(c) {}
    int rank() const override { return c.rank(); }
    int size() const override { return c.size(); }
    const GroupInfo& group() const override { return c.group(); }
    Handle start(Op&& op, bool async) override { return c.issue(std::move(op), async); }
    C& c;
  };
  AnyComm(AnyComm& c, int) : impl_(std::make_unique<Impl<AnyComm>>(c)) {}
  std::unique_ptr<Base> impl_;
};

static_assert(Communicator<AnyComm>);

}  // namespace loom::comm

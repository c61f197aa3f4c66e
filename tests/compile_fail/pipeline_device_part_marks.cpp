// expect: loom: a pipeline part on a device must mark its kernels (ops().mark()), which exchanges wait for
#include <loom/comm/local.hpp>
#include <loom/pipeline/executor.hpp>

#include <vector>

struct Device {};  // a device other than the host
struct Grads {
  using value_type = float;
  using device = Device;
};
struct Marks {
  struct Mark {
    void wait() const {}
  };
  Mark mark() const { return {}; }
};
struct Part {
  struct MicroBatch {};
  Grads grads();
#ifndef LOOM_FAIL
  Marks ops() const;  // a part whose kernels can be marked
#endif
};

static_assert(sizeof(loom::pipeline::Executor<Part, loom::comm::LocalComm>) > 0);
int main() {}

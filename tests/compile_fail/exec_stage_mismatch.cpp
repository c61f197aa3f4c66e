// expect: loom: a stage's operation cannot take what the stage before it produces
#include <loom/exec/pipeline.hpp>

#include <string>

struct MakeNumber {
  double operator()(std::size_t i) const { return static_cast<double>(i); }
};
#ifdef LOOM_FAIL
struct Consume {  // wants a string, gets a double
  void operator()(const std::string&) const {}
};
#else
struct Consume {
  void operator()(double) const {}
};
#endif

int main() {
  loom::exec::Pipeline<loom::exec::Stage<loom::exec::Compute, MakeNumber>, loom::exec::Stage<loom::exec::Comm, Consume>>
      p(MakeNumber{}, Consume{});
  p.run(3);
}

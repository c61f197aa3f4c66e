// expect: loom: config/detail/ is private: include <loom/config.hpp>
#ifdef LOOM_FAIL
#include <loom/config/detail/mesh.hpp>
#else
#include <loom/config.hpp>
#endif
int main() {}

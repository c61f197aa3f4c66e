# Tests of include/loom/config/: the policy algebra and the mesh. The static rules are checked by the files
# compile_fail/config_*.cpp, which tests/CMakeLists.txt registers.
loom_add_test(test_config_mesh test_config_mesh.cpp LABELS config)
# Its checks are index arithmetic over a few hundred ranks: unoptimised, it compiles in 13 s instead of 43 s and
# runs as fast as anyone can tell.
target_compile_options(test_config_mesh PRIVATE -O0)
loom_add_test(test_config_policies test_config_policies.cpp LABELS config)

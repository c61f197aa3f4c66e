# Tests of include/loom/config/: the policy algebra and the mesh. The static rules are checked by the files
# compile_fail/config_*.cpp, which tests/CMakeLists.txt registers.
loom_add_test(test_config_mesh test_config_mesh.cpp LABELS config)
loom_add_test(test_config_policies test_config_policies.cpp LABELS config)

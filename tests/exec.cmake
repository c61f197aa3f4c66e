# Overlap stages and the trace recorder.
loom_add_test(test_exec test_exec.cpp LABELS exec)
if(LOOM_WITH_CUDA)
  # Stages on CUDA streams (label gpu; skipped without a device).
  add_executable(test_exec_cuda test_exec_cuda.cu)
  target_link_libraries(test_exec_cuda PRIVATE loom::loom loom::cuda)
  set_target_properties(test_exec_cuda PROPERTIES CUDA_ARCHITECTURES 90)
  target_compile_options(test_exec_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  add_test(NAME test_exec_cuda COMMAND test_exec_cuda)
  set_tests_properties(test_exec_cuda PROPERTIES LABELS "gpu;exec" SKIP_RETURN_CODE 77)
endif()

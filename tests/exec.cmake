# Overlap stages and the trace recorder.
loom_add_test(test_exec test_exec.cpp LABELS exec)
if(LOOM_WITH_CUDA)
  # Stages on CUDA streams (label gpu; skipped without a device).
  add_executable(test_exec_cuda)
  loom_cuda_sources(test_exec_cuda "" test_exec_cuda.cu)
  add_test(NAME test_exec_cuda COMMAND test_exec_cuda)
  set_tests_properties(test_exec_cuda PROPERTIES LABELS "gpu;exec" SKIP_RETURN_CODE 77)
endif()

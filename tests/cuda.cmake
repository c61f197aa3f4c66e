# The CUDA kernels against the CPU kernels, the GPT on a device against the GPT on the host, and the Local backend on
# device memory, ranks sharing one GPU (label gpu). Without a device (and no driver) each program prints "SKIPPED: no
# CUDA device here" and exits with 77, which ctest reports as skipped; a GPU the runtime cannot use fails them.
if(LOOM_WITH_CUDA)
  # test_kernels_cuda compiles the kernels it tests (nvcc); the others are g++'s, over loom::cuda_kernels.
  foreach(_loom_gpu_test test_kernels_cuda.cu test_gpt_cuda.cpp test_comm_local_cuda.cpp)
    get_filename_component(_loom_source ${_loom_gpu_test} NAME)
    get_filename_component(_loom_gpu_test ${_loom_gpu_test} NAME_WE)
    add_executable(${_loom_gpu_test})
    loom_cuda_sources(${_loom_gpu_test} "" ${_loom_source})
    target_link_libraries(${_loom_gpu_test} PRIVATE loom_catch_main)
    target_include_directories(${_loom_gpu_test} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
    add_test(NAME ${_loom_gpu_test} COMMAND ${_loom_gpu_test})
  endforeach()
  set_tests_properties(test_kernels_cuda PROPERTIES LABELS "gpu;kernels" SKIP_RETURN_CODE 77 TIMEOUT 900)
  set_tests_properties(test_gpt_cuda PROPERTIES LABELS "gpu;model" SKIP_RETURN_CODE 77 TIMEOUT 900)
  set_tests_properties(test_comm_local_cuda PROPERTIES LABELS "gpu;comm" SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()


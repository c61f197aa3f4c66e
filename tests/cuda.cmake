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
  # The attention tests again with the register-resident kernels set aside: the shared-memory ones at every head size.
  add_test(NAME test_kernels_cuda_wmma_attention COMMAND test_kernels_cuda "[attention]")
  set_tests_properties(test_kernels_cuda_wmma_attention PROPERTIES LABELS "gpu;kernels" SKIP_RETURN_CODE 77
                       TIMEOUT 600 ENVIRONMENT LOOM_CUDA_ATTENTION=wmma)
  # The device's static rules (compile_fail_cuda/), checked as compile_fail/'s are, with the toolkit's headers:
  # they need no GPU.
  file(GLOB _loom_fail_cuda_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/compile_fail_cuda/*.cpp)
  foreach(src ${_loom_fail_cuda_sources})
    get_filename_component(stem ${src} NAME_WE)
    add_test(NAME compile_fail.cuda_${stem}
      COMMAND ${CMAKE_COMMAND} -DCXX=${CMAKE_CXX_COMPILER} -DSRC=${src} -DINCLUDE=${PROJECT_SOURCE_DIR}/include
              "-DEXTRA=-I${_eigen_inc};-I${LOOM_NCCL_INCLUDE_DIR};-isystem;${CUDAToolkit_INCLUDE_DIRS};-DLOOM_HAS_CUDA=1"
              -P ${PROJECT_SOURCE_DIR}/cmake/check_compile_fail.cmake)
    set_tests_properties(compile_fail.cuda_${stem} PROPERTIES LABELS compile-fail)
  endforeach()
  # The architecture rule (sm_80 and newer): nvcc's preprocessor for each architecture, no compilation.
  add_test(NAME compile_fail.cuda_kernels_below_sm80
    COMMAND ${CMAKE_COMMAND} -DCXX=${CMAKE_CUDA_COMPILER}
            -DSRC=${CMAKE_CURRENT_SOURCE_DIR}/compile_fail_cuda_arch/kernels_below_sm80.cu
            -DINCLUDE=${PROJECT_SOURCE_DIR}/include "-DEXTRA=-isystem;${_eigen_inc};-DLOOM_HAS_CUDA=1"
            "-DCHECK=-E;-x;cu;-o;/dev/null" -DOK=-arch=sm_80 -DFAIL=-arch=sm_75
            -P ${PROJECT_SOURCE_DIR}/cmake/check_compile_fail.cmake)
  set_tests_properties(compile_fail.cuda_kernels_below_sm80 PROPERTIES LABELS compile-fail)
endif()


# The Nccl backend on a GPU (labels gpu, mpi): one rank under mpirun, since NCCL refuses two ranks on one device.
# Without a device the program prints "SKIPPED: no CUDA device here" and exits with 77, which ctest reports as skipped.
if(LOOM_WITH_CUDA AND LOOM_WITH_MPI)
  add_executable(test_comm_nccl test_comm_nccl.cpp)
  target_link_libraries(test_comm_nccl PRIVATE loom::cuda loom::mpi)
  target_include_directories(test_comm_nccl PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  set(_nccl_mpirun ${MPIEXEC_EXECUTABLE} --oversubscribe --bind-to none -np 1 $<TARGET_FILE:test_comm_nccl>)
  add_test(NAME test_comm_nccl COMMAND ${_nccl_mpirun} cases)
  add_test(NAME test_comm_nccl_timeout COMMAND ${_nccl_mpirun} timeout)
  set_tests_properties(test_comm_nccl test_comm_nccl_timeout PROPERTIES
    LABELS "gpu;mpi;comm" SKIP_RETURN_CODE 77 TIMEOUT 600
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;LOOM_TIMEOUT_S=120")
endif()

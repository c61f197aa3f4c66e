# Communicator tests: Local here; Mpi under mpirun (label mpi); Nccl on a GPU (label gpu).
loom_add_test(test_comm_local test_comm_local.cpp LABELS comm)

if(LOOM_WITH_MPI)
  add_executable(test_comm_mpi test_comm_mpi.cpp)
  target_link_libraries(test_comm_mpi PRIVATE loom::mpi)
  target_include_directories(test_comm_mpi PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  set(_mpirun ${MPIEXEC_EXECUTABLE} --oversubscribe --bind-to none)
  set(_mpi_env "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
  foreach(np 4 8)
    add_test(NAME test_comm_mpi_np${np} COMMAND ${_mpirun} -np ${np} $<TARGET_FILE:test_comm_mpi> cases)
    set_tests_properties(test_comm_mpi_np${np} PROPERTIES LABELS "mpi;comm" TIMEOUT 600
                         ENVIRONMENT "${_mpi_env};LOOM_TIMEOUT_S=60")
  endforeach()
  add_test(NAME test_comm_mpi_wrong_size
    COMMAND ${CMAKE_COMMAND} "-DCMD=${MPIEXEC_EXECUTABLE};--oversubscribe;-np;3;$<TARGET_FILE:test_comm_mpi>;wrong-size"
            "-DEXPECT=loom: the layout tp2.pp2.dp2 needs 8 ranks, but the job was launched with 3"
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
  add_test(NAME test_comm_mpi_rank_throws
    COMMAND ${CMAKE_COMMAND} "-DCMD=${MPIEXEC_EXECUTABLE};--oversubscribe;-np;4;$<TARGET_FILE:test_comm_mpi>;throw"
            "-DEXPECT=loom: rank 3 failed: rank three gives up" -DMAX_SECONDS=30
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
  add_test(NAME test_comm_mpi_rank_missing
    COMMAND ${CMAKE_COMMAND} "-DCMD=${MPIEXEC_EXECUTABLE};--oversubscribe;-np;4;$<TARGET_FILE:test_comm_mpi>;missing"
            "-DEXPECT=loom: all_reduce #3 on group dp{1,3} timed out after 3 s on global rank 1"
            "-DEXPECT2=ranks that have not entered it: global rank 3 (group rank 1, at #2)" -DMAX_SECONDS=30
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
  add_test(NAME test_comm_mpi_group_missing
    COMMAND ${CMAKE_COMMAND} "-DCMD=${MPIEXEC_EXECUTABLE};--oversubscribe;-np;4;$<TARGET_FILE:test_comm_mpi>;no-group"
            "-DEXPECT=loom: creating the communicator on group dp{1,3} timed out after 3 s on global rank 1"
            -DMAX_SECONDS=30 -P ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
  set_tests_properties(test_comm_mpi_wrong_size test_comm_mpi_rank_throws test_comm_mpi_rank_missing
                       test_comm_mpi_group_missing
                       PROPERTIES LABELS "mpi;comm;failure" ENVIRONMENT "${_mpi_env};LOOM_TIMEOUT_S=3")
endif()

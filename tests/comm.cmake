# Communicator tests: Local here; Mpi under mpirun (label mpi); Nccl on a GPU (label gpu).
loom_add_test(test_comm_local test_comm_local.cpp LABELS comm)
loom_add_test(test_comm_local_failures test_comm_local_failures.cpp LABELS "comm;failure")

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

# Ranks that fail while their peers are inside collectives or sends: exit 1 with every other rank told which rank
# failed, never a signal (cmake/expect_failure.cmake requires a numeric exit status).
add_executable(comm_local_faults comm_local_faults.cpp)
target_link_libraries(comm_local_faults PRIVATE loom::loom)
foreach(algo ring halving_doubling direct)
  add_test(NAME comm_local_faults.mid_collective.${algo}
    COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:comm_local_faults>;mid-collective;${algo}"
            "-DEXPECT=loom: rank 1 failed: rank 1 gives up at all_reduce"
            "-DEXPECT2=7 of 7 other ranks were told: abandoned because rank 1 failed" -DMAX_SECONDS=30
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
endforeach()
add_test(NAME comm_local_faults.straggler
  COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:comm_local_faults>;straggler"
          "-DEXPECT=loom: rank 0 failed: loom: all_reduce #2 on group world{0,1} (this is global rank 0, group rank 0) timed out after 1 s waiting for ranks that have not entered it: global rank 1 (group rank 1, at #1)"
          "-DEXPECT2=1 of 1 other ranks were told: abandoned because rank 0 failed" -DMAX_SECONDS=30
          -P ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
add_test(NAME comm_local_faults.send_recv
  COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:comm_local_faults>;send-recv"
          "-DEXPECT=loom: rank 2 failed: rank 2 gives up"
          "-DEXPECT2=2 of 2 other ranks were told: abandoned because rank 2 failed" -DMAX_SECONDS=30
          -P ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
set_tests_properties(comm_local_faults.mid_collective.ring comm_local_faults.mid_collective.halving_doubling
                     comm_local_faults.mid_collective.direct comm_local_faults.straggler comm_local_faults.send_recv
                     PROPERTIES LABELS "comm;failure")

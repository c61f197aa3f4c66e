# Training that survives failures: loom-run over train_gpt with processes killed and frozen (scripts/fault-inject:
# the run finishes with every step's loss and the final checkpoint of the run without failures), --auto-resume, what
# both refuse, and loom-goodput against the Young/Daly closed form.
if(TARGET loom-goodput)
  add_test(NAME loom_goodput_young_daly
    COMMAND ${CMAKE_COMMAND} -DLG=$<TARGET_FILE:loom-goodput> -DDIR=${LOOM_TEST_SCRATCH}/loom_goodput
            -P ${CMAKE_CURRENT_SOURCE_DIR}/goodput_check.cmake)
  set_tests_properties(loom_goodput_young_daly PROPERTIES LABELS faults)
  add_test(NAME loom_goodput_needs_gpus
    COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:loom-goodput>;--days;3" "-DEXPECT=loom-goodput: --gpus N is required"
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
  set_tests_properties(loom_goodput_needs_gpus PROPERTIES LABELS "faults;failure")
endif()
if(TARGET loom-run AND TARGET train_gpt)
  function(loom_fault_test name regex)
    add_test(NAME ${name}
      COMMAND ${CMAKE_COMMAND} "-DCMD=${ARGN}" "-DEXPECT_REGEX=${regex}" -DSCRATCH=${LOOM_TEST_SCRATCH}/${name}
              -P ${PROJECT_SOURCE_DIR}/cmake/expect_success.cmake)
    set_tests_properties(${name} PROPERTIES LABELS faults)
  endfunction()
  # A kill and a freeze at random steps of a dp2 run on threads (heartbeat 2 s).
  loom_fault_test(fault_inject_threads
    "loom-run: attempt 0 failed after [0-9.]+ s: process [0-9]+ killed by signal 9.*frozen \\(no beat for [23]\\.[0-9] s\\).*fault-inject: 2 fault\\(s\\) injected, 2 restart\\(s\\); every step's loss and the final checkpoint \\(step-00000040\\) equal"
    bash;${PROJECT_SOURCE_DIR}/scripts/fault-inject;--build;${CMAKE_BINARY_DIR};--dir;${LOOM_TEST_SCRATCH}/fault_inject_threads;--seed;3)
  if(LOOM_WITH_MPI)
    # tp2.dp2 as four processes under mpirun: one of them killed, one frozen.
    loom_fault_test(fault_inject_mpi
      "fault-inject: 2 fault\\(s\\) injected, 2 restart\\(s\\); every step's loss and the final checkpoint \\(step-00000030\\) equal"
      bash;${PROJECT_SOURCE_DIR}/scripts/fault-inject;--build;${CMAKE_BINARY_DIR};--dir;${LOOM_TEST_SCRATCH}/fault_inject_mpi;--mpi;4;--parallel;tp2,dp2;--steps;30;--seed;5)
    set_tests_properties(fault_inject_mpi PROPERTIES LABELS "faults;mpi")
  endif()
  # --auto-resume: a run whose checkpoint stands at --steps is done; one without a checkpoint starts.
  loom_fault_test(train_gpt_auto_resume
    "holds no checkpoint yet; starting at step 0.*--auto-resume: continuing from .*step-00000004 at step 4.*is at step 6 of 6: the run is done"
    sh -c "$<TARGET_FILE:train_gpt> --model tiny --batch 2 --seq 16 --no-progress --save ${LOOM_TEST_SCRATCH}/train_gpt_auto_resume/ck --auto-resume --steps 4 && $<TARGET_FILE:train_gpt> --model tiny --batch 2 --seq 16 --no-progress --save ${LOOM_TEST_SCRATCH}/train_gpt_auto_resume/ck --auto-resume --steps 6 && $<TARGET_FILE:train_gpt> --model tiny --batch 2 --seq 16 --no-progress --save ${LOOM_TEST_SCRATCH}/train_gpt_auto_resume/ck --auto-resume --steps 6")
  function(loom_fault_refuses name expect)
    add_test(NAME ${name}
      COMMAND ${CMAKE_COMMAND} "-DCMD=${ARGN}" "-DEXPECT=${expect}" -P ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
    set_tests_properties(${name} PROPERTIES LABELS "faults;failure")
  endfunction()
  loom_fault_refuses(train_gpt_auto_resume_needs_save
    "--auto-resume continues from --save DIR's newest checkpoint, but no --save DIR is given"
    $<TARGET_FILE:train_gpt>;--model;tiny;--auto-resume)
  loom_fault_refuses(loom_run_needs_a_command "loom-run: no command to run (give it after --)"
    $<TARGET_FILE:loom-run>;--heartbeat-s;2)
  loom_fault_refuses(loom_run_gives_up "loom-run: giving up after 1 restart (--max-restarts 1)"
    $<TARGET_FILE:loom-run>;--max-restarts;1;--;false)
endif()

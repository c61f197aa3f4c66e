# Tests of include/loom/pipeline/: the schedule tables, their verifier and timing (test_pipeline_schedule), and the
# loom-schedule tool, whose printed bubbles must be the published ones. The static rules are checked by the files
# compile_fail/pipeline_*.cpp, which tests/CMakeLists.txt registers.
loom_add_test(test_pipeline_schedule test_pipeline_schedule.cpp LABELS pipeline)

if(TARGET loom-schedule)
  # name, expected output (a regular expression), arguments: loom-schedule must exit 0 and print it.
  function(loom_schedule_test name expect)
    add_test(NAME pipeline_loom_schedule.${name}
      COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:loom-schedule>;${ARGN}" "-DEXPECT_REGEX=${expect}"
              -DSCRATCH=${LOOM_TEST_SCRATCH}/loom-schedule-${name} -P ${PROJECT_SOURCE_DIR}/cmake/expect_success.cmake)
    set_tests_properties(pipeline_loom_schedule.${name} PROPERTIES LABELS pipeline)
  endfunction()
  # (p-1)/(m+p-1) = 3/11 of the step
  loom_schedule_test(1f1b "bubble 0\\.2727 of the step" --schedule 1f1b --pp 4 --micro-batches 8)
  loom_schedule_test(gpipe "bubble 0\\.2727 of the step" --schedule gpipe --pp 4 --micro-batches 8)
  # (p-1)/(v m) = 3/16 of the ideal
  loom_schedule_test(interleaved "0\\.1875 of the ideal" --schedule interleaved --pp 4 --micro-batches 8 --chunks 2)
  # p-1 = 3 idle units per stage against 1F1B's 9
  loom_schedule_test(zb-h1 "idle 3 units per stage" --schedule zb-h1 --pp 4 --micro-batches 8)
  loom_schedule_test(zb-v "idle 3 units per stage" --schedule zb-v --pp 4 --micro-batches 8)
  loom_schedule_test(svg "wrote .*loom-schedule-test\\.svg"
                     --schedule zb-v --pp 4 --micro-batches 8 --svg ${LOOM_TEST_SCRATCH}/loom-schedule-svg/loom-schedule-test.svg)
  # A count the schedule cannot take: a non-zero exit status and the rule's message.
  add_test(NAME pipeline_loom_schedule.bad-counts
    COMMAND ${CMAKE_COMMAND}
            "-DCMD=$<TARGET_FILE:loom-schedule>;--schedule;interleaved;--pp;4;--micro-batches;6;--chunks;2"
            "-DEXPECT_LINE=loom: the interleaved schedule needs the micro-batch count to be a multiple of the stage count, got m = 6, p = 4"
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
  set_tests_properties(pipeline_loom_schedule.bad-counts PROPERTIES LABELS "pipeline;failure")
endif()

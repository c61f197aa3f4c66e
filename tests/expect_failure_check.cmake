# cmake/expect_failure.cmake, which the failure tests run through, refuses what is not a failure with a message:
# a command killed by a signal, one that exits 0, and one whose output has the expected text only inside a longer
# line; and it accepts an exit status of 3 with the expected line, also after "loom: rank N failed: ".
#   cmake -DEF=<expect_failure.cmake> -P this
function(check expect_rc why cmd)
  execute_process(COMMAND ${CMAKE_COMMAND} "-DCMD=${cmd}" ${ARGN} -P ${EF}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(expect_rc EQUAL 0 AND NOT rc STREQUAL "0")
    message(FATAL_ERROR "expect_failure refused '${cmd}' (exit ${rc}):\n${out}${err}")
  endif()
  if(NOT expect_rc EQUAL 0 AND (rc STREQUAL "0" OR NOT "${out}${err}" MATCHES "${why}"))
    message(FATAL_ERROR "expect_failure did not refuse '${cmd}' for '${why}' (exit ${rc}):\n${out}${err}")
  endif()
endfunction()
check(1 "the command did not exit with a status" "sh;-c;kill -KILL $$")
check(1 "the command succeeded; it must fail" "sh;-c;echo 'loom: x y'")
check(1 "no line of the output is 'loom: x y'" "sh;-c;echo 'loom: x y z' && exit 3" "-DEXPECT_LINE=loom: x y")
check(1 "the output lacks 'loom: q'" "sh;-c;echo 'loom: x y' && exit 3" "-DEXPECT=loom: q")
check(0 "" "sh;-c;echo 'loom: x y' && exit 3" "-DEXPECT_LINE=loom: x y")
check(0 "" "sh;-c;echo 'a' && echo 'loom: rank 1 failed: loom: x y' >&2 && exit 3" "-DEXPECT_LINE=loom: x y")
check(0 "" "sh;-c;echo 'loom: x y z' && exit 3" "-DEXPECT=loom: x y")
message(STATUS "expect_failure.cmake refuses a signal, a success and a partial line, and accepts a failure")

# Runs a command that must succeed (exit status 0) within a time limit and print something that matches a regular
# expression.
#   cmake -DCMD="a;b;c" -DEXPECT_REGEX="regex" -P expect_success.cmake
execute_process(COMMAND ${CMD} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err TIMEOUT 120)
message(STATUS "exit ${_rc}:\n${_out}${_err}")
if(NOT _rc STREQUAL "0")
  message(FATAL_ERROR "the command failed (exit ${_rc}); it must succeed")
endif()
if(NOT "${_out}${_err}" MATCHES "${EXPECT_REGEX}")
  message(FATAL_ERROR "the output does not match '${EXPECT_REGEX}'")
endif()

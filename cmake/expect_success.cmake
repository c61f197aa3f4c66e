# Runs a command that must succeed (exit status 0) within a time limit and print something that matches a regular
# expression.
#   cmake -DCMD="a;b;c" -DEXPECT_REGEX="regex" [-DSCRATCH=dir] -P expect_success.cmake
# SCRATCH: a folder the command writes into, made before it runs and removed after.
if(DEFINED SCRATCH)
  file(REMOVE_RECURSE ${SCRATCH})
  file(MAKE_DIRECTORY ${SCRATCH})
endif()
execute_process(COMMAND ${CMD} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err TIMEOUT 120)
message(STATUS "exit ${_rc}:\n${_out}${_err}")
if(NOT _rc STREQUAL "0")
  message(FATAL_ERROR "the command failed (exit ${_rc}); it must succeed")
endif()
if(NOT "${_out}${_err}" MATCHES "${EXPECT_REGEX}")
  message(FATAL_ERROR "the output does not match '${EXPECT_REGEX}'")
endif()
if(DEFINED SCRATCH)
  file(REMOVE_RECURSE ${SCRATCH})
endif()

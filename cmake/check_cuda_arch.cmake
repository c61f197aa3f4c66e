# The kernels' architecture rule, run with cmake -P: preprocessing a source that includes the kernels for sm_80
# succeeds, for sm_75 fails with the message on the source's `// expect: ` line.
#   -DNVCC=<nvcc> -DSRC=<file> -DINCLUDE=<dir> [-DEXTRA="flags;..."]
file(STRINGS ${SRC} _expect_line REGEX "^// expect: ")
string(REGEX REPLACE "^// expect: " "" _expect "${_expect_line}")
set(_cmd ${NVCC} -std=c++20 -E -x cu -I${INCLUDE} ${EXTRA} ${SRC} -o /dev/null)
execute_process(COMMAND ${_cmd} -arch=sm_80 RESULT_VARIABLE _ok_rc ERROR_VARIABLE _ok_err OUTPUT_QUIET)
if(NOT _ok_rc EQUAL 0)
  message(FATAL_ERROR "${SRC} must preprocess for sm_80, but:\n${_ok_err}")
endif()
execute_process(COMMAND ${_cmd} -arch=sm_75 RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
if(_rc EQUAL 0)
  message(FATAL_ERROR "${SRC} preprocessed for sm_75; it must not")
endif()
string(FIND "${_out}${_err}" "${_expect}" _at)
if(_at EQUAL -1)
  message(FATAL_ERROR "${SRC} failed for sm_75, but without the message '${_expect}':\n${_err}")
endif()
message(STATUS "${SRC}: refuses sm_75 with '${_expect}' as it should")

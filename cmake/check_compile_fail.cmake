# Compile-fail check, run with cmake -P. The source must compile without -DLOOM_FAIL and must fail with it, printing
# the message kept on its `// expect: ` line.
#   -DCXX=<compiler> -DSRC=<file> -DINCLUDE=<dir> [-DEXTRA="flags;..."] [-DPCH=<header>]
# PCH: a header (with its GCC precompiled .gch beside it: the communicators, the model and the trainer) included
# first where the source includes one of those, whose parsing it saves; not where it includes a detail/ header, whose
# refusal the header's includes would hide, nor where it includes less (loading the header costs more than that).
file(STRINGS ${SRC} _expect_line REGEX "^// expect: ")
if(NOT _expect_line)
  message(FATAL_ERROR "${SRC}: no '// expect: ' line")
endif()
string(REGEX REPLACE "^// expect: " "" _expect "${_expect_line}")
set(_cmd ${CXX} -std=c++20 -fsyntax-only -I${INCLUDE} ${EXTRA})
file(STRINGS ${SRC} _detail_include REGEX "#include <loom/.*detail/")
file(STRINGS ${SRC} _heavy_include REGEX "#include <loom/(train/trainer|models/gpt|comm/local)\\.hpp>")
if(PCH AND _heavy_include AND NOT _detail_include AND EXISTS ${PCH}.gch)
  list(APPEND _cmd -include ${PCH})
endif()
list(APPEND _cmd ${SRC})
execute_process(COMMAND ${_cmd} RESULT_VARIABLE _ok_rc OUTPUT_VARIABLE _ok_out ERROR_VARIABLE _ok_err)
if(NOT _ok_rc EQUAL 0)
  message(FATAL_ERROR "${SRC} must compile without LOOM_FAIL, but:\n${_ok_err}")
endif()
execute_process(COMMAND ${_cmd} -DLOOM_FAIL RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
if(_rc EQUAL 0)
  message(FATAL_ERROR "${SRC} compiled with LOOM_FAIL; it must not")
endif()
string(FIND "${_out}${_err}" "${_expect}" _at)
if(_at EQUAL -1)
  message(FATAL_ERROR "${SRC} failed to compile, but without the message '${_expect}':\n${_err}")
endif()
message(STATUS "${SRC}: fails with '${_expect}' as it should")

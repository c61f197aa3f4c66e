# train_gpt --help exits 0, and docs/train_gpt.md shows exactly what it prints.
#   cmake -DTG=<train_gpt> -DDOC=<docs/train_gpt.md> -P this
execute_process(COMMAND ${TG} --help RESULT_VARIABLE rc OUTPUT_VARIABLE help ERROR_VARIABLE err)
if(NOT rc STREQUAL "0")
  message(FATAL_ERROR "train_gpt --help failed (exit ${rc}):\n${help}${err}")
endif()
if(NOT help MATCHES "^usage: train_gpt ")
  message(FATAL_ERROR "train_gpt --help does not print its usage:\n${help}")
endif()
file(READ ${DOC} doc)
string(FIND "${doc}" "```\n${help}```\n" at)
if(at EQUAL -1)
  message(FATAL_ERROR "${DOC} does not show what train_gpt --help prints:\n${help}")
endif()

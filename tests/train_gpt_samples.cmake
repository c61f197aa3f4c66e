# train_gpt --sample-every on other layouts (or devices) samples the single-rank run's text: 60 steps of f64, which
# leave a model whose greedy text is more than one repeated byte, sampled after the last step; each
# run of RUNS (each its flags, separated by spaces) against one rank on the CPU with the same EXTRA flags.
#   cmake -DTG=<train_gpt> "-DRUNS=--parallel dp2,ep2;--device cuda" ["-DEXTRA=--model;tiny-moe"] -P this
set(common --no-progress --dtype f64 --steps 60 --batch 8 --seq 64 --sample-every 60 --sample-tokens 24
           --prompt Th ${EXTRA})
function(sample out)
  execute_process(COMMAND ${TG} ${common} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE stdout ERROR_VARIABLE err)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "train_gpt ${ARGN} failed (exit ${rc}):\n${stdout}${err}")
  endif()
  if(NOT stdout MATCHES "\nsample   59  (\"Th[^\n]*\")\n")
    message(FATAL_ERROR "train_gpt ${ARGN} logged no sample after step 59:\n${stdout}")
  endif()
  set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
endfunction()
sample(ref)
string(REGEX REPLACE "^\"Th(.*)\"$" "\\1" more "${ref}")
string(REGEX REPLACE "\\\\(u....|.)" "" more "${more}")  # JSON's escapes (\n, \", \u00e9) left out
string(SUBSTRING "${more}" 0 1 first)
string(REPLACE "${first}" "" rest "${more}")
if(more STREQUAL "" OR rest STREQUAL "")
  message(FATAL_ERROR "one rank's sample ${ref} continues with one byte: it would not tell models apart")
endif()
foreach(run ${RUNS})
  separate_arguments(flags UNIX_COMMAND "${run}")
  sample(got ${flags})
  if(NOT got STREQUAL ref)
    message(FATAL_ERROR "train_gpt ${flags}: sample ${got}, one rank's ${ref}")
  endif()
  message(STATUS "train_gpt ${flags}: sample ${got}, one rank's")
endforeach()

# What the train_gpt checkpoint scripts share: a fresh DIR, data made so that batch 5 is batch 0 (sequential order,
# B = 4, T = 16: row r of batch b starts at ((4b + r)·16) mod (N − 17), and N − 17 = 320 = 5·4·16), train_gpt's
# common flags on it, and run(ARGS...), which fails the test with train_gpt's output when it exits non-zero.
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})
string(REPEAT "a checkpoint holds the weights; the run that loads them must see the same model. " 5 text)
string(SUBSTRING "${text}" 0 337 text)
file(WRITE ${DIR}/data.txt "${text}")
set(common --no-progress --dtype f64 --data ${DIR}/data.txt --batch 4 --seq 16)
function(run)
  execute_process(COMMAND ${TG} ${common} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "train_gpt ${ARGN} failed (exit ${rc}):\n${out}${err}")
  endif()
endfunction()

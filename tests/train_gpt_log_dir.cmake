# train_gpt --log-dir under mpirun: each of the 2 processes writes its own log, a line per step with its rank.
#   cmake -DTG=<train_gpt> "-DMPI=<mpiexec;flags>" -DDIR=<scratch> -P this
file(REMOVE_RECURSE ${DIR})
execute_process(COMMAND ${MPI} -np 2 ${TG} --backend mpi --no-progress --steps 3 --parallel dp2 --log-dir ${DIR}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "train_gpt --log-dir under mpirun failed (exit ${rc}):\n${out}${err}")
endif()
foreach(r 0 1)
  file(STRINGS ${DIR}/rank-0000${r}.jsonl lines)
  list(LENGTH lines n)
  list(GET lines 2 last)
  string(JSON rank GET "${last}" rank)
  string(JSON step GET "${last}" step)
  if(NOT n EQUAL 3 OR NOT rank EQUAL r OR NOT step EQUAL 2)
    message(FATAL_ERROR "rank-0000${r}.jsonl: ${n} lines, the last of rank ${rank} at step ${step} (3, ${r}, 2)")
  endif()
endforeach()

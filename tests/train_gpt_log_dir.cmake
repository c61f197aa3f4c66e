# train_gpt --log-dir under mpirun: each of the 2 processes writes its own log, a line per step with its rank; and
# LOOM_TRACE's trace, one file per process (trace.rank-NNNNN.json), each with its own rank's spans.
#   cmake -DTG=<train_gpt> "-DMPI=<mpiexec;flags>" -DDIR=<scratch> -P this
file(REMOVE_RECURSE ${DIR})
execute_process(COMMAND ${CMAKE_COMMAND} -E env LOOM_TRACE=${DIR}/trace.json
                        ${MPI} -x LOOM_TRACE -np 2 ${TG} --backend mpi --no-progress --steps 3 --parallel dp2
                        --log-dir ${DIR}
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
foreach(r 0 1)
  set(trace ${DIR}/trace.rank-0000${r}.json)
  if(NOT EXISTS ${trace})
    message(FATAL_ERROR "no ${trace}: each process writes its own LOOM_TRACE file")
  endif()
  file(READ ${trace} json)
  if(NOT json MATCHES "\"pid\": ?${r}[,}]" OR (r EQUAL 0 AND json MATCHES "\"pid\": ?1[,}]"))
    message(FATAL_ERROR "${trace} does not hold rank ${r}'s spans alone")
  endif()
endforeach()
if(EXISTS ${DIR}/trace.json)
  message(FATAL_ERROR "the processes wrote ${DIR}/trace.json too")
endif()

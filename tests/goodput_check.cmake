# loom-goodput against the Young/Daly closed form where it holds (interval and restart well under the MTTF): the
# simulated effective training time of a year at 1,024 GPUs, with disk checkpoints and with in-memory snapshots,
# within a point of the first-order estimate, and the snapshots ahead of the disk.
#   cmake -DLG=<loom-goodput> -DDIR=<scratch> -P this
file(MAKE_DIRECTORY ${DIR})
execute_process(COMMAND ${LG} --gpus 1024 --days 365 --json ${DIR}/goodput.json
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "loom-goodput failed (exit ${rc}):\n${out}${err}")
endif()
message(STATUS "${out}")
file(READ ${DIR}/goodput.json j)
foreach(kind disk memory)
  string(JSON sim GET "${j}" effective_${kind})
  string(JSON yd GET "${j}" young_daly_${kind})
  # CMake has no floating point: compare in ten-thousandths
  string(REGEX REPLACE "^0\\.([0-9][0-9][0-9][0-9]).*" "\\1" s4 "${sim}")
  string(REGEX REPLACE "^0\\.([0-9][0-9][0-9][0-9]).*" "\\1" y4 "${yd}")
  math(EXPR d "${s4} - ${y4}")
  if(d LESS -100 OR d GREATER 100)
    message(FATAL_ERROR "${kind}: simulated ${sim}, Young/Daly ${yd}: more than a point apart")
  endif()
  set(${kind}_eff ${s4})
endforeach()
if(NOT memory_eff GREATER disk_eff)
  message(FATAL_ERROR "in-memory snapshots (0.${memory_eff}) are not ahead of disk checkpoints (0.${disk_eff})")
endif()
file(REMOVE_RECURSE ${DIR})

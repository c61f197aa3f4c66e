# Sharded checkpoints under mpirun: 5 steps as 4 MPI processes on tp2,dp2,zero1, each writing its own file, resumed
# by 2 processes on pp2 for steps 5-9, give the losses of 10 steps on one rank (f64, 9 significant digits: the
# layouts sum in other orders).
#   cmake -DTG=<train_gpt> -DMPIEXEC=<mpiexec> -DDIR=<scratch> -P this
include(${CMAKE_CURRENT_LIST_DIR}/losses.cmake)
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})
set(common --no-progress --dtype f64 --dropout 0.1 --batch-order shuffle --batch 8 --seq 32)
set(mpi ${MPIEXEC} --oversubscribe --bind-to none -np)
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "${ARGN} failed (exit ${rc}):\n${out}${err}")
  endif()
endfunction()
run(${TG} ${common} --steps 10 --log-json ${DIR}/straight.jsonl)
run(${mpi} 4 ${TG} ${common} --backend mpi --parallel tp2,dp2,zero1 --steps 5 --save ${DIR}/ckpt)
foreach(r 0 1 2 3)
  if(NOT EXISTS ${DIR}/ckpt/step-00000005/rank-0000${r}.safetensors)
    message(FATAL_ERROR "rank ${r} wrote no file")
  endif()
endforeach()
run(${mpi} 2 ${TG} ${common} --backend mpi --parallel pp2 --micro-batches 2 --steps 10 --resume ${DIR}/ckpt
    --log-json ${DIR}/resumed.jsonl)
expect_losses(${DIR}/straight.jsonl 5 ${DIR}/resumed.jsonl 0 5 10)
message(STATUS "saved by 4 processes on tp2,dp2,zero1, resumed by 2 on pp2: the one-rank run's losses")
file(REMOVE_RECURSE ${DIR})  # kept only when a check failed

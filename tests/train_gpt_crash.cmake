# A job killed while it saves loses nothing that was saved: train_gpt saves every 2 steps of 4 on tp2,dp2 and is
# killed (LOOM_CHECKPOINT_FAULT, SIGKILL) in the save of step 4 at one of its points: `write` (a rank's file is on
# disk, its manifest not), `index` (index.json written, not yet renamed into place), `rename` (in place, `latest` not
# yet updated); written in place and in the background. Each time `latest` still names step 2, loom-ckpt verify
# passes, and --resume runs steps 2 and 3 with the losses of the uninterrupted run, to every digit.
#   cmake -DTG=<train_gpt> -DCKPT=<loom-ckpt> -DDIR=<scratch> -P this
include(${CMAKE_CURRENT_LIST_DIR}/losses.cmake)
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})
set(common --no-progress --dtype f64 --dropout 0.1 --batch-order shuffle --batch 8 --seq 32 --parallel tp2,dp2)
execute_process(COMMAND ${TG} ${common} --steps 4 --log-json ${DIR}/straight.jsonl RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "0")
  message(FATAL_ERROR "train_gpt failed (exit ${rc}):\n${out}${err}")
endif()
foreach(mode "write" "write --async-save" "index --async-save" "index" "rename" "rename --async-save")
  separate_arguments(mode)
  list(POP_FRONT mode point)
  set(root ${DIR}/${point}${mode})
  execute_process(COMMAND ${CMAKE_COMMAND} -E env LOOM_CHECKPOINT_FAULT=${point}@4
                          ${TG} ${common} --steps 4 --save ${root} --save-every 2 ${mode}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc STREQUAL "0" OR NOT err MATCHES "killing the process at '${point}' of the save of step 4")
    message(FATAL_ERROR "${point} ${mode}: the job was not killed in the save (exit ${rc}):\n${out}${err}")
  endif()
  file(READ ${root}/latest latest)
  if(NOT latest STREQUAL "step-00000002\n")
    message(FATAL_ERROR "${point} ${mode}: latest names '${latest}' after the crash, not step-00000002")
  endif()
  execute_process(COMMAND ${CKPT} verify ${root} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "${point} ${mode}: loom-ckpt verify failed after the crash (exit ${rc}):\n${out}${err}")
  endif()
  execute_process(COMMAND ${TG} ${common} --steps 4 --resume ${root} --log-json ${root}.jsonl
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc STREQUAL "0" OR NOT out MATCHES "resuming [^\n]* at step 2\n")
    message(FATAL_ERROR "${point} ${mode}: --resume failed after the crash (exit ${rc}):\n${out}${err}")
  endif()
  expect_losses(${DIR}/straight.jsonl 2 ${root}.jsonl 0 2 0)
  message(STATUS "killed at '${point}' ${mode}: step 2 stays the latest and resumes exactly")
endforeach()
file(REMOVE_RECURSE ${DIR})  # kept only when a check failed

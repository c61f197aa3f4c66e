# train_gpt --resume continues a run exactly: 10 steps straight and 5 + 5 through a checkpoint give the same losses
# (double precision, dropout and shuffled batches on, so that the step is what keys both); a resume into dp2 runs;
# checkpoints move between tensor-parallel, pipeline, ZeRO and expert-parallel layouts.
#   cmake -DTG=<train_gpt> -DDIR=<scratch> -P this
include(${CMAKE_CURRENT_LIST_DIR}/losses.cmake)
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})
set(common --no-progress --dtype f64 --dropout 0.1 --batch-order shuffle --batch 8 --seq 32)
run(--steps 10 --log-json ${DIR}/straight.jsonl)
run(--steps 5 --save ${DIR}/ckpt)
if(NOT EXISTS ${DIR}/ckpt/step-00000005/index.json OR NOT EXISTS ${DIR}/ckpt/latest)
  message(FATAL_ERROR "the checkpoint lacks step-00000005/index.json or latest")
endif()
# the log `log` holds steps 5-9 with the straight run's losses, to every digit (0) or to `digits` characters
function(expect_continues log digits)
  expect_losses(${DIR}/straight.jsonl 5 ${log} 0 5 ${digits})
endfunction()
run(--steps 10 --resume ${DIR}/ckpt --log-json ${DIR}/resumed.jsonl)
expect_continues(${DIR}/resumed.jsonl 0)
# Saved every 2 steps in the background, the 2 newest kept: steps 4 and 5 (the end) stay, step 2 is gone, and
# --resume takes the latest, step 5.
run(--steps 5 --save ${DIR}/every --save-every 2 --keep 2 --async-save)
foreach(step 2 4 5)
  set(there NO)
  if(EXISTS ${DIR}/every/step-0000000${step}/index.json)
    set(there YES)
  endif()
  if(step EQUAL 2 AND there OR NOT step EQUAL 2 AND NOT there)
    message(FATAL_ERROR "--save-every 2 --keep 2: step-0000000${step} there: ${there}")
  endif()
endforeach()
run(--steps 10 --resume ${DIR}/every --log-json ${DIR}/resumed_every.jsonl)
expect_continues(${DIR}/resumed_every.jsonl 0)
message(STATUS "steps 5-9 have the same losses straight and resumed (saved in place, and in the background)")
run(--steps 7 --resume ${DIR}/ckpt --parallel dp2)

# A checkpoint loads into any layout: a run saved on tp4 resumes on one rank, and one saved on one rank resumes on
# tp2,sp,dp2, each continuing the straight run (to 9 digits: the layouts sum in different orders).
run(--steps 5 --parallel tp4 --save ${DIR}/ckpt_tp4)
run(--steps 10 --resume ${DIR}/ckpt_tp4 --log-json ${DIR}/from_tp4.jsonl)
expect_continues(${DIR}/from_tp4.jsonl 10)
run(--steps 10 --resume ${DIR}/ckpt --parallel tp2,sp,dp2 --log-json ${DIR}/into_tp2_sp_dp2.jsonl)
expect_continues(${DIR}/into_tp2_sp_dp2.jsonl 10)
run(--steps 5 --parallel tp2,pp2,dp2 --micro-batches 2 --save ${DIR}/ckpt_3d)
run(--steps 10 --resume ${DIR}/ckpt_3d --log-json ${DIR}/from_3d.jsonl)
expect_continues(${DIR}/from_3d.jsonl 10)
run(--steps 10 --resume ${DIR}/ckpt --parallel pp2 --schedule zb-h1 --micro-batches 2 --log-json ${DIR}/into_pp2.jsonl)
expect_continues(${DIR}/into_pp2.jsonl 10)
# Under ZeRO-1 each rank writes its shard of the optimizer state, and takes its shard of any other layout's.
run(--steps 5 --parallel dp4,zero1 --save ${DIR}/ckpt_zero1)
run(--steps 10 --resume ${DIR}/ckpt_zero1 --log-json ${DIR}/from_zero1.jsonl)
expect_continues(${DIR}/from_zero1.jsonl 10)
run(--steps 10 --resume ${DIR}/ckpt --parallel pp2,dp2,zero1 --micro-batches 2 --log-json ${DIR}/into_zero1.jsonl)
expect_continues(${DIR}/into_zero1.jsonl 10)
# Experts split over ep: each expert's tensors are written by its expert-data-parallel group (in even shares, or
# under ZeRO each rank its shard), so a run saved on dp2,ep2 resumes on one rank, one saved on one rank resumes on
# dp4,zero1,ep2, and one saved on dp4,zero3,ep2 resumes on dp2,ep2, each continuing the straight run.
set(moe --model tiny-moe)
run(${moe} --steps 10 --log-json ${DIR}/moe_straight.jsonl)
run(${moe} --steps 5 --parallel dp2,ep2 --save ${DIR}/moe_ep2)
run(${moe} --steps 10 --resume ${DIR}/moe_ep2 --log-json ${DIR}/moe_from_ep2.jsonl)
expect_losses(${DIR}/moe_straight.jsonl 5 ${DIR}/moe_from_ep2.jsonl 0 5 10)
run(${moe} --steps 5 --save ${DIR}/moe_single)
run(${moe} --steps 10 --resume ${DIR}/moe_single --parallel dp4,zero1,ep2 --log-json ${DIR}/moe_into_zero1.jsonl)
expect_losses(${DIR}/moe_straight.jsonl 5 ${DIR}/moe_into_zero1.jsonl 0 5 10)
run(${moe} --steps 5 --parallel dp4,zero3,ep2 --save ${DIR}/moe_zero3)
run(${moe} --steps 10 --resume ${DIR}/moe_zero3 --parallel dp2,ep2 --log-json ${DIR}/moe_from_zero3.jsonl)
expect_losses(${DIR}/moe_straight.jsonl 5 ${DIR}/moe_from_zero3.jsonl 0 5 10)
message(STATUS "saved on tp4, tp2,pp2,dp2, dp4,zero1, dp2,ep2, dp4,zero3,ep2 and one rank; resumed on one rank, "
               "tp2,sp,dp2, pp2, pp2,dp2,zero1, dp4,zero1,ep2 and dp2,ep2: the same run")
file(REMOVE_RECURSE ${DIR})  # kept only when a check failed

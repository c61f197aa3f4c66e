# train_gpt --device cuda saves sharded checkpoints from device memory and loads them back into it: a ZeRO-3 run
# saved after 3 steps and resumed continues the straight run to every digit, and the same checkpoint resumes on
# tp2 and on a pipeline (to 9 digits: the layouts sum in other orders); a run saved on the GPU resumes on the CPU.
# f64, dropout and shuffled batches on. Then bf16 on dp2,zero1 saved in the background (--async-save): the fp32
# master weights and moments come back, so the resumed run continues the straight one to every digit.
#   cmake -DTG=<train_gpt> -DDIR=<scratch> -P this
include(${CMAKE_CURRENT_LIST_DIR}/losses.cmake)
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})
set(common --no-progress --dtype f64 --dropout 0.1 --batch-order shuffle --batch 8 --seq 32)
set(gpu --device cuda)
run(${gpu} --parallel dp2,zero3 --steps 6 --log-json ${DIR}/straight.jsonl)
run(${gpu} --parallel dp2,zero3 --steps 3 --save ${DIR}/ckpt)
run(${gpu} --parallel dp2,zero3 --steps 6 --resume ${DIR}/ckpt --log-json ${DIR}/resumed.jsonl)
expect_losses(${DIR}/straight.jsonl 3 ${DIR}/resumed.jsonl 0 3 0)
run(${gpu} --parallel tp2 --steps 6 --resume ${DIR}/ckpt --log-json ${DIR}/into_tp2.jsonl)
expect_losses(${DIR}/straight.jsonl 3 ${DIR}/into_tp2.jsonl 0 3 10)
run(${gpu} --parallel pp2 --micro-batches 2 --steps 6 --resume ${DIR}/ckpt --log-json ${DIR}/into_pp2.jsonl)
expect_losses(${DIR}/straight.jsonl 3 ${DIR}/into_pp2.jsonl 0 3 10)
run(--parallel dp2,zero1 --steps 6 --resume ${DIR}/ckpt --log-json ${DIR}/on_cpu.jsonl)
expect_losses(${DIR}/straight.jsonl 3 ${DIR}/on_cpu.jsonl 0 3 10)
set(common --no-progress --dtype bf16 --dropout 0.1 --batch-order shuffle --batch 8 --seq 32)
run(${gpu} --parallel dp2,zero1 --steps 6 --log-json ${DIR}/bf16_straight.jsonl)
run(${gpu} --parallel dp2,zero1 --steps 3 --save ${DIR}/bf16_ckpt --async-save)
run(${gpu} --parallel dp2,zero1 --steps 6 --resume ${DIR}/bf16_ckpt --log-json ${DIR}/bf16_resumed.jsonl)
expect_losses(${DIR}/bf16_straight.jsonl 3 ${DIR}/bf16_resumed.jsonl 0 3 0)
message(STATUS "saved on the GPU under dp2,zero3; resumed there on dp2,zero3, tp2 and pp2, and on the CPU: the same run; "
               "bf16 on dp2,zero1 saved in the background and resumed: the same run")
file(REMOVE_RECURSE ${DIR})  # kept only when a check failed

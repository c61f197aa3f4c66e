# train_gpt on token shards (--train-data, --val-data): validation equal on one rank and on tp2.pp2.dp2 (double
# precision, to 9 digits), a cosine schedule, a run resumed on another layout continuing the straight one, a changed
# shard refused by name, and broken shards refused with their names and exit status 1.
#   cmake -DTG=<train_gpt> -DPY=<python3 with numpy> -DDIR=<scratch> -P this
include(${CMAKE_CURRENT_LIST_DIR}/losses.cmake)
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR}/data)
execute_process(COMMAND ${PY} -c "import numpy" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
if(NOT rc EQUAL 0)
  message(STATUS "no numpy here (${PY}): skipped")
  return()
endif()
execute_process(COMMAND ${PY} ${CMAKE_CURRENT_LIST_DIR}/write_shards.py ${DIR}/data RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "write_shards.py failed (exit ${rc}): ${err}")
endif()
set(common --no-progress --dtype f64 --batch 8 --seq 32 --batch-order shuffle --train-data ${DIR}/data/train_*.bin
           --val-data ${DIR}/data/val_*.bin --val-every 4 --val-batches 2 --lr-schedule cosine --warmup 2
           --min-lr 1e-4 --decay-steps 10)
function(run)
  execute_process(COMMAND ${TG} ${common} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "train_gpt ${ARGN} failed (exit ${rc}):\n${out}${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()
# the validation losses of a --log-json file, to 9 significant characters
function(val_losses log var)
  file(STRINGS ${log} lines)
  set(vals "")
  foreach(l ${lines})
    string(JSON v ERROR_VARIABLE none GET "${l}" val_loss)
    if(NOT none)
      string(SUBSTRING "${v}" 0 10 v)
      list(APPEND vals ${v})
    endif()
  endforeach()
  set(${var} "${vals}" PARENT_SCOPE)
endfunction()

run(--steps 10 --log-json ${DIR}/one.jsonl)
if(NOT out MATCHES "val       3  loss [0-9.]+  perplexity")
  message(FATAL_ERROR "no validation line after step 3:\n${out}")
endif()
run(--steps 10 --parallel tp2,pp2,dp2 --micro-batches 2 --log-json ${DIR}/spread.jsonl)
val_losses(${DIR}/one.jsonl one)
val_losses(${DIR}/spread.jsonl spread)
list(LENGTH one n)
if(NOT n EQUAL 3 OR NOT one STREQUAL spread)
  message(FATAL_ERROR "validation losses: one rank ${one}, tp2.pp2.dp2 ${spread} (3 each, equal to 9 digits)")
endif()
expect_losses(${DIR}/one.jsonl 0 ${DIR}/spread.jsonl 0 10 10)
# scripts/plot-log draws the log (where matplotlib is): the loss, the validation loss, lr and throughput.
execute_process(COMMAND ${PY} -c "import matplotlib" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
if(rc EQUAL 0)
  execute_process(COMMAND ${PY} ${CMAKE_CURRENT_LIST_DIR}/../scripts/plot-log ${DIR}/one.jsonl ${DIR}/one.png
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  file(SIZE ${DIR}/one.png png_bytes)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "10 steps of .* drawn in" OR png_bytes LESS 10000)
    message(FATAL_ERROR "plot-log failed (exit ${rc}, ${png_bytes} bytes of PNG):\n${out}${err}")
  endif()
endif()
# The cosine schedule: warm-up to the peak at step 1, min_lr from step 10 on.
file(STRINGS ${DIR}/one.jsonl lines)
list(GET lines 1 l1)
list(GET lines 9 l9)
string(JSON lr1 GET "${l1}" lr)
string(JSON lr9 GET "${l9}" lr)
if(NOT lr1 MATCHES "^0\\.00300000000" OR NOT lr9 MATCHES "^0\\.00021037")
  message(FATAL_ERROR "cosine: lr at step 1 is ${lr1} (0.003), at step 9 ${lr9} (1e-4 + 2.9e-3 (1 + cos(7pi/8))/2 = 2.1037e-4)")
endif()
# 5 steps, a checkpoint, 5 more on another layout: the straight run's losses.
run(--steps 5 --save ${DIR}/ckpt)
run(--steps 10 --resume ${DIR}/ckpt --parallel pp2,dp2 --micro-batches 2 --log-json ${DIR}/resumed.jsonl)
expect_losses(${DIR}/one.jsonl 5 ${DIR}/resumed.jsonl 0 5 10)
message(STATUS "validation equal on one rank and tp2.pp2.dp2; the run resumed on pp2.dp2 continues the straight one")

# Refusals: each names the file and exits 1.
function(refused what regex)
  execute_process(COMMAND ${TG} ${common} --steps 2 ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "${regex}")
    message(FATAL_ERROR "${what}: exit ${rc}, expected a refusal matching '${regex}':\n${out}${err}")
  endif()
endfunction()
file(READ ${DIR}/data/train_000001.bin bytes HEX)
string(SUBSTRING "${bytes}" 0 3000 head)
file(MAKE_DIRECTORY ${DIR}/bad)
file(WRITE ${DIR}/bad/short.hex "${head}")
execute_process(COMMAND ${PY} -c "import sys; open(sys.argv[2],'wb').write(bytes.fromhex(open(sys.argv[1]).read()))"
                ${DIR}/bad/short.hex ${DIR}/bad/train_000000.bin)
refused("a truncated shard" "train_000000.bin' has 1500 bytes but its header counts [0-9]+ tokens.*truncated"
        --train-data ${DIR}/bad/train_*.bin)
refused("an empty glob" "the data pattern '${DIR}/none_\\*.bin' names no file" --train-data ${DIR}/none_*.bin)
refused("a token outside the vocabulary"
        "big_000000.bin' holds token [0-9]+ at position [0-9]+, at or above the model's vocabulary of 256"
        --train-data ${DIR}/data/big_*.bin)
# The vocabulary at run time: --vocab 301 takes the shard of tokens up to 299, on one rank and on tp4 (76 rows on
# the first ranks, 73 on the last), with the same losses; --tokenizer sets the tokenizer's 512.
run(--steps 3 --train-data ${DIR}/data/big_*.bin --vocab 301 --log-json ${DIR}/vocab_one.jsonl)
if(NOT out MATCHES "train_gpt: model tiny \\(127552 parameters")
  message(FATAL_ERROR "--vocab 301: not tiny with 301 tokens (127552 parameters):\n${out}")
endif()
run(--steps 3 --train-data ${DIR}/data/big_*.bin --vocab 301 --parallel tp4 --log-json ${DIR}/vocab_tp4.jsonl)
expect_losses(${DIR}/vocab_one.jsonl 0 ${DIR}/vocab_tp4.jsonl 0 3 10)
run(--steps 1 --tokenizer ${CMAKE_CURRENT_LIST_DIR}/tokenizers/gpt2-512.json --parallel tp2)
if(NOT out MATCHES "model tiny \\(141056 parameters")
  message(FATAL_ERROR "--tokenizer gpt2-512.json: not tiny with 512 tokens (141056 parameters):\n${out}")
endif()

# A changed shard: the resumed run names it.
execute_process(COMMAND ${PY} -c "import sys; d=bytearray(open(sys.argv[1],'rb').read()); d[-1]^=1; open(sys.argv[1],'wb').write(d)"
                ${DIR}/data/train_000001.bin)
refused("a changed shard" "the data set changed: shard 1 of --train-data .* is 'train_000001.bin'"
        --steps 10 --resume ${DIR}/ckpt)

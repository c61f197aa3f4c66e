# Generation from the command line: train_gpt --sample-every on tp2.pp2 logs samples, the last equal to loom-generate's
# greedy text from the checkpoint the run saved; loom-generate gives the same greedy tokens on tp1, tp2 and tp4 and from
# the checkpoint's Hugging Face export; a seed draws the same text again and another seed another; a Llama trained
# with a tokenizer generates through it (found in the run record); bad input ends in a message and a non-zero exit.
#   cmake -DTG=<train_gpt> -DLG=<loom-generate> -DLC=<loom-ckpt> -DTOK=<tokenizer.json> -DDIR=<scratch> -P this
file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})
function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (exit ${rc}):\n${ARGN}\n${out}${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
endfunction()
# The generated ids of a --json file.
function(generated file var)
  file(READ ${file} j)
  string(JSON ids GET "${j}" generated_ids)
  set(${var} "${ids}" PARENT_SCOPE)
endfunction()
# A run that must fail with exit status `code` and a message matching `pattern`.
function(refused code pattern)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL code OR NOT "${out}${err}" MATCHES "${pattern}")
    message(FATAL_ERROR "expected exit ${code} and '${pattern}' from\n${ARGN}\ngot exit ${rc}:\n${out}${err}")
  endif()
endfunction()

# train_gpt on bytes, on two pipeline stages of two tensor-parallel ranks, sampling every 10 steps after "Th".
run(train_gpt ${TG} --no-progress --steps 20 --batch 8 --seq 32 --parallel tp2,pp2 --micro-batches 2 --sample-every 10
    --sample-tokens 24 --prompt "Th" --save ${DIR}/ckpt --log-json ${DIR}/log.jsonl)
if(NOT out MATCHES "sample    9  \"Th[^\n]*\"\nsample   19  \"Th[^\n]*\"\nstep +19 ")
  message(FATAL_ERROR "no sample lines after steps 9 and 19:\n${out}")
endif()
file(STRINGS ${DIR}/log.jsonl lines)
list(GET lines 19 last)
string(JSON sample GET "${last}" sample)
string(LENGTH "${sample}" n)

# loom-generate from the checkpoint, greedy in f32 on one rank, as the sample was made: the same text.
run(loom-generate ${LG} ${DIR}/ckpt --prompt "Th" --max-new-tokens 24 --json ${DIR}/tp1.json)
file(READ ${DIR}/tp1.json j)
string(JSON text GET "${j}" text)
if(NOT "Th${text}" STREQUAL "${sample}" OR NOT n EQUAL 26)
  message(FATAL_ERROR "train_gpt's last sample '${sample}' is not loom-generate's 'Th${text}'")
endif()
if(NOT err MATCHES "prompt 2 tokens in .* 24 new tokens \\([0-9.]+ tokens/s after the first\\)")
  message(FATAL_ERROR "loom-generate reports no speed:\n${err}")
endif()

# The same greedy tokens in double on tp1, tp2, tp4, and from the Hugging Face export.
run(export ${LC} export-hf ${DIR}/ckpt ${DIR}/hf)
set(gen --prompt-ids 84,104,101,32 --max-new-tokens 40 --dtype f64)
run(tp1 ${LG} ${DIR}/ckpt ${gen} --json ${DIR}/a.json)
generated(${DIR}/a.json one)
foreach(where "--parallel;tp2" "--parallel;tp4" "")
  set(dir ${DIR}/ckpt)
  if(where STREQUAL "")
    set(dir ${DIR}/hf)
  endif()
  run("${where}" ${LG} ${dir} ${gen} ${where} --json ${DIR}/b.json)
  generated(${DIR}/b.json other)
  if(NOT one STREQUAL other)
    message(FATAL_ERROR "greedy tokens differ: tp1 ${one}, ${dir} ${where} ${other}")
  endif()
endforeach()

# Sampling: a seed draws the same text again on any layout, another seed another.
set(sampled ${gen} --temperature 1.0 --top-k 50 --top-p 0.95)
run(seed ${LG} ${DIR}/ckpt ${sampled} --seed 5 --json ${DIR}/s5.json)
run(seed ${LG} ${DIR}/ckpt ${sampled} --seed 5 --parallel tp2 --json ${DIR}/s5b.json)
run(seed ${LG} ${DIR}/ckpt ${sampled} --seed 6 --json ${DIR}/s6.json)
generated(${DIR}/s5.json s5)
generated(${DIR}/s5b.json s5b)
generated(${DIR}/s6.json s6)
if(NOT s5 STREQUAL s5b OR s5 STREQUAL s6)
  message(FATAL_ERROR "seed 5: ${s5} and on tp2 ${s5b}; seed 6: ${s6}")
endif()

# A Llama trained with a tokenizer: samples decoded by it; loom-generate finds it in the run record and encodes the
# prompt with it (fewer tokens than bytes).
run(llama ${TG} --no-progress --model llama-tiny --steps 4 --batch 4 --seq 32 --tokenizer ${TOK} --sample-every 4
    --sample-tokens 8 --prompt "The model" --save ${DIR}/llama)
if(NOT out MATCHES "sample    3  \"")
  message(FATAL_ERROR "no sample from the Llama:\n${out}")
endif()
run(llama ${LG} ${DIR}/llama --prompt "The model" --max-new-tokens 8 --no-stop --json ${DIR}/llama.json)
file(READ ${DIR}/llama.json j)
string(JSON np LENGTH "${j}" prompt_ids)
string(JSON ng LENGTH "${j}" generated_ids)
if(NOT np LESS 9 OR NOT ng EQUAL 8 OR NOT out MATCHES "^The model")
  message(FATAL_ERROR "loom-generate with the run's tokenizer: ${np} prompt tokens, ${ng} generated:\n${out}")
endif()

# Bad input.
refused(1 "no-such is not a directory" ${LG} ${DIR}/no-such --prompt "a")
refused(1 "prompt token 300 at position 1 is outside the model's vocabulary 0..255" ${LG} ${DIR}/ckpt
        --prompt-ids 1,300)
refused(1 "a prompt of 2 tokens and --max-new-tokens 200 exceed the model's 128 positions" ${LG} ${DIR}/ckpt
        --prompt "ab" --max-new-tokens 200)
refused(1 "top-p must be in \\(0, 1\\], got 2" ${LG} ${DIR}/ckpt --prompt "ab" --top-p 2)
refused(1 "the tokenizer .* has 512 tokens but the model's vocabulary is 256" ${LG} ${DIR}/ckpt --prompt "ab"
        --tokenizer ${TOK})
refused(2 "--parallel tp3: loom-generate decodes on tp1, tp2 or tp4" ${LG} ${DIR}/ckpt --prompt "ab" --parallel tp3)
refused(2 "give the prompt as --prompt TEXT or as --prompt-ids LIST" ${LG} ${DIR}/ckpt)
refused(2 "--prompt-ids: 'x' is not a token id" ${LG} ${DIR}/ckpt --prompt-ids 1,x)
refused(1 "--prompt says how to sample, but no --sample-every N is given" ${TG} --prompt "ab" --steps 1)
refused(1 "--prompt of 2 tokens and --sample-tokens 200 exceed the model's 128 positions" ${TG} --steps 1
        --sample-every 1 --sample-tokens 200 --prompt "ab")
message(STATUS "generation: greedy ${one}; samples equal to loom-generate's")

# A model family through checkpoints and Hugging Face's files: train_gpt --model MODEL saves a sharded checkpoint on
# tp2,dp2; loom-ckpt export-hf writes it in the family's Hugging Face names and layouts (config.json of model_type
# TYPE, q_proj and the rest); a run --init-from the export, and a run whose --model is the export itself (its shape
# from config.json), start from exactly the saved weights. The data repeats every 5 batches (sequential order, B = 4,
# T = 16, as in train_gpt_checkpoint.cmake), so their first loss must be step 5's of an uninterrupted run, to 9
# significant digits (the checkpoint was written on tp2,dp2, which sums in another order).
#   cmake -DTG=<train_gpt> -DCKPT=<loom-ckpt> -DDIR=<dir> -DMODEL=llama-tiny -DTYPE=llama -DTENSOR=<a tensor name> -P this
include(${CMAKE_CURRENT_LIST_DIR}/train_gpt_checkpoint_common.cmake)
function(first_loss log out)
  file(STRINGS ${log} lines)
  list(GET lines 0 line)
  string(JSON l GET "${line}" loss)
  set(${out} "${l}" PARENT_SCOPE)
endfunction()

run(--model ${MODEL} --steps 6 --log-json ${DIR}/straight.jsonl)
run(--model ${MODEL} --steps 5 --parallel tp2,dp2 --save ${DIR}/ckpt)
execute_process(COMMAND ${CKPT} export-hf ${DIR}/ckpt ${DIR}/hf RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "loom-ckpt export-hf failed (exit ${rc}):\n${out}${err}")
endif()
file(READ ${DIR}/hf/config.json config)
string(JSON type GET "${config}" model_type)
if(NOT type STREQUAL "${TYPE}")
  message(FATAL_ERROR "export-hf wrote model_type '${type}', not '${TYPE}':\n${config}")
endif()
file(READ ${DIR}/hf/model.safetensors head OFFSET 8 LIMIT 65536 HEX)  # the header, past its 8-byte length
string(HEX "\"${TENSOR}\"" name)
string(FIND "${head}" "${name}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "export-hf wrote no tensor ${TENSOR}")
endif()
run(--model ${MODEL} --steps 1 --init-from ${DIR}/hf --log-json ${DIR}/init_hf.jsonl)
run(--model ${DIR}/hf --steps 1 --init-from ${DIR}/hf --log-json ${DIR}/model_hf.jsonl)
file(STRINGS ${DIR}/straight.jsonl lines)
list(GET lines 5 line)
string(JSON fifth GET "${line}" loss)
list(GET lines 0 line)
string(JSON first GET "${line}" loss)
first_loss(${DIR}/init_hf.jsonl loaded)
first_loss(${DIR}/model_hf.jsonl from_config)
message(STATUS "${MODEL}: step 0 ${first}, step 5 ${fifth}; from the export ${loaded}, with its config ${from_config}")
if(fifth STREQUAL first)
  message(FATAL_ERROR "five steps did not change the loss on the repeated batch (${first}): the test shows nothing")
endif()
string(SUBSTRING "${fifth}" 0 10 want)
string(SUBSTRING "${loaded}" 0 10 got)
if(NOT got STREQUAL want)
  message(FATAL_ERROR "--init-from the export: the first loss is ${loaded}, the saved weights give ${fifth}")
endif()
if(NOT from_config STREQUAL loaded)
  message(FATAL_ERROR "--model <the export>: the first loss is ${from_config}, with --model ${MODEL} ${loaded}")
endif()
file(REMOVE_RECURSE ${DIR})  # kept only when a check failed

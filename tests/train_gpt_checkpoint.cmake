# train_gpt --save writes a sharded checkpoint (and no temporary file); loom-ckpt reads it (info, verify, export-hf);
# --init-from starts a new run from exactly its weights, given the loom checkpoint or its Hugging Face export.
# The data is made so that batch 5 is batch 0 (sequential order, B = 4, T = 16: row r of batch b starts at
# ((4b + r)·16) mod (N − 17), and N − 17 = 320 = 5·4·16), so the first loss of a run initialised from the weights
# saved after 5 steps must be the loss of step 5 of the run that saved them: the same weights on the same batch. In
# double, to every digit on one rank and to 9 significant digits on tp2,sp (it sums in another order).
#   cmake -DTG=<train_gpt> -DCKPT=<loom-ckpt> -DDIR=<dir> -P this
include(${CMAKE_CURRENT_LIST_DIR}/train_gpt_checkpoint_common.cmake)
# loom-ckpt ARGS must exit with status `want` and print what matches `regex` (stdout and stderr together)
function(ckpt want regex)
  execute_process(COMMAND ${CKPT} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc STREQUAL "${want}")
    message(FATAL_ERROR "loom-ckpt ${ARGN}: exit ${rc}, expected ${want}:\n${out}${err}")
  endif()
  if(NOT "${out}${err}" MATCHES "${regex}")
    message(FATAL_ERROR "loom-ckpt ${ARGN}: the output does not match '${regex}':\n${out}${err}")
  endif()
endfunction()
# the loss that line `i` of a --log-json file holds, after checking that it is step `step`
function(loss_at log i step out)
  file(STRINGS ${log} lines)
  list(GET lines ${i} line)
  string(JSON s GET "${line}" step)
  string(JSON l GET "${line}" loss)
  if(NOT s EQUAL step)
    message(FATAL_ERROR "${log}: line ${i} is step ${s}, not ${step}")
  endif()
  set(${out} "${l}" PARENT_SCOPE)
endfunction()

run(--steps 6 --log-json ${DIR}/straight.jsonl)
run(--steps 5 --parallel tp2,dp2 --save ${DIR}/ckpt)
set(saved ${DIR}/ckpt/step-00000005)
foreach(f index.json rank-00000.safetensors rank-00001.safetensors rank-00002.safetensors rank-00003.safetensors)
  if(NOT EXISTS ${saved}/${f})
    message(FATAL_ERROR "the checkpoint lacks ${f}")
  endif()
endforeach()
file(GLOB left ${DIR}/ckpt/.* ${DIR}/ckpt/*.tmp ${saved}/*.tmp ${saved}/rank-*.json)
if(left)
  message(FATAL_ERROR "temporary files were left behind: ${left}")
endif()
file(READ ${DIR}/ckpt/latest latest)
if(NOT latest STREQUAL "step-00000005\n")
  message(FATAL_ERROR "ckpt/latest names '${latest}', not step-00000005")
endif()

ckpt(0 "next step 5, optimizer adamw \\(step counter 5\\), written on layout tp2.dp2\n.*h.0.attn.c_attn.weight +f64 +\\[64, 192\\] +[0-9]+ chunks.*adamw.exp_avg/wte.weight"
     info ${DIR}/ckpt)
ckpt(0 "every checksum matches" verify ${DIR}/ckpt)
ckpt(0 "wrote" export-hf ${DIR}/ckpt ${DIR}/hf)
foreach(f model.safetensors config.json)
  if(NOT EXISTS ${DIR}/hf/${f})
    message(FATAL_ERROR "export-hf wrote no ${f}")
  endif()
endforeach()
ckpt(2 "usage: loom-ckpt" info)
ckpt(1 "loom: no checkpoint at ${DIR}/none: it does not exist" verify ${DIR}/none)
# A truncated file: verify names it and the tensor whose bytes are gone, and exits 1.
file(COPY ${saved}/ DESTINATION ${DIR}/cut)
execute_process(COMMAND truncate -s -8 ${DIR}/cut/rank-00003.safetensors RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "truncate failed: ${rc}")
endif()
ckpt(1 "loom: ${DIR}/cut/rank-00003.safetensors is truncated: it holds [0-9]+ bytes, ${DIR}/cut/index.json says [0-9]+ \\(tensor '[^']+' lies at bytes \\[[0-9]+, [0-9]+\\) of it\\); the checkpoint is damaged"
     verify ${DIR}/cut)
# --init-from the same checkpoint is refused too, before it reads a byte, whatever part of the file was lost.
execute_process(COMMAND ${TG} ${common} --steps 1 --init-from ${DIR}/cut RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
if(NOT rc EQUAL 1 OR NOT "${out}${err}" MATCHES "rank-00003.safetensors is truncated: .* the checkpoint is damaged")
  message(FATAL_ERROR "--init-from a damaged checkpoint: exit ${rc}, expected 1 and the file named:\n${out}${err}")
endif()

run(--steps 1 --init-from ${DIR}/ckpt --log-json ${DIR}/init.jsonl)
run(--steps 1 --init-from ${DIR}/hf --log-json ${DIR}/init_hf.jsonl)
run(--steps 1 --init-from ${DIR}/ckpt --parallel tp2,sp --log-json ${DIR}/init_tp2_sp.jsonl)
loss_at(${DIR}/straight.jsonl 0 0 first)
loss_at(${DIR}/straight.jsonl 5 5 fifth)
loss_at(${DIR}/init.jsonl 0 0 loaded)
loss_at(${DIR}/init_hf.jsonl 0 0 loaded_hf)
loss_at(${DIR}/init_tp2_sp.jsonl 0 0 loaded_tp)
message(STATUS "step 0 ${first}, step 5 ${fifth}; from the checkpoint: ${loaded}, its export ${loaded_hf}, "
               "on tp2,sp ${loaded_tp}")
if(fifth STREQUAL first)
  message(FATAL_ERROR "five steps did not change the loss on the repeated batch (${first}): the test shows nothing")
endif()
# saved on tp2,dp2: 9 significant digits; the loads of the same weights agree to every digit
string(SUBSTRING "${fifth}" 0 10 want)
foreach(got loaded loaded_tp)
  string(SUBSTRING "${${got}}" 0 10 g)
  if(NOT g STREQUAL want)
    message(FATAL_ERROR "--init-from (${got}): the first loss is ${${got}}, the saved weights give ${fifth}")
  endif()
endforeach()
if(NOT loaded_hf STREQUAL loaded)
  message(FATAL_ERROR "--init-from the export: the first loss is ${loaded_hf}, from the checkpoint ${loaded}")
endif()
file(REMOVE_RECURSE ${DIR})  # kept only when a check failed

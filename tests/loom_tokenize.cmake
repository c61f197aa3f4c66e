# loom-tokenize on three documents (the first for validation, the training tokens over several shards), its shards
# checked by tokenize_check.py against Hugging Face tokenizers, read with numpy as llm.c reads them.
#   cmake -DLT=<loom-tokenize> -DPY=<python with tokenizers and numpy> -DTOK=<tokenizer.json> -DDIR=<scratch>
#         "-DFILES=a;b;c" -P this
file(REMOVE_RECURSE ${DIR})
execute_process(COMMAND ${LT} --tokenizer ${TOK} --out ${DIR} --val-fraction 0.3 --shard-tokens 6000 --no-progress
                        ${FILES} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "3 documents, .* MB/s\\): [0-9]+ validation tokens in [0-9]+ shards?, ")
  message(FATAL_ERROR "loom-tokenize failed (exit ${rc}):\n${out}${err}")
endif()
execute_process(COMMAND ${PY} -c "import tokenizers, numpy" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
if(NOT rc EQUAL 0)
  message(STATUS "no tokenizers here (${PY}): skipped")
  return()
endif()
execute_process(COMMAND ${PY} ${CMAKE_CURRENT_LIST_DIR}/tokenize_check.py ${TOK} ${DIR} ${FILES}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the shards are not tokenizers' ids (exit ${rc}):\n${out}${err}")
endif()
message(STATUS "${out}")

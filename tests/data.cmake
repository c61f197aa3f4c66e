# Training data: token shards and learning-rate schedules.
loom_add_test(test_data test_data.cpp LABELS data)

# Text generation: decoding with a key/value cache against the whole model, on one rank and over tensor parallelism.
loom_add_test(test_generate test_generate.cpp LABELS "data;model")

# train_gpt on token shards written with numpy (Debian's python3-numpy, beside python3-torch): validation on every
# layout, the schedule, resuming, refusals. Skipped where numpy is missing.
if(TARGET train_gpt)
  find_program(LOOM_NUMPY_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
  if(NOT LOOM_NUMPY_PYTHON)
    find_program(LOOM_NUMPY_PYTHON NAMES python3)
  endif()
  add_test(NAME train_gpt_token_shards
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DPY=${LOOM_NUMPY_PYTHON}
            -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_shards -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_shards.cmake)
  set_tests_properties(train_gpt_token_shards PROPERTIES LABELS "data;model" SKIP_REGULAR_EXPRESSION "no numpy here")
endif()

# The tokenizer against Hugging Face tokenizers (PCRE2 for its patterns; skipped where pcre2 or the Python is missing).
if(TARGET loom::tokenizer AND nlohmann_json_FOUND)
  add_executable(test_tokenizer test_tokenizer.cpp)
  target_link_libraries(test_tokenizer PRIVATE loom::loom loom::tokenizer nlohmann_json::nlohmann_json)
  target_include_directories(test_tokenizer PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_compile_definitions(test_tokenizer PRIVATE LOOM_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                             LOOM_HF_PYTHON="${LOOM_HF_PYTHON}")
  add_test(NAME test_tokenizer COMMAND test_tokenizer)
  set_tests_properties(test_tokenizer PROPERTIES LABELS data SKIP_RETURN_CODE 77)
endif()

# loom-tokenize: three documents, the first for validation, the training tokens over two shards; read back with numpy
# as llm.c does and held against Hugging Face tokenizers' ids (in scripts/install-deps' environment, with numpy).
if(TARGET loom-tokenize)
  set(_docs ${PROJECT_SOURCE_DIR}/docs/data.md ${PROJECT_SOURCE_DIR}/docs/mesh.md ${PROJECT_SOURCE_DIR}/README.md)
  add_test(NAME loom_tokenize_shards
    COMMAND ${CMAKE_COMMAND} -DLT=$<TARGET_FILE:loom-tokenize> -DPY=${LOOM_HF_PYTHON}
            -DTOK=${PROJECT_SOURCE_DIR}/tests/tokenizers/gpt2-512.json -DDIR=${LOOM_TEST_SCRATCH}/loom_tokenize
            "-DFILES=${_docs}" -P ${CMAKE_CURRENT_SOURCE_DIR}/loom_tokenize.cmake)
  set_tests_properties(loom_tokenize_shards PROPERTIES LABELS data SKIP_REGULAR_EXPRESSION "no tokenizers here")
endif()

# train_gpt --log-dir: a log per process under mpirun.
if(TARGET train_gpt AND LOOM_WITH_MPI)
  add_test(NAME train_gpt_mpi_log_dir
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> "-DMPI=${MPIEXEC_EXECUTABLE};--oversubscribe;--bind-to;none"
            -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_log_dir -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_log_dir.cmake)
  set_tests_properties(train_gpt_mpi_log_dir PROPERTIES LABELS "data;mpi"
                       ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
endif()

# Generation from the command line: train_gpt's samples, loom-generate on every tensor-parallel degree and from a
# Hugging Face export, seeds, a tokenizer from the run record, refusals.
if(TARGET train_gpt AND TARGET loom-generate)
  add_test(NAME loom_generate
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DLG=$<TARGET_FILE:loom-generate>
            -DLC=$<TARGET_FILE:loom-ckpt> -DTOK=${PROJECT_SOURCE_DIR}/tests/tokenizers/llama3-512.json
            -DDIR=${LOOM_TEST_SCRATCH}/loom_generate -P ${CMAKE_CURRENT_SOURCE_DIR}/loom_generate.cmake)
  set_tests_properties(loom_generate PROPERTIES LABELS "data;model")
endif()

# bench/data runs: each section's rows (small sizes, without the Python references).
if(TARGET data AND TARGET loom-tokenize)
  add_test(NAME bench_data_runs
    COMMAND ${CMAKE_COMMAND}
            "-DCMD=$<TARGET_FILE:data>;--sections;generate,tokenize;--models;llama-tiny;--new-tokens;4;--corpus-mb;0.2;--no-reference"
            "-DEXPECT_REGEX=generate +llama-tiny, prompt 16, 4 new tokens \\(f32\\) +loom +[0-9]+ +[0-9.]+ tokens/s.*tokenize +gpt2-512.json, [0-9]+ documents, 0 MB +loom-tokenize +2 +[0-9.]+ MB/s"
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_success.cmake)
  set_tests_properties(bench_data_runs PROPERTIES LABELS "data;bench")
endif()

# Tensors, data, checkpoints, the GPT model and train_gpt.

# loom_add_mpi_test(TARGET SOURCE LABELS labels [DEFS definitions...]): an executable run under mpirun with 2, 4
# and 8 processes, as tests TARGET_np2, TARGET_np4, TARGET_np8.
function(loom_add_mpi_test target source)
  cmake_parse_arguments(A "" "" "LABELS;DEFS" ${ARGN})
  add_executable(${target} ${source})
  target_link_libraries(${target} PRIVATE loom::mpi)
  target_include_directories(${target} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  if(A_DEFS)
    target_compile_definitions(${target} PRIVATE ${A_DEFS})
  endif()
  foreach(np 2 4 8)
    add_test(NAME ${target}_np${np}
             COMMAND ${MPIEXEC_EXECUTABLE} --oversubscribe --bind-to none -np ${np} $<TARGET_FILE:${target}>)
    set_tests_properties(${target}_np${np} PROPERTIES LABELS "${A_LABELS}" TIMEOUT 300
      ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;LOOM_TIMEOUT_S=120;OMP_NUM_THREADS=1")
  endforeach()
endfunction()
if(nlohmann_json_FOUND)
  loom_add_test(test_tensor test_tensor.cpp LIBS nlohmann_json::nlohmann_json LABELS model)
endif()
if(nlohmann_json_FOUND)
  loom_add_test(test_gpt test_gpt.cpp LIBS nlohmann_json::nlohmann_json LABELS model)
endif()
if(nlohmann_json_FOUND)
  # The model against PyTorch (Debian's python3-torch); skipped where it is missing.
  add_executable(test_gpt_torch test_gpt_torch.cpp)
  target_link_libraries(test_gpt_torch PRIVATE loom::loom nlohmann_json::nlohmann_json)
  target_compile_definitions(test_gpt_torch PRIVATE LOOM_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  add_test(NAME test_gpt_torch COMMAND test_gpt_torch)
  set_tests_properties(test_gpt_torch PROPERTIES LABELS "model" SKIP_RETURN_CODE 77 TIMEOUT 300)
endif()

if(TARGET train_gpt)
  # train_gpt: bad input ends in one clear message and a non-zero exit; a checkpoint saved by one run loads in another.
  set(_tg $<TARGET_FILE:train_gpt>)
  set(_ef ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/empty.txt "")
  # name | arguments separated by ^ | text the message must contain
  foreach(case
      "missing_data|--data^/nonexistent/corpus.txt|loom: cannot open the data file '/nonexistent/corpus.txt'"
      "empty_data|--data^${CMAKE_CURRENT_BINARY_DIR}/empty.txt|is empty"
      "seq_too_long|--seq^500|loom: --seq 500 is longer than the model's max_seq 128"
      "unknown_flag|--colour^red|loom: unknown flag '--colour'"
      "unknown_model|--model^huge|loom: unknown --model 'huge' (tiny, small, gpt2)"
      "bad_number|--steps^ten|loom: --steps needs a number, got 'ten'"
      "non_finite_loss|--lr^1e30^--grad-clip^0^--steps^20|loom: the"
      "too_many_ranks|--parallel^tp2,cp2|loom: --parallel tp2,cp2 needs 4 ranks"
      "sp_without_tp|--parallel^sp,dp2|loom: --parallel sp,dp2: sp (sequence parallelism) splits over the tp ranks"
      "shape_cannot_split|--parallel^tp8^--model^tiny|loom: --model tiny cannot run on --parallel tp8: heads must be divisible by TP"
      "sp_seq_cannot_split|--parallel^tp4,sp^--seq^30|sequence parallelism splits each sequence over tp = 4 ranks, but --seq 30"
      "layers_cannot_split|--parallel^pp2,v2^--schedule^interleaved|loom: --model tiny has 2 layers, which do not split over 4 pipeline parts"
      "split_does_not_add_up|--parallel^pp2^--model^small^--layer-split^1,2|loom: the layer split adds up to 3 layers but the model has 4"
      "split_without_pp|--parallel^dp2^--layer-split^1,1|loom: --layer-split splits the layers over pipeline stages, but the layout dp2 has none"
      "interleaved_needs_chunks|--parallel^pp2^--schedule^interleaved^--micro-batches^2|loom: the interleaved schedule needs v >= 2 chunks per stage, got v = 1"
      "resume_and_init_from|--resume^a^--init-from^b|loom: --resume and --init-from exclude each other"
      "resume_without_checkpoint|--resume^/nonexistent/run|loom: cannot open /nonexistent/run/config.json")
    string(REPLACE "|" ";" parts "${case}")
    list(GET parts 0 name)
    list(GET parts 1 args)
    list(GET parts 2 expect)
    string(REPLACE "^" ";" args "${args}")
    add_test(NAME train_gpt_rejects_${name}
      COMMAND ${CMAKE_COMMAND} "-DCMD=${_tg};--no-progress;${args}" "-DEXPECT=${expect}" -P ${_ef})
    set_tests_properties(train_gpt_rejects_${name} PROPERTIES LABELS "model;failure")
  endforeach()
  add_test(NAME train_gpt_save_and_init_from
    COMMAND ${CMAKE_COMMAND} -DTG=${_tg} -DDIR=${CMAKE_CURRENT_BINARY_DIR}/train_gpt_ckpt
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_checkpoint.cmake)
  set_tests_properties(train_gpt_save_and_init_from PROPERTIES LABELS model)
endif()

# Data parallelism against the single-rank run.
loom_add_test(test_data_parallel test_data_parallel.cpp LABELS "ddp;model")
if(LOOM_WITH_MPI)
  loom_add_mpi_test(test_data_parallel_mpi test_data_parallel_mpi.cpp LABELS "mpi;ddp")
endif()

if(TARGET train_gpt AND LOOM_WITH_MPI)
  # train_gpt as MPI processes: a data-parallel run, and a launch with the wrong number of processes.
  set(_mpi_env "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMP_NUM_THREADS=1")
  add_test(NAME train_gpt_mpi_dp2
    COMMAND ${MPIEXEC_EXECUTABLE} --oversubscribe --bind-to none -np 2 $<TARGET_FILE:train_gpt> --no-progress
            --backend mpi --parallel dp2 --steps 5)
  set_tests_properties(train_gpt_mpi_dp2 PROPERTIES LABELS "mpi;model" ENVIRONMENT "${_mpi_env}"
                       PASS_REGULAR_EXPRESSION "layout dp2 \\(mpi\\).*in 5 steps \\(0 skipped\\)")
  add_test(NAME train_gpt_mpi_tp2_sp_dp2
    COMMAND ${MPIEXEC_EXECUTABLE} --oversubscribe --bind-to none -np 4 $<TARGET_FILE:train_gpt> --no-progress
            --backend mpi --parallel tp2,sp,dp2 --steps 5)
  set_tests_properties(train_gpt_mpi_tp2_sp_dp2 PROPERTIES LABELS "mpi;model;tp" ENVIRONMENT "${_mpi_env}"
                       PASS_REGULAR_EXPRESSION "layout tp2.sp.dp2 \\(mpi\\).*in 5 steps \\(0 skipped\\)")
  add_test(NAME train_gpt_mpi_wrong_size
    COMMAND ${CMAKE_COMMAND} "-DCMD=${MPIEXEC_EXECUTABLE};--oversubscribe;-np;3;$<TARGET_FILE:train_gpt>;--backend;mpi;--parallel;dp2"
            "-DEXPECT=loom: the layout dp2 needs 2 ranks, but the job was launched with 3" -P ${_ef})
  set_tests_properties(train_gpt_mpi_wrong_size PROPERTIES LABELS "mpi;model;failure" ENVIRONMENT "${_mpi_env}")
endif()

if(LOOM_WITH_CUDA)
  # Tensor<T, Cuda> (label gpu; skipped without a device).
  add_executable(test_tensor_cuda test_tensor_cuda.cpp)
  target_link_libraries(test_tensor_cuda PRIVATE loom::loom loom::cuda)
  add_test(NAME test_tensor_cuda COMMAND test_tensor_cuda)
  set_tests_properties(test_tensor_cuda PROPERTIES LABELS "gpu" SKIP_RETURN_CODE 77)
endif()

if(TARGET train_gpt)
  add_test(NAME train_gpt_tensor_parallel_layouts
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${CMAKE_CURRENT_BINARY_DIR}/train_gpt_layouts
            "-DLAYOUTS=tp2;tp4,sp;tp2,sp,dp2;tp4,dp2;tp2,dp4" -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  set_tests_properties(train_gpt_tensor_parallel_layouts PROPERTIES LABELS "model;tp")
  add_test(NAME train_gpt_pipeline_layouts
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${CMAKE_CURRENT_BINARY_DIR}/train_gpt_pp_layouts
            "-DLAYOUTS=pp2;tp2,pp2,dp2;tp2,sp,pp2,dp2;pp2,dp4" "-DEXTRA=--micro-batches;2;--schedule;zb-h1"
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  set_tests_properties(train_gpt_pipeline_layouts PROPERTIES LABELS "model;pipeline")
  # An uneven split of small's four blocks: one on the first stage (beside the embedding), three on the last.
  add_test(NAME train_gpt_pipeline_layer_split
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${CMAKE_CURRENT_BINARY_DIR}/train_gpt_pp_split
            "-DLAYOUTS=pp2 --layer-split 1,3;tp2,pp2,dp2 --layer-split 3,1"
            "-DEXTRA=--model;small;--micro-batches;2" -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  set_tests_properties(train_gpt_pipeline_layer_split PROPERTIES LABELS "model;pipeline")
  if(LOOM_WITH_CUDA)
    # --device cuda: one rank, and two ranks sharing the GPU, log the CPU's losses (f64, dropout) to 9 digits.
    add_test(NAME train_gpt_cuda_layouts
      COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${CMAKE_CURRENT_BINARY_DIR}/train_gpt_cuda
              "-DLAYOUTS=single --device cuda;dp2 --device cuda" -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
    set_tests_properties(train_gpt_cuda_layouts PROPERTIES LABELS "gpu;model"
                         SKIP_REGULAR_EXPRESSION "no CUDA device here")
  endif()
  add_test(NAME train_gpt_resume_continues_the_run
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${CMAKE_CURRENT_BINARY_DIR}/train_gpt_resume
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_resume.cmake)
  set_tests_properties(train_gpt_resume_continues_the_run PROPERTIES LABELS model)
endif()

# Tensor (and sequence) parallelism against the single-rank run, once per attention shape.
foreach(shape mha gqa mqa)
  loom_add_test(test_tensor_parallel_${shape} test_tensor_parallel.cpp LABELS "tp;model")
  target_compile_definitions(test_tensor_parallel_${shape} PRIVATE LOOM_TP_SHAPE=loom::test::tp::${shape})
endforeach()
if(LOOM_WITH_MPI)
  foreach(shape mha gqa mqa)
    loom_add_mpi_test(test_tensor_parallel_mpi_${shape} test_tensor_parallel_mpi.cpp LABELS "mpi;tp"
                      DEFS LOOM_TP_SHAPE=loom::test::tp::${shape} LOOM_TP_SHAPE_NAME="${shape}")
  endforeach()
endif()

# Parts of the model (pipeline stages) against the whole model.
loom_add_test(test_gpt_parts test_gpt_parts.cpp LABELS "model;pipeline")

# Pipeline parallelism (every schedule, and with TP, SP and DP) against the single-rank run.
loom_add_test(test_pipeline_parallel test_pipeline_parallel.cpp LABELS "pipeline;model")
if(LOOM_WITH_MPI)
  loom_add_mpi_test(test_pipeline_parallel_mpi test_pipeline_parallel_mpi.cpp LABELS "mpi;pipeline")
endif()
loom_add_test(test_pipeline_executor test_pipeline_executor.cpp LABELS "pipeline")
set_tests_properties(test_pipeline_executor PROPERTIES RUN_SERIAL TRUE)  # it times sleeps: alone, or it measures the load

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
  loom_add_test(test_checkpoint test_checkpoint.cpp LIBS nlohmann_json::nlohmann_json LABELS model)
endif()
if(nlohmann_json_FOUND AND ZLIB_FOUND)
  loom_add_test(test_sharded_checkpoint test_sharded_checkpoint.cpp LIBS nlohmann_json::nlohmann_json ZLIB::ZLIB
                LABELS "model;checkpoint")
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

# The Llama and Mixtral families on every axis against one rank, through the testing kit.
loom_add_test(test_families test_families.cpp LABELS "model;families")

if(nlohmann_json_FOUND)
  # The Llama, Mixtral and GPT-2 families against Hugging Face transformers, in the virtual environment that
  # scripts/install-deps makes (LOOM_HF_PYTHON); skipped where it is missing.
  set(LOOM_HF_PYTHON "$ENV{HOME}/.cache/loom/hf-venv/bin/python" CACHE FILEPATH
      "The Python with transformers 4.46.3 that the model families' oracle test runs")
  if(DEFINED ENV{LOOM_HF_VENV})
    set(LOOM_HF_PYTHON "$ENV{LOOM_HF_VENV}/bin/python")
  endif()
  add_executable(test_hf_families test_hf_families.cpp)
  target_link_libraries(test_hf_families PRIVATE loom::loom nlohmann_json::nlohmann_json)
  target_compile_definitions(test_hf_families PRIVATE LOOM_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                             LOOM_HF_PYTHON="${LOOM_HF_PYTHON}")
  add_test(NAME test_hf_families COMMAND test_hf_families)
  set_tests_properties(test_hf_families PROPERTIES LABELS "model" SKIP_RETURN_CODE 77 TIMEOUT 300)
endif()

if(TARGET train_gpt)
  # train_gpt: bad input ends in one clear message, a whole line of the output, and a non-zero exit status; a
  # checkpoint saved by one run loads in another.
  set(_tg $<TARGET_FILE:train_gpt>)
  set(_ef ${PROJECT_SOURCE_DIR}/cmake/expect_failure.cmake)
  set(_bin ${CMAKE_CURRENT_BINARY_DIR})
  set(_rs ${LOOM_TEST_SCRATCH}/train_gpt_resume_checks)  # the checkpoints of the resume_* cases
  set(_layouts "single, dp2, dp4, dp8, dp2.zero1, dp4.zero1, dp8.zero1, dp2.zero2, dp4.zero2, dp8.zero2, dp2.zero3, dp4.zero3, dp8.zero3, dp4.zero3.keep, dp8.zero3.keep, dp4.zero3.shard2, dp8.zero3.shard4, pp2, pp2.gpipe, pp2.zb-h1, pp2.zb-v, pp2.v2, pp4, pp4.gpipe, pp4.zb-h1, pp4.zb-v, pp4.v2, pp2.dp2, pp2.gpipe.dp2, pp2.zb-h1.dp2, pp2.zb-v.dp2, pp2.v2.dp2, pp2.dp4, pp2.gpipe.dp4, pp2.zb-h1.dp4, pp2.zb-v.dp4, pp2.v2.dp4, pp4.dp2, pp4.gpipe.dp2, pp4.zb-h1.dp2, pp4.zb-v.dp2, pp4.v2.dp2, pp2.dp2.zero1, pp2.gpipe.dp2.zero1, pp2.zb-h1.dp2.zero1, pp2.zb-v.dp2.zero1, pp2.v2.dp2.zero1, pp2.dp2.zero2, pp2.gpipe.dp2.zero2, pp2.zb-h1.dp2.zero2, pp2.zb-v.dp2.zero2, pp2.v2.dp2.zero2, pp2.dp2.zero3.keep, pp2.gpipe.dp2.zero3.keep, pp2.zb-h1.dp2.zero3.keep, pp2.zb-v.dp2.zero3.keep, pp2.v2.dp2.zero3.keep, dp2.ep2, dp4.ep2, dp4.ep4, dp8.ep8, pp2.dp2.ep2, dp4.zero1.ep2, dp4.zero3.ep2, tp2, tp4, tp8, tp2.dp2, tp2.dp4, tp4.dp2, tp2.dp2.zero1, tp2.dp4.zero1, tp2.dp2.zero3, tp2.dp2.ep2, tp2.sp, tp4.sp, tp8.sp, tp2.sp.dp2, tp2.sp.dp4, tp4.sp.dp2, tp2.pp2, tp2.pp2.gpipe, tp2.pp2.zb-h1, tp2.pp2.zb-v, tp2.pp2.v2, tp2.pp2.dp2, tp2.pp2.gpipe.dp2, tp2.pp2.zb-h1.dp2, tp2.pp2.zb-v.dp2, tp2.pp2.v2.dp2, tp2.sp.pp2.dp2, tp2.sp.pp2.gpipe.dp2, tp2.sp.pp2.zb-h1.dp2, tp2.sp.pp2.zb-v.dp2, tp2.sp.pp2.v2.dp2, tp2.pp4, tp2.pp4.gpipe, tp2.pp4.zb-h1, tp2.pp4.zb-v, tp2.pp4.v2, tp4.pp2, tp4.pp2.gpipe, tp4.pp2.zb-h1, tp4.pp2.zb-v, tp4.pp2.v2, cp2, cp4, cp8, cp2.ulysses, cp4.ulysses, cp8.ulysses, tp2.cp2, tp2.sp.cp2, cp2.dp2, cp2.dp2.zero1, cp4.dp2, cp2.pp2, tp2.cp2.pp2, cp2.dp2.ep4")
  # The docs state as many layouts as there are.
  add_test(NAME docs_layout_count
    COMMAND ${CMAKE_COMMAND} "-DLAYOUTS=${_layouts}" -DROOT=${PROJECT_SOURCE_DIR}
            -P ${CMAKE_CURRENT_SOURCE_DIR}/layout_count.cmake)
  set_tests_properties(docs_layout_count PROPERTIES LABELS docs)
  set(_changed "(--allow-changed-run continues the run with the new values)")
  file(WRITE ${_bin}/empty.txt "")
  # name | arguments separated by ^ | the message: a whole line of the output
  foreach(case
      "missing_data|--data^/nonexistent/corpus.txt|loom: cannot open the data file '/nonexistent/corpus.txt'"
      "empty_data|--data^${_bin}/empty.txt|loom: the data file '${_bin}/empty.txt' is empty"
      "seq_too_long|--seq^500|loom: --seq 500 is longer than the model's max_seq 128"
      "unknown_flag|--colour^red|loom: unknown flag '--colour'"
      "unknown_model|--model^huge|loom: unknown --model 'huge' (tiny, small, gpt2, long, tiny-moe, small-moe, llama-tiny, llama-small, llama3-1b, mixtral-tiny, mixtral-small, or a Hugging Face directory)"
      "bad_number|--steps^ten|loom: --steps needs a number, got 'ten'"
      "warmup_negative|--warmup^-5|loom: --warmup must not be negative, got -5"
      "warmup_not_a_number|--warmup^inf|loom: --warmup needs a number, got 'inf'"
      "weight_decay_negative|--weight-decay^-0.1|loom: --weight-decay must not be negative, got -0.1"
      "weight_decay_nan|--weight-decay^nan|loom: --weight-decay needs a finite number, got nan"
      "weight_decay_inf|--weight-decay^inf|loom: --weight-decay needs a finite number, got inf"
      "lr_nan|--lr^nan|loom: --lr needs a finite number, got nan"
      "lr_inf|--lr^inf|loom: --lr needs a finite number, got inf"
      "lr_out_of_range|--lr^1e999|loom: --lr 1e999 is out of range"
      "grad_clip_nan|--grad-clip^nan|loom: --grad-clip needs a finite number, got nan"
      "dropout_inf|--dropout^inf|loom: --dropout needs a finite number, got inf"
      "bucket_mb_nan|--bucket-mb^nan|loom: --bucket-mb needs a finite number, got nan"
      "negative_seed|--seed^-1|loom: --seed must not be negative, got -1"
      "backend_gloo|--backend^gloo|loom: --backend must be local, mpi or nccl, got 'gloo'"
      "backend_nccl_on_cpu|--backend^nccl|loom: --backend nccl runs one process per GPU: it needs --device cuda (the CPU's ranks use local or mpi)"
      "too_many_ranks|--parallel^tp8,dp2|loom: --parallel tp8,dp2 needs 16 ranks in a layout this build does not have (compiled layouts: ${_layouts})"
      "repeated_axis|--parallel^tp2,tp4|loom: --parallel tp2,tp4: tp is given twice (tp2 and tp4)"
      "repeated_chunks|--parallel^pp2,v2,v4|loom: --parallel pp2,v2,v4: vN is given twice (v2 and v4)"
      "chunks_without_pp|--parallel^dp2,v2|loom: --parallel dp2,v2: v2 sets the model chunks per pipeline stage, but the layout dp2 has none (add ppN)"
      "schedule_without_pp|--schedule^zb-h1|loom: --schedule zb-h1 orders the work of pipeline stages, but the layout single has none (add ppN to --parallel)"
      "ep_needs_experts|--parallel^dp2,ep2|loom: --model tiny cannot run on --parallel dp2.ep2: EP<n> needs a mixture-of-experts model (experts > 0)"
      "ep_must_divide|--parallel^dp2,ep4|loom: --parallel dp2,ep4: ep4 splits the experts over ranks carved out of dp x cp = 2, which it must divide"
      "capacity_negative|--capacity-factor^-1|loom: --capacity-factor must not be negative (0: dropless), got -1"
      "aux_loss_negative|--aux-loss-coeff^-0.5|loom: --aux-loss-coeff must not be negative, got -0.5"
      "router_unknown|--router^top|loom: --router must be softmax or sigmoid, got 'top'"
      "ulysses_without_cp|--parallel^tp2,ulysses|loom: --parallel tp2,ulysses: ulysses picks the all-to-all algorithm of context parallelism and needs cpN with N >= 2"
      "cp_seq_cannot_split|--parallel^cp4^--seq^60|loom: --parallel cp4: context parallelism over 4 ranks cuts each sequence into 2 x 4 = 8 chunks, but --seq 60 is not a multiple of 8"
      "ulysses_heads|--parallel^cp8,ulysses|loom: --model tiny cannot run on --parallel cp8.ulysses: Ulysses needs each tensor-parallel rank's heads and key/value heads divisible by CP"
      "recompute_unknown|--recompute^some|loom: --recompute must be none, selective or full, got 'some'"
      "zero3_pipeline_needs_keep|--parallel^pp2,dp2,zero3|loom: --parallel pp2,dp2,zero3: zero3 under pipeline parallelism needs keep (a stage runs several forwards before their backwards)"
      "keep_needs_zero3|--parallel^dp2,zero2,keep|loom: --parallel dp2,zero2,keep: keep keeps zero3's gathered parameters from forward to backward, and needs zero3"
      "zero_out_of_range|--parallel^dp2,zero4|loom: --parallel zero4: the ZeRO stages are 0 to 3"
      "zero_without_dp|--parallel^tp2,zero1|loom: --parallel tp2,zero1: zero1 shards over the data-parallel ranks and needs dpN with N >= 2"
      "shard_needs_zero|--parallel^dp4,shard2|loom: --parallel dp4,shard2: shard2 shards the ZeRO state over groups of 2 data-parallel ranks: it needs zeroK and a dpN that 2 divides"
      "sp_without_tp|--parallel^sp,dp2|loom: --parallel sp,dp2: sp (sequence parallelism) splits over the tp ranks and needs tp >= 2"
      "shape_cannot_split|--parallel^tp8^--model^tiny|loom: --model tiny cannot run on --parallel tp8: heads must be divisible by TP"
      "sp_seq_cannot_split|--parallel^tp4,sp^--seq^30|loom: --parallel tp4.sp: sequence parallelism splits each sequence over tp = 4 ranks, but its length 30 is not a multiple of it"
      "layers_cannot_split|--parallel^pp2,v2^--schedule^interleaved|loom: --model tiny has 2 layers, which do not split over 4 pipeline parts (pp2 x 2 chunks): --layer-split can split them unevenly"
      "split_does_not_add_up|--parallel^pp2^--model^small^--layer-split^1,2|loom: the layer split adds up to 3 layers but the model has 4"
      "split_without_pp|--parallel^dp2^--layer-split^1,1|loom: --layer-split splits the layers over pipeline stages, but the layout dp2 has none (add ppN to --parallel)"
      "interleaved_needs_chunks|--parallel^pp2^--schedule^interleaved^--micro-batches^2|loom: the interleaved schedule needs v >= 2 chunks per stage, got v = 1"
      "save_every_without_save|--save-every^2|loom: --save-every says how --save saves, but no --save DIR is given"
      "async_save_without_save|--async-save|loom: --async-save says how --save saves, but no --save DIR is given"
      "keep_negative|--save^x^--keep^-1|loom: --keep must not be negative, got -1"
      "init_from_missing|--init-from^/nonexistent/weights|loom: no checkpoint at /nonexistent/weights: it does not exist"
      "resume_and_init_from|--resume^a^--init-from^b|loom: --resume and --init-from exclude each other: --resume continues a run (weights, optimizer state, step), --init-from starts a new one from weights"
      "resume_without_checkpoint|--resume^/nonexistent/run|loom: no checkpoint at /nonexistent/run: it does not exist"
      # From the checkpoints of train_gpt_resume_fixture.cmake (3 steps on a.txt at batch 4 x 16); every case adds
      # --data a.txt --batch 4 --seq 16 --steps 5.
      "resume_steps_not_beyond|--resume^${_rs}/ckpt^--steps^3|loom: --steps 3 leaves nothing to train: --resume ${_rs}/ckpt continues at step 3 and --steps counts every step of the run (give more than 3)"
      "resume_changed_seed|--resume^${_rs}/ckpt^--seed^7|loom: --resume ${_rs}/ckpt: --seed 7 differs from the checkpoint's 1234 ${_changed}"
      "resume_changed_batch_seq_lr|--resume^${_rs}/ckpt^--batch^8^--seq^8^--lr^0.01|loom: --resume ${_rs}/ckpt: --batch 8 differs from the checkpoint's 4, --seq 8 differs from the checkpoint's 16, --lr 0.01 differs from the checkpoint's 0.003 ${_changed}"
      "resume_changed_schedule_of_training|--resume^${_rs}/ckpt^--warmup^2^--weight-decay^0^--grad-clip^0.5^--dropout^0.1^--batch-order^shuffle^--dtype^f64|loom: --resume ${_rs}/ckpt: --dtype f64 differs from the checkpoint's f32, --warmup 2 differs from the checkpoint's 0, --weight-decay 0 differs from the checkpoint's 0.01, --grad-clip 0.5 differs from the checkpoint's 1, --dropout 0.1 differs from the checkpoint's 0, --batch-order shuffle differs from the checkpoint's sequential ${_changed}"
      "resume_changed_routing|--resume^${_rs}/ckpt^--capacity-factor^2^--aux-loss-coeff^0.1^--z-loss-coeff^0.001^--router^sigmoid|loom: --resume ${_rs}/ckpt: --capacity-factor 2 differs from the checkpoint's 1.25, --aux-loss-coeff 0.1 differs from the checkpoint's 0.01, --z-loss-coeff 0.001 differs from the checkpoint's 0, --router sigmoid differs from the checkpoint's softmax ${_changed}"
      "resume_changed_data|--resume^${_rs}/ckpt^--data^${_rs}/b.txt|loom: --resume ${_rs}/ckpt: --data '${_rs}/b.txt' (480 tokens, FNV-1a cbfea07147f72425) differs from the checkpoint's '${_rs}/a.txt' (520 tokens, FNV-1a d174a44584c66b65) ${_changed}"
      "resume_changed_optimizer|--resume^${_rs}/ckpt^--optimizer^sgd^--allow-changed-run|loom: --resume ${_rs}/ckpt: --optimizer sgd differs from the checkpoint's adamw, whose state it holds (--init-from starts a new run from its weights)"
      "resume_changed_model|--resume^${_rs}/ckpt^--model^small|loom: --resume ${_rs}/ckpt: --model small differs from the checkpoint's tiny (a checkpoint loads into the shape it was saved from)"
      "resume_old_checkpoint|--resume^${_rs}/old|loom: --resume ${_rs}/old: ${_rs}/old/index.json records no run settings (it was saved without them), so this run cannot be checked against it: --allow-changed-run resumes it unchecked"
      "resume_missing_key|--resume^${_rs}/no_seed|loom: ${_rs}/no_seed/index.json has no key 'run.seed'"
      "resume_mistyped_key|--resume^${_rs}/bad_step|loom: ${_rs}/bad_step/index.json: 'next_step' must be an integer from -2147483648 to 2147483647, got true"
      "resume_not_json|--resume^${_rs}/not_json|loom: ${_rs}/not_json/index.json is not a JSON object")
    string(REPLACE "|" ";" parts "${case}")
    list(GET parts 0 name)
    list(GET parts 1 args)
    list(GET parts 2 expect)
    string(REPLACE "^" ";" args "${args}")
    string(FIND "${args}" "${_rs}" from_fixture)
    if(NOT from_fixture EQUAL -1)
      set(args "--data;${_rs}/a.txt;--batch;4;--seq;16;--steps;5;${args}")
    endif()
    add_test(NAME train_gpt_rejects_${name}
      COMMAND ${CMAKE_COMMAND} "-DCMD=${_tg};--no-progress;${args}" "-DEXPECT_LINE=${expect}" -P ${_ef})
    set_tests_properties(train_gpt_rejects_${name} PROPERTIES LABELS "model;failure")
    if(NOT from_fixture EQUAL -1)
      set_tests_properties(train_gpt_rejects_${name} PROPERTIES FIXTURES_REQUIRED train_gpt_resume_checks)
    endif()
  endforeach()
  add_test(NAME train_gpt_resume_fixture
    COMMAND ${CMAKE_COMMAND} -DTG=${_tg} -DDIR=${_rs} -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_resume_fixture.cmake)
  set_tests_properties(train_gpt_resume_fixture PROPERTIES LABELS model FIXTURES_SETUP train_gpt_resume_checks)
  add_test(NAME train_gpt_resume_fixture_cleanup COMMAND ${CMAKE_COMMAND} -E rm -rf ${_rs})
  set_tests_properties(train_gpt_resume_fixture_cleanup PROPERTIES LABELS model FIXTURES_CLEANUP train_gpt_resume_checks)
  # --allow-changed-run resumes what the cases above refuse: another seed, and a checkpoint without run settings.
  set(_ok ${PROJECT_SOURCE_DIR}/cmake/expect_success.cmake)
  set(_rargs "--no-progress;--data;${_rs}/a.txt;--batch;4;--seq;16;--steps;5;--allow-changed-run;--resume")
  add_test(NAME train_gpt_resume_allow_changed_run
    COMMAND ${CMAKE_COMMAND} "-DCMD=${_tg};${_rargs};${_rs}/ckpt;--seed;7"
            "-DEXPECT_REGEX=train_gpt: --allow-changed-run: --resume [^\n]*/ckpt continues with other settings: --seed 7 differs from the checkpoint's 1234\n.*in 2 steps \\(0 skipped\\)"
            -P ${_ok})
  add_test(NAME train_gpt_resume_allow_old_checkpoint
    COMMAND ${CMAKE_COMMAND} "-DCMD=${_tg};${_rargs};${_rs}/old"
            "-DEXPECT_REGEX=resuming [^\n]*/old at step 3\n.*in 2 steps \\(0 skipped\\)" -P ${_ok})
  set_tests_properties(train_gpt_resume_allow_changed_run train_gpt_resume_allow_old_checkpoint PROPERTIES
                       LABELS model FIXTURES_REQUIRED train_gpt_resume_checks)
  # A loss or gradient norm that is not finite: the step is skipped on every rank with a warning, and the tenth
  # skipped step in a row stops the run (lr 1e30 makes step 1 and every step after it NaN).
  add_test(NAME train_gpt_rejects_non_finite_loss
    COMMAND ${CMAKE_COMMAND} "-DCMD=${_tg};--no-progress;--lr;1e30;--grad-clip;0;--steps;20;--batch;4;--seq;16"
            "-DEXPECT_LINE=train_gpt: warning: step 1 skipped, no rank updated the model: loss nan, gradient norm nan (1 in a row, 10 stop the run)"
            "-DEXPECT_LINE2=loom: stopping at step 10 after 10 skipped steps in a row (1 to 10): the loss is nan and the gradient norm nan (try a lower --lr)"
            -P ${_ef})
  add_test(NAME train_gpt_rejects_non_finite_loss_pp2_dp2
    COMMAND ${CMAKE_COMMAND}
            "-DCMD=${_tg};--no-progress;--lr;1e30;--grad-clip;0;--steps;20;--batch;4;--seq;16;--parallel;pp2,dp2;--micro-batches;2"
            "-DEXPECT_LINE=train_gpt: warning: step 9 skipped, no rank updated the model: loss nan, gradient norm nan (9 in a row, 10 stop the run)"
            "-DEXPECT_LINE2=loom: stopping at step 10 after 10 skipped steps in a row (1 to 10): the loss is nan and the gradient norm nan (try a lower --lr)"
            -P ${_ef})
  # --backend local in a process that a launcher started among others (here as MPICH's launcher says so).
  add_test(NAME train_gpt_rejects_local_backend_under_launcher
    COMMAND ${CMAKE_COMMAND} "-DCMD=${_tg};--no-progress;--parallel;dp2"
            "-DEXPECT_LINE=loom: --backend local runs every rank as a thread of one process, but this process is one of 4 started together (PMI_SIZE=4): each would run the whole job, so launch with --backend mpi"
            -P ${_ef})
  set_tests_properties(train_gpt_rejects_non_finite_loss train_gpt_rejects_non_finite_loss_pp2_dp2
                       train_gpt_rejects_local_backend_under_launcher PROPERTIES LABELS "model;failure")
  set_tests_properties(train_gpt_rejects_local_backend_under_launcher PROPERTIES ENVIRONMENT "PMI_SIZE=4")
  # Under a per-rank cap of 80 MiB a 4096-token sequence of --model long does not fit on one rank (its activations
  # alone are about 70 MiB beside 34 MiB of parameters, gradients and optimizer state) and trains on cp4.
  set(_long ${_tg};--no-progress;--model;long;--seq;4096;--batch;1;--steps;2;--max-bytes;83886080)
  add_test(NAME train_gpt_long_context_over_the_cap_on_one_rank
    COMMAND ${CMAKE_COMMAND} "-DCMD=${_long}" "-DEXPECT=bytes of activations: it would hold"
            "-DEXPECT2=over its cap of 83886080" -P ${_ef})
  add_test(NAME train_gpt_long_context_under_the_cap_on_cp4
    COMMAND ${CMAKE_COMMAND} "-DCMD=${_long};--parallel;cp4"
            "-DEXPECT_REGEX=peak per rank by use, MiB: parameters [0-9.]+, gradients [0-9.]+, optimizer state [0-9.]+, activations [0-9.]+"
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_success.cmake)
  set_tests_properties(train_gpt_long_context_over_the_cap_on_one_rank PROPERTIES LABELS "model;cp;failure")
  set_tests_properties(train_gpt_long_context_under_the_cap_on_cp4 PROPERTIES LABELS "model;cp")
  # The script that every failure test runs refuses what is not a failure.
  add_test(NAME train_gpt_expect_failure_check
    COMMAND ${CMAKE_COMMAND} -DEF=${_ef} -P ${CMAKE_CURRENT_SOURCE_DIR}/expect_failure_check.cmake)
  set_tests_properties(train_gpt_expect_failure_check PROPERTIES LABELS "failure")
  add_test(NAME train_gpt_help_in_docs
    COMMAND ${CMAKE_COMMAND} -DTG=${_tg} -DDOC=${PROJECT_SOURCE_DIR}/docs/train_gpt.md
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_help.cmake)
  set_tests_properties(train_gpt_help_in_docs PROPERTIES LABELS model)
  add_test(NAME train_gpt_save_and_init_from
    COMMAND ${CMAKE_COMMAND} -DTG=${_tg} -DCKPT=$<TARGET_FILE:loom-ckpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_ckpt
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_checkpoint.cmake)
  # A job killed (SIGKILL) at three points of a save, written in place and in the background: the previous
  # checkpoint stays the latest, verifies, and resumes the run exactly.
  add_test(NAME train_gpt_checkpoint_crash
    COMMAND ${CMAKE_COMMAND} -DTG=${_tg} -DCKPT=$<TARGET_FILE:loom-ckpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_crash
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_crash.cmake)
  set_tests_properties(train_gpt_checkpoint_crash PROPERTIES LABELS "model;failure")
  set_tests_properties(train_gpt_save_and_init_from PROPERTIES LABELS model)
endif()

# Data parallelism against the single-rank run.
loom_add_test(test_data_parallel test_data_parallel.cpp LABELS "ddp;model")
if(LOOM_WITH_MPI)
  loom_add_mpi_test(test_data_parallel_mpi test_data_parallel_mpi.cpp LABELS "mpi;ddp")
endif()

if(TARGET train_gpt AND LOOM_WITH_MPI)
  # train_gpt as MPI processes: data- and tensor-parallel runs log the single-rank run's losses (f64, 9 digits); a
  # launch with the wrong number of processes, and one with --backend local, are refused.
  set(_mpi_env "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMP_NUM_THREADS=1")
  foreach(layout dp2 tp2,sp,dp2 cp2,dp2 cp2,ulysses)
    string(MAKE_C_IDENTIFIER "${layout}" id)
    add_test(NAME train_gpt_mpi_${id}
      COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_mpi_${id}
              -DLAYOUTS=${layout} -DMPIEXEC=${MPIEXEC_EXECUTABLE} -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
    set_tests_properties(train_gpt_mpi_${id} PROPERTIES LABELS "mpi;model" ENVIRONMENT "${_mpi_env}")
  endforeach()
  set_tests_properties(train_gpt_mpi_tp2_sp_dp2 PROPERTIES LABELS "mpi;model;tp")
  set_tests_properties(train_gpt_mpi_cp2_dp2 train_gpt_mpi_cp2_ulysses PROPERTIES LABELS "mpi;model;cp")
  add_test(NAME train_gpt_mpi_dp4_ep2
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_mpi_dp4_ep2
            "-DLAYOUTS=dp4,ep2" "-DEXTRA=--model;tiny-moe;--capacity-factor;1" -DMPIEXEC=${MPIEXEC_EXECUTABLE}
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  set_tests_properties(train_gpt_mpi_dp4_ep2 PROPERTIES LABELS "mpi;model;moe" ENVIRONMENT "${_mpi_env}")
  add_test(NAME train_gpt_mpi_resume
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_mpi_resume
            -DMPIEXEC=${MPIEXEC_EXECUTABLE} -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_resume_mpi.cmake)
  set_tests_properties(train_gpt_mpi_resume PROPERTIES LABELS "mpi;model" ENVIRONMENT "${_mpi_env}")
  add_test(NAME train_gpt_mpi_wrong_size
    COMMAND ${CMAKE_COMMAND} "-DCMD=${MPIEXEC_EXECUTABLE};--oversubscribe;-np;3;$<TARGET_FILE:train_gpt>;--backend;mpi;--parallel;dp2"
            "-DEXPECT=loom: the layout dp2 needs 2 ranks, but the job was launched with 3" -P ${_ef})
  add_test(NAME train_gpt_rejects_local_backend_under_mpirun
    COMMAND ${CMAKE_COMMAND} "-DCMD=${MPIEXEC_EXECUTABLE};--oversubscribe;-np;2;$<TARGET_FILE:train_gpt>;--parallel;dp2"
            "-DEXPECT_LINE=loom: --backend local runs every rank as a thread of one process, but this process is one of 2 started together (OMPI_COMM_WORLD_SIZE=2): each would run the whole job, so launch with --backend mpi"
            -P ${_ef})
  set_tests_properties(train_gpt_mpi_wrong_size train_gpt_rejects_local_backend_under_mpirun PROPERTIES
                       LABELS "mpi;model;failure" ENVIRONMENT "${_mpi_env}")
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
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_layouts
            "-DLAYOUTS=tp2;tp4,sp;tp2,sp,dp2;tp4,dp2;tp2,dp4" -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  set_tests_properties(train_gpt_tensor_parallel_layouts PROPERTIES LABELS "model;tp")
  add_test(NAME train_gpt_pipeline_layouts
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_pp_layouts
            "-DLAYOUTS=pp2 --schedule zb-h1;tp2,pp2,dp2 --schedule zb-h1;tp2,sp,pp2,dp2 --schedule zb-h1;pp2,dp4 --schedule zb-h1"
            "-DEXTRA=--micro-batches;2"
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  set_tests_properties(train_gpt_pipeline_layouts PROPERTIES LABELS "model;pipeline")
  # Context parallelism, ring and Ulysses, with TP, SP, DP, ZeRO-1 and PP, and every recompute mode.
  add_test(NAME train_gpt_context_layouts
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_cp_layouts
            "-DLAYOUTS=cp2;cp8;cp4,ulysses;tp2,cp2;tp2,sp,cp2 --recompute selective;cp2,dp2,zero1;cp4,dp2 --recompute full;cp2,pp2 --micro-batches 2;tp2,cp2,pp2 --micro-batches 4 --recompute selective"
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  set_tests_properties(train_gpt_context_layouts PROPERTIES LABELS "model;cp")
  # Expert parallelism on tiny-moe, with DP, ZeRO-1 and 3, TP, PP and CP: dropping at the default capacity factor
  # (1.25) and dropless; each against one rank run with the same flags.
  add_test(NAME train_gpt_expert_layouts
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_ep_layouts
            "-DLAYOUTS=dp2,ep2;dp4,ep2;dp8,ep8;tp2,dp2,ep2;pp2,dp2,ep2 --micro-batches 2;dp4,zero1,ep2;dp4,zero3,ep2;cp2,dp2,ep4"
            "-DEXTRA=--model;tiny-moe;--z-loss-coeff;0.001" -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  add_test(NAME train_gpt_expert_layouts_dropless
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_ep_dropless
            "-DLAYOUTS=dp4,ep4;tp2,dp2,ep2"
            "-DEXTRA=--model;tiny-moe;--capacity-factor;0;--router;sigmoid"
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  # Samples of a model whose experts are split (every rank's experts put together) are the single rank's.
  add_test(NAME train_gpt_expert_samples
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> "-DEXTRA=--model;tiny-moe"
            "-DRUNS=--parallel dp2,ep2;--parallel dp4,zero3,ep2;--parallel tp2,dp2,ep2"
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_samples.cmake)
  set_tests_properties(train_gpt_expert_layouts train_gpt_expert_layouts_dropless train_gpt_expert_samples
                       PROPERTIES LABELS "model;moe")
  # The Llama and Mixtral families on train_gpt's layouts, each against one rank run with the same flags.
  add_test(NAME train_gpt_llama_layouts
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_llama_layouts
            "-DLAYOUTS=tp2;tp2,sp,dp2;pp2 --micro-batches 2;pp2 --schedule zb-h1 --micro-batches 2;dp2,zero1;dp4,zero3;cp2;cp2,ulysses;tp2,pp2,dp2 --micro-batches 2"
            "-DEXTRA=--model;llama-tiny" -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  add_test(NAME train_gpt_mixtral_layouts
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_mixtral_layouts
            "-DLAYOUTS=dp2,ep2;dp4,ep4;tp2,dp2,ep2;pp2,dp2,ep2 --micro-batches 2;cp2,dp2,ep4;dp4,zero3,ep2;tp2,sp"
            "-DEXTRA=--model;mixtral-tiny" -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  # ZB-V's two chunks per stage need llama-small's four blocks.
  add_test(NAME train_gpt_llama_zb_v
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_llama_zb_v
            "-DLAYOUTS=pp2 --schedule zb-v --micro-batches 2;tp2,pp2 --schedule zb-v --micro-batches 2"
            "-DEXTRA=--model;llama-small" -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  set_tests_properties(train_gpt_llama_layouts train_gpt_mixtral_layouts train_gpt_llama_zb_v
                       PROPERTIES LABELS "model;families")
  # Their checkpoints exported in Hugging Face's names and loaded back, by --init-from and as --model; and GPT-2's
  # parts with experts, which no Hugging Face class has, exported as loom's own (model_type loom, which transformers
  # refuses rather than loading a dense GPT-2 without the experts).
  foreach(family "llama-tiny|llama|model.layers.0.self_attn.q_proj.weight"
                 "mixtral-tiny|mixtral|model.layers.0.block_sparse_moe.experts.0.w1.weight"
                 "tiny-moe|loom|h.0.mlp.experts.0.c_fc.weight")
    string(REPLACE "|" ";" f "${family}")
    list(GET f 0 model)
    list(GET f 1 type)
    list(GET f 2 tensor)
    add_test(NAME train_gpt_${type}_hf_checkpoint
      COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DCKPT=$<TARGET_FILE:loom-ckpt>
              -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_${type}_hf -DMODEL=${model} -DTYPE=${type} -DTENSOR=${tensor}
              -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_family_checkpoint.cmake)
    set_tests_properties(train_gpt_${type}_hf_checkpoint PROPERTIES LABELS "model;families;checkpoint")
  endforeach()
  # Each step reports the dropped share and the expert load, on stdout and in --log-json.
  add_test(NAME train_gpt_moe_report
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_moe_report
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_moe_report.cmake)
  set_tests_properties(train_gpt_moe_report PROPERTIES LABELS "model;moe")
  # ZeRO-1, 2 and 3 over data parallelism, alone, with tensor parallelism and with a pipeline.
  add_test(NAME train_gpt_zero_layouts
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_zero_layouts
            "-DLAYOUTS=dp4,zero1;dp8,zero1 --bucket-mb 0.01;tp2,dp2,zero1;tp2,dp4,zero1;pp2,dp2,zero1 --schedule zb-h1 --micro-batches 2;dp8,zero2 --bucket-mb 0.01;dp4,zero2 --micro-batches 2;pp2,dp2,zero2 --schedule gpipe --micro-batches 4;dp4,zero3;dp4,zero3,keep --micro-batches 2;dp8,zero3,keep;pp2,dp2,zero3,keep --schedule zb-h1 --micro-batches 2;dp4,zero3,shard2;dp8,zero3,shard4;tp2,dp2,zero3"
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  set_tests_properties(train_gpt_zero_layouts PROPERTIES LABELS "model;zero")
  # An uneven split of small's four blocks: one on the first stage (beside the embedding), three on the last; and
  # small's four blocks under the schedules with two chunks per stage, and GPipe.
  add_test(NAME train_gpt_pipeline_layer_split
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_pp_split
            "-DLAYOUTS=pp2 --layer-split 1,3;tp2,pp2,dp2 --layer-split 3,1;pp2,v2 --schedule interleaved;pp2 --schedule zb-v;pp2,dp2 --schedule gpipe"
            "-DEXTRA=--model;small;--micro-batches;2" -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
  set_tests_properties(train_gpt_pipeline_layer_split PROPERTIES LABELS "model;pipeline")
  if(LOOM_WITH_CUDA)
    # --device cuda: one rank, and two ranks sharing the GPU (data, tensor, sequence and pipeline parallelism under
    # every schedule, ZeRO 1-3, ring and Ulysses attention), log the CPU's losses (f64, dropout) to 9 digits.
    set(_cuda_layouts "dp2 --device cuda;tp2 --device cuda;tp2,dp2 --device cuda;tp2,sp --device cuda;pp2 --device cuda --micro-batches 2;pp2 --device cuda --schedule gpipe --micro-batches 2;pp2 --device cuda --schedule zb-h1 --micro-batches 2;pp2 --device cuda --schedule zb-v --micro-batches 2;pp2,dp2 --device cuda --micro-batches 2;dp2,zero1 --device cuda;dp2,zero2 --device cuda --micro-batches 2;dp2,zero3 --device cuda;tp2,dp2,zero1 --device cuda;pp2,dp2,zero1 --device cuda --schedule zb-h1 --micro-batches 2;cp2 --device cuda;cp2,dp2 --device cuda;cp2,ulysses --device cuda")
    add_test(NAME train_gpt_cuda_layouts
      COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_cuda
              "-DLAYOUTS=single --device cuda;${_cuda_layouts}" -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
    # ... and in f32 against the GPU's one rank: every loss within 1e-5 of it, relatively (on the CPU the same
    # layouts in f32 keep within 2.2e-8 of one rank; the check prints the largest difference the GPU gives).
    add_test(NAME train_gpt_cuda_layouts_f32
      COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_cuda_f32
              "-DLAYOUTS=${_cuda_layouts}" -DDTYPE=f32 -DRELATIVE=100000 "-DREFERENCE=single --device cuda"
              -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
    set_tests_properties(train_gpt_cuda_layouts_f32 PROPERTIES LABELS "gpu;model"
                         SKIP_REGULAR_EXPRESSION "no CUDA device here")
    # A mixture of experts on the GPU: the experts over two ranks sharing it, against the CPU's one rank.
    add_test(NAME train_gpt_cuda_moe_layouts
      COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_cuda_moe
              "-DLAYOUTS=single --device cuda;dp2 --device cuda;dp2,ep2 --device cuda"
              "-DEXTRA=--model;tiny-moe;--capacity-factor;1" -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
    set_tests_properties(train_gpt_cuda_moe_layouts PROPERTIES LABELS "gpu;model;moe"
                         SKIP_REGULAR_EXPRESSION "no CUDA device here")
    if(LOOM_WITH_MPI)
      # --backend nccl: a process per GPU, where the machine has two.
      add_test(NAME train_gpt_cuda_nccl_layouts
        COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_cuda_nccl
                "-DLAYOUTS=dp2;tp2" -DMPIEXEC=${MPIEXEC_EXECUTABLE} -DBACKEND=nccl
                -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_layouts.cmake)
      set_tests_properties(train_gpt_cuda_nccl_layouts PROPERTIES LABELS "gpu;model;nccl"
                           SKIP_REGULAR_EXPRESSION "SKIPPED|no CUDA device here")
    endif()
    # ... and sample the text the CPU's run samples (the whole model put together from ZeRO-3's shards and from a
    # pipeline's stages on the device too).
    add_test(NAME train_gpt_cuda_samples
      COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt>
              "-DRUNS=--device cuda;--parallel dp2 --device cuda;--parallel dp2,zero3 --device cuda;--parallel pp2 --micro-batches 2 --device cuda"
              -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_samples.cmake)
    # Sharded checkpoints from and into device memory.
    add_test(NAME train_gpt_cuda_resume
      COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_cuda_resume
              -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_cuda_resume.cmake)
    set_tests_properties(train_gpt_cuda_resume PROPERTIES LABELS "gpu;model;checkpoint"
                         SKIP_REGULAR_EXPRESSION "no CUDA device here")
    set_tests_properties(train_gpt_cuda_samples PROPERTIES LABELS "gpu;model"
                         SKIP_REGULAR_EXPRESSION "no CUDA device here")
    set_tests_properties(train_gpt_cuda_layouts PROPERTIES LABELS "gpu;model"
                         SKIP_REGULAR_EXPRESSION "no CUDA device here")
  endif()
  add_test(NAME train_gpt_resume_continues_the_run
    COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DDIR=${LOOM_TEST_SCRATCH}/train_gpt_resume
            -P ${CMAKE_CURRENT_SOURCE_DIR}/train_gpt_resume.cmake)
  set_tests_properties(train_gpt_resume_continues_the_run PROPERTIES LABELS model)
endif()

# Tensor (and sequence) parallelism against the single-rank run, for each attention shape.
loom_add_test(test_tensor_parallel test_tensor_parallel.cpp LABELS "tp;model")
if(LOOM_WITH_MPI)
  loom_add_mpi_test(test_tensor_parallel_mpi test_tensor_parallel_mpi.cpp LABELS "mpi;tp")
endif()

# Parts of the model (pipeline stages) against the whole model.
loom_add_test(test_gpt_parts test_gpt_parts.cpp LABELS "model;pipeline")

# Pipeline parallelism (every schedule, and with TP, SP and DP) against the single-rank run.
loom_add_test(test_pipeline_parallel test_pipeline_parallel.cpp LABELS "pipeline;model")
if(LOOM_WITH_MPI)
  loom_add_mpi_test(test_pipeline_parallel_mpi test_pipeline_parallel_mpi.cpp LABELS "mpi;pipeline")
endif()
# The mixture-of-experts router against hand-worked examples and finite differences.
loom_add_test(test_moe_router test_moe_router.cpp LABELS "moe")
# Mixture of experts with expert parallelism (with DP, TP, PP, micro-batches, recompute) against the single-rank run.
loom_add_test(test_moe test_moe.cpp LABELS "moe;model")

# Context parallelism (ring and Ulysses, with TP, SP, DP, ZeRO, PP and recompute) against the single-rank run.
loom_add_test(test_context_parallel test_context_parallel.cpp LABELS "cp;model")
if(TARGET context_parallel)
  # The benchmark runs, and a rank's activation peak per token it holds is the same on one rank and on cp2 and cp4
  # as on the long sequences docs/context-parallel.md measures (13400, 17384 and 16008 bytes).
  add_test(NAME bench_context_parallel_memory_per_token
    COMMAND ${CMAKE_COMMAND}
            "-DCMD=$<TARGET_FILE:context_parallel>;--seq;256;--cp;1,2,4;--repeat;1;--model-seq;256"
            "-DEXPECT_REGEX=single +256 +1 +[0-9.]+ +13400\\.0.*ring +256 +2 +[0-9.]+ +17384\\.0.*ulysses +256 +4 +[0-9.]+ +16008\\.0"
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_success.cmake)
  set_tests_properties(bench_context_parallel_memory_per_token PROPERTIES LABELS "cp;bench")
endif()
if(TARGET moe)
  # The benchmark runs: tiny beside tiny-moe (324,736 parameters, 125,824 active per token) on one rank and on
  # dp2.ep2, dropping at capacity factor 1 and nothing dropless.
  add_test(NAME bench_moe_runs
    COMMAND ${CMAKE_COMMAND}
            "-DCMD=$<TARGET_FILE:moe>;--model;tiny-moe;--ep;1,2;--capacity;1,0;--batch;4;--seq;32;--steps;1;--warmup;0"
            "-DEXPECT_REGEX=tiny +single +1 +- .* 124672 +124672.*tiny-moe +dp2.ep2 +2 +1 .* 324736 +125824.*tiny-moe +dp2.ep2 +2 +dropless +[0-9]+ +[0-9.]+ +[0-9.]+ +0\\.0000 "
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_success.cmake)
  set_tests_properties(bench_moe_runs PROPERTIES LABELS "moe;bench")
endif()
loom_add_test(test_pipeline_executor test_pipeline_executor.cpp LABELS "pipeline")
set_tests_properties(test_pipeline_executor PROPERTIES RUN_SERIAL TRUE)  # it times sleeps: alone, or it measures the load

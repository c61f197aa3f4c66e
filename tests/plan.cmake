# The planner: loom-plan against the ledger of train_gpt's runs, against published runs, its search, its refusals;
# test_plan checks its parameter walk against the model's own table.
if(TARGET loom-plan AND TARGET train_gpt)
  function(loom_plan_ledger name)
    add_test(NAME plan_ledger.${name}
      COMMAND ${CMAKE_COMMAND} -DTG=$<TARGET_FILE:train_gpt> -DLP=$<TARGET_FILE:loom-plan>
              -DDIR=${LOOM_TEST_SCRATCH}/plan_ledger_${name} "-DARGS=${ARGN}" -P ${CMAKE_CURRENT_SOURCE_DIR}/plan_ledger.cmake)
    set_tests_properties(plan_ledger.${name} PROPERTIES LABELS plan)
  endfunction()
  set(_run --batch;8;--seq;64;--micro-batches;2)
  loom_plan_ledger(small_single --model;small;${_run})
  loom_plan_ledger(llama_tp2_sp_selective --model;llama-small;--parallel;tp2,sp;--recompute;selective;${_run})
  loom_plan_ledger(small_dp2_zero3 --model;small;--parallel;dp2,zero3;${_run})
  loom_plan_ledger(llama_tp2_dp2_zero3 --model;llama-small;--parallel;tp2,dp2,zero3;${_run})
  loom_plan_ledger(llama_dp4_zero3_full --model;llama-small;--parallel;dp4,zero3;--recompute;full;${_run})
  loom_plan_ledger(llama_pp2_zb_h1 --model;llama-small;--parallel;pp2;--schedule;zb-h1;${_run})
  loom_plan_ledger(small_pp2_v2 --model;small;--parallel;pp2,v2;${_run})
  loom_plan_ledger(llama_pp2_dp2_zb_v --model;llama-small;--parallel;pp2,dp2;--schedule;zb-v;${_run})
  loom_plan_ledger(small_cp2_ulysses --model;small;--parallel;cp2,ulysses;${_run})
  loom_plan_ledger(small_cp2_dp2_zero1 --model;small;--parallel;cp2,dp2,zero1;${_run})
  loom_plan_ledger(llama_cp2_ring_f64 --model;llama-small;--parallel;cp2;--dtype;f64;${_run})
  loom_plan_ledger(small_pp2_dp2_zero3_keep --model;small;--parallel;pp2,dp2,zero3,keep;${_run})
  loom_plan_ledger(mixtral_tp2_pp2_dp2 --model;mixtral-small;--parallel;tp2,pp2,dp2;${_run})
  loom_plan_ledger(moe_dp2_ep2_sgd --model;small-moe;--parallel;dp2,ep2;--optimizer;sgd;${_run})
  loom_plan_ledger(mixtral_pp2_zb_v --model;mixtral-small;--parallel;pp2;--schedule;zb-v;${_run})
  loom_plan_ledger(mixtral_pp2_zb_h1_dropless --model;mixtral-small;--parallel;pp2;--schedule;zb-h1;--capacity-factor;0;${_run})
  # One micro-batch: ZeRO-3 holds the units of backward's last two chunks besides its shard.
  loom_plan_ledger(llama_dp4_zero3_one_micro_batch --model;llama-small;--parallel;dp4,zero3;--batch;8;--seq;64;--micro-batches;1)
  loom_plan_ledger(small_dp2_zero2_one_micro_batch --model;small;--parallel;dp2,zero2;--bucket-mb;1;--batch;8;--seq;64;--micro-batches;1)
  # bench/plan_check.py, the step time against train_gpt's, on three layouts of a calibrated cluster after its
  # one-rank calibration run (its figures over 24 are docs/planner.md's).
  find_program(LOOM_PYTHON3 NAMES python3)
  if(LOOM_PYTHON3)
    set(_scratch ${LOOM_TEST_SCRATCH}/plan_check_cpu)
    loom_command_test(plan_check_cpu LABELS plan
      EXPECT_REGEX "plan_check: 3 layouts, median error [0-9.]+%, worst [0-9.]+%, spearman -?[0-9.]+"
      COMMAND sh -c "$<TARGET_FILE:loom-plan> --calibrate ${_scratch}/this.json && ${LOOM_PYTHON3} ${PROJECT_SOURCE_DIR}/bench/plan_check.py --train-gpt $<TARGET_FILE:train_gpt> --loom-plan $<TARGET_FILE:loom-plan> --cluster ${_scratch}/this.json --layout single --layout dp2 --layout pp2 --layout tp2 --steps 2 --json ${_scratch}/check.json")
  endif()
endif()

if(TARGET loom-plan)
  # Each must exit 0 and print what its regular expression says.
  function(loom_plan_succeeds name regex)
    loom_command_test(${name} EXPECT_REGEX "${regex}" LABELS plan COMMAND ${ARGN})
  endfunction()
  # Published runs: the mean and the worst error it reaches today (docs/planner.md), so that a change that makes
  # them worse fails.
  loom_plan_succeeds(plan_published
    "step time and throughput: mean absolute error [0-4]\\.[0-9]+%, worst [0-9]\\.[0-9]+% over 21 runs\nmemory: mean absolute error [0-4]\\.[0-9]+%, worst [0-4]\\.[0-9]+% over 12 figures.*search: the published layout within 5% of the planner's fastest in (19|2[01]) of 21 runs"
    $<TARGET_FILE:loom-plan>;--validate)
  # This machine measured into a cluster file, then a plan on it.
  loom_plan_succeeds(plan_calibrate
    "loom-plan: calibrate: f32 products [0-9.]+ GFLOP/s a thread.*element-wise [0-9.]+ GB/s.*all-reduce latency [0-9.]+ us a step.*loom-plan: wrote .*step time [0-9.]+ s"
    sh -c "$<TARGET_FILE:loom-plan> --calibrate ${LOOM_TEST_SCRATCH}/plan_calibrate/this.json && $<TARGET_FILE:loom-plan> --model small --parallel dp2 --cluster ${LOOM_TEST_SCRATCH}/plan_calibrate/this.json")
  loom_plan_succeeds(plan_search "1    tp[0-9.a-z-]+ .*rejected:\n .*out of memory \\("
    $<TARGET_FILE:loom-plan>;--model;gpt3-175b;--search;--gpus;64;--batch;64;--seq;2048;--dtype;bf16;--recipe;megatron;--cluster;a100-80gb;--top;3)
  loom_plan_succeeds(plan_json
    "\"parallel\":\"tp8.pp2.dp4.zero1\".*\"peak_bytes\":[0-9.e+]+.*\"bytes\":\\{\"parameters\":[0-9.e+]+,\"gradients\":[0-9.e+]+,\"optimizer\":[0-9.e+]+,\"activations\":[0-9.e+]+,\"buffers\".*\"step_s\":[0-9.e+-]+,\"mfu\":0\\.[0-9]+.*\"tokens_per_s\""
    sh -c "$<TARGET_FILE:loom-plan> --model llama3-8b --parallel tp8,pp2,dp4,zero1 --batch 64 --seq 8192 --dtype bf16 --micro-batches 16 --recompute selective --json ${LOOM_TEST_SCRATCH}/plan_json/plan.json && cat ${LOOM_TEST_SCRATCH}/plan_json/plan.json")
  function(loom_plan_refuses name expect)
    loom_command_test(plan_refuses.${name} EXPECT "${expect}" LABELS plan failure
      COMMAND $<TARGET_FILE:loom-plan> ${ARGN})
  endfunction()
  loom_plan_refuses(unknown_model "loom-plan: unknown model 'gpt5'" --model;gpt5)
  loom_plan_refuses(unknown_cluster "loom-plan: unknown cluster 'tpu'" --model;small;--cluster;tpu)
  loom_plan_refuses(bad_layout "loom: layout 'tp2,zero9': 'zero9' needs a size" --model;small;--parallel;tp2,zero9)
  loom_plan_refuses(indivisible "loom-plan: tp3 cannot run this model: heads must be divisible by TP"
                    --model;small;--parallel;tp3)
  loom_plan_refuses(does_not_fit "loom-plan: dp8 does not fit: 788.499 GiB of optimizer in 1400.34 GiB on a 80 GiB device"
                    --model;llama3-70b;--parallel;dp8;--dtype;bf16;--batch;8;--seq;4096)
endif()

loom_add_test(test_plan test_plan.cpp LABELS plan)

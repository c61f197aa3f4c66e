# Training that survives failures: loom-run over train_gpt with processes killed and frozen (scripts/fault-inject:
# the run finishes with every step's loss and the final checkpoint of the run without failures), --auto-resume, what
# both refuse, and loom-goodput against the Young/Daly closed form.
if(TARGET loom-goodput)
  add_test(NAME loom_goodput_young_daly
    COMMAND ${CMAKE_COMMAND} -DLG=$<TARGET_FILE:loom-goodput> -DDIR=${LOOM_TEST_SCRATCH}/loom_goodput
            -P ${CMAKE_CURRENT_SOURCE_DIR}/goodput_check.cmake)
  set_tests_properties(loom_goodput_young_daly PROPERTIES LABELS faults)
  loom_command_test(loom_goodput_needs_gpus EXPECT "loom-goodput: --gpus N is required" LABELS faults failure
    COMMAND $<TARGET_FILE:loom-goodput> --days 3)
endif()
if(TARGET loom-run AND TARGET train_gpt)
  # Kills and a freeze at random steps of a 60-step dp2 run on threads (heartbeat 2 s, a checkpoint every 20 steps,
  # an in-memory snapshot every 2), one more kill as the first restart begins; each failure seen within 4 s.
  loom_command_test(fault_inject_threads LABELS faults
    EXPECT_REGEX "loom-run: attempt 0 failed after [0-9.]+ s: process [0-9]+ \\(ranks 0-1\\) killed by signal 9 at step [0-9]+.*attempt 1 failed after [0-9.]+ s: process [0-9]+ (\\(ranks 0-1\\) )?killed by signal 9.*frozen \\(no beat for [23]\\.[0-9] s\\).*attempt [0-9] starts at step [0-9]+, [0-9.]+ s after the failure was seen: [0-9]+ steps? to do again, about [0-9.]+ s lost in all.*fault-inject: detected after.*fault-inject: 4 fault\\(s\\) injected, 4 restart\\(s\\); every step's loss and the final checkpoint \\(step-00000060\\) equal"
    COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/fault-inject --build ${CMAKE_BINARY_DIR}
            --dir ${LOOM_TEST_SCRATCH}/fault_inject_threads --steps 60 --save-every 20 --snapshot-every 2 --faults 3
            --recovery-fault --seed 3)
  # A process killed while it writes a snapshot, every own image left damaged: the restart takes the peers' copies.
  loom_command_test(fault_inject_snapshot_faults LABELS faults
    EXPECT_REGEX "killed while writing the snapshot of step 30.*is corrupt: tensor.*state is taken from its peer's copy.*the in-memory snapshot of step 28 .* is the newest state.*1 fault\\(s\\) injected, 0 restart\\(s\\); every step's loss and the final checkpoint \\(step-00000060\\) equal"
    COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/fault-inject --build ${CMAKE_BINARY_DIR}
            --dir ${LOOM_TEST_SCRATCH}/fault_inject_snapshot_faults --steps 60 --save-every 20 --snapshot-every 2
            --snapshot-faults)
  # Every copy of the snapshots lost with the one process that held them (ranks as threads): the restart falls back to
  # the checkpoint on disk.
  loom_command_test(fault_inject_memory_lost LABELS faults
    EXPECT_REGEX "its snapshot folder removed.*loom-run: attempt 1 starts at step (0|10|20), .*1 fault\\(s\\) injected, 1 restart\\(s\\); every step's loss and the final checkpoint \\(step-00000030\\) equal"
    COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/fault-inject --build ${CMAKE_BINARY_DIR}
            --dir ${LOOM_TEST_SCRATCH}/fault_inject_memory_lost --steps 30 --save-every 10 --snapshot-every 2
            --lose-memory --faults 1 --seed 4)
  if(LOOM_WITH_MPI)
    # tp2.dp2 as four processes under mpirun playing two hosts with a snapshot store each, 60 steps: two killed,
    # each taking its host's store with it (the restart gathers the images from the other host's copies), one frozen.
    loom_command_test(fault_inject_mpi LABELS faults mpi
      EXPECT_REGEX "image came from host host[01].*state is taken from its peer's copy.*fault-inject: 3 fault\\(s\\) injected, 3 restart\\(s\\); every step's loss and the final checkpoint \\(step-00000060\\) equal"
      COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/fault-inject --build ${CMAKE_BINARY_DIR}
              --dir ${LOOM_TEST_SCRATCH}/fault_inject_mpi --mpi 4 --parallel tp2,dp2 --hosts 2 --steps 60
              --save-every 20 --snapshot-every 2 --lose-memory --faults 3 --seed 5)
    # Elastic: tp2.dp4 (eight processes) loses a rank for good and goes on as tp2.dp2, equal to a run that switched
    # layouts at the step the restart started from.
    loom_command_test(fault_inject_elastic LABELS faults mpi
      EXPECT_REGEX "loom-run: 7 ranks available, the job runs on 8: restarting on --parallel tp2,dp2 \\(4 ranks\\).*fault-inject: 1 fault\\(s\\) injected, 1 restart\\(s\\); every step's loss and the final checkpoint \\(step-00000024\\) equal the run that switched to --parallel tp2,dp2 at step [0-9]+"
      COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/fault-inject --build ${CMAKE_BINARY_DIR}
              --dir ${LOOM_TEST_SCRATCH}/fault_inject_elastic --mpi 8 --parallel tp2,dp4 --elastic tp2,dp2
              --steps 24 --save-every 12 --snapshot-every 2 --faults 1 --seed 7)
  endif()
  loom_command_test(loom_run_elastic_needs_all LABELS faults failure
    EXPECT "loom-run: an elastic job needs --min-ranks R (at least 1), --ranks-available CMD and --fallback-parallel SPEC"
    COMMAND $<TARGET_FILE:loom-run> --min-ranks 2 -- true)
  loom_command_test(loom_run_fallback_below_min LABELS faults failure
    EXPECT "loom-run: --fallback-parallel dp2 runs on 2 ranks, fewer than --min-ranks 4"
    COMMAND $<TARGET_FILE:loom-run> --min-ranks 4 --ranks-available "echo 2" --fallback-parallel dp2 -- true)
  # Fewer ranks than --min-ranks: loom-run stops instead of restarting.
  loom_command_test(loom_run_too_few_ranks LABELS faults failure
    EXPECT "loom-run: 1 ranks available, fewer than the job's 4, and no --fallback-parallel layout runs on at least --min-ranks 2 and at most 1: stopping"
    COMMAND $<TARGET_FILE:loom-run> --min-ranks 2 --ranks-available "echo 1" --fallback-parallel dp2 -- sh -c "exit 3" --parallel dp4)
  # --auto-resume: a run without a checkpoint starts, one with a checkpoint continues, one at --steps is done.
  set(_tg "$<TARGET_FILE:train_gpt> --model tiny --batch 2 --seq 16 --no-progress --auto-resume --save ${LOOM_TEST_SCRATCH}/train_gpt_auto_resume/ck")
  loom_command_test(train_gpt_auto_resume LABELS faults
    EXPECT_REGEX "holds no checkpoint yet; starting at step 0.*--auto-resume: continuing from .*step-00000004 at step 4.*is at step 6 of 6: the run is done"
    COMMAND sh -c "${_tg} --steps 4 && ${_tg} --steps 6 && ${_tg} --steps 6")
  loom_command_test(train_gpt_auto_resume_needs_save LABELS faults failure
    EXPECT "--auto-resume continues from --save DIR's newest checkpoint, but no --save DIR is given"
    COMMAND $<TARGET_FILE:train_gpt> --model tiny --auto-resume)
  loom_command_test(loom_run_needs_a_command LABELS faults failure
    EXPECT "loom-run: no command to run (give it after --)" COMMAND $<TARGET_FILE:loom-run> --heartbeat-s 2)
  loom_command_test(loom_run_cannot_start LABELS faults failure
    EXPECT "loom-run: the command could not be started; not restarting"
    COMMAND $<TARGET_FILE:loom-run> -- ${LOOM_TEST_SCRATCH}/no-such-command)
  loom_command_test(loom_run_gives_up LABELS faults failure
    EXPECT "loom-run: giving up after 1 restart (--max-restarts 1)"
    COMMAND $<TARGET_FILE:loom-run> --max-restarts 1 -- false)
endif()

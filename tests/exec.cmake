# Overlap stages and the trace recorder.
loom_add_test(test_exec test_exec.cpp LABELS exec)

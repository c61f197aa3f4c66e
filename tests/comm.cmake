# Communicator tests: Local here; Mpi under mpirun (label mpi); Nccl on a GPU (label gpu).
loom_add_test(test_comm_local test_comm_local.cpp LABELS comm)

"""Distributed execution: the tensor-parallel group a worker's layers see (parallel_state.py), the shared-memory
broadcast ring the multiprocess executor speaks to its workers through (shm_ring.py), and the shared-memory
all-reduce between ranks on one machine (shm_allreduce.py)."""

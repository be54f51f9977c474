"""Worker ranks on torch.distributed: process groups (state.py) and the few ops the model and runner use (comm.py)."""

from stepahead.distributed.state import ParallelState, init_parallel_state, rank_of

__all__ = ["ParallelState", "init_parallel_state", "rank_of"]

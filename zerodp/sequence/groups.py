"""The process's sequence-parallel groups: built once, read by the attention, the batch sharding, the
loss and the engine.

DeepSpeed keeps its Ulysses groups in a module (`parallel_state_sp`) that `register_with_transformers`
fills before `deepspeed.initialize` runs, and the engine then reads them through the `mpu` it is
given; zerodp keeps them here for the same reason: the attention is patched before the engine exists.
The layout is zero/topology.py's [Note: sequence-parallel groups].
"""

from __future__ import annotations

from zerodp import comm
from zerodp.zero.topology import SequenceParallel, sequence_parallel_groups

_current: SequenceParallel | None = None
"""The groups of this process (None: not built, i.e. no sequence parallelism)."""


def initialize_sequence_parallel(sequence_parallel_size: int) -> SequenceParallel:
    """Build the data-parallel x sequence-parallel groups of `sequence_parallel_size` (a collective:
    every rank calls it with the same size), or return the ones already built with that size.

    Raises ValueError when the size does not divide the world size, or when groups of another size
    exist (a process has one layout)."""
    global _current
    if _current is not None:
        if _current.sp_size != sequence_parallel_size:
            raise ValueError(f"sequence_parallel_size {sequence_parallel_size}: this process already has "
                             f"sequence-parallel groups of {_current.sp_size} ranks; one process has one layout")
        return _current
    if not comm.is_initialized():
        raise ValueError("sequence parallelism needs torch.distributed: call zerodp.init_distributed() first")
    _current = sequence_parallel_groups(sequence_parallel_size)
    return _current


def current() -> SequenceParallel:
    """This rank's place in data-parallel x sequence-parallel: the built groups, else size 1."""
    if _current is not None:
        return _current
    rank, world = comm.get_rank(), comm.get_world_size()
    return SequenceParallel(1, 0, None, world, rank, None)


def is_initialized() -> bool:
    """True once `initialize_sequence_parallel` has built groups in this process."""
    return _current is not None


def reset() -> None:
    """Forget the groups (tests; a process that destroys and re-creates its process group)."""
    global _current
    _current = None

"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: the Ulysses groups provider (the `mpu` that
`register_with_transformers` returns and `deepspeed.initialize(mpu=...)` takes), over zerodp.sequence's
groups. The sequence-data-parallel group is every rank: ZeRO partitions and reduces over all of them."""

from __future__ import annotations

import torch.distributed

from zerodp import comm
from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.sequence import groups


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the groups of `sequence_parallel_size` ranks (DeepSpeed refuses a size of 1 here too)."""
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    groups.initialize_sequence_parallel(sequence_parallel_size)


def get_sequence_parallel_group():
    """This rank's sequence-parallel group."""
    if not groups.is_initialized():
        raise ValueError("the sequence-parallel groups are not built: call initialize_sequence_parallel(size) "
                         "(register_with_transformers does)")
    return groups.current().sp_group


def get_sequence_parallel_world_size() -> int:
    return groups.current().sp_size


def get_sequence_parallel_rank() -> int:
    return groups.current().sp_rank


def get_sequence_data_parallel_group():
    """Every rank (ZeRO's partition and gradient-reduction group)."""
    return torch.distributed.group.WORLD


def get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size()


def get_sequence_data_parallel_rank() -> int:
    return comm.get_rank()


get_model_parallel_rank = get_sequence_parallel_rank  # DeepSpeed aliases model parallelism to the sequence's
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group

__getattr__ = missing_attributes(__name__)

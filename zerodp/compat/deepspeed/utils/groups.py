"""`deepspeed.utils.groups`: the accessors of the sequence-parallel (Ulysses) and data-parallel groups that
Hugging Face's Trainer and Accelerate read, over zerodp.sequence's groups. Without sequence parallelism
the sizes are 1 and the group lookup raises KeyError, as DeepSpeed's do."""

from __future__ import annotations

import torch.distributed

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.runtime.sequence_parallel import parallel_state_sp
from zerodp.sequence import groups as _groups


def _get_sequence_parallel_group():
    if not _groups.is_initialized():
        raise KeyError("No sequence parallel group found")
    return _groups.current().sp_group


# the same answers as the groups provider's (`mpu`)
_get_sequence_parallel_world_size = parallel_state_sp.get_sequence_parallel_world_size
_get_sequence_parallel_rank = parallel_state_sp.get_sequence_parallel_rank
_get_sequence_data_parallel_group = parallel_state_sp.get_sequence_data_parallel_group
_get_sequence_data_parallel_world_size = parallel_state_sp.get_sequence_data_parallel_world_size
_get_sequence_data_parallel_rank = parallel_state_sp.get_sequence_data_parallel_rank


def _get_data_parallel_group():
    """The ranks holding the same sequence shard of different samples (every rank without sequence parallelism)."""
    current = _groups.current()
    return current.dp_group if current.sp_size > 1 else torch.distributed.group.WORLD


def _get_data_parallel_world_size() -> int:
    return _groups.current().dp_size


def _get_data_parallel_rank() -> int:
    return _groups.current().dp_rank


def _get_model_parallel_world_size() -> int:
    return 1  # zerodp has no tensor or pipeline parallelism


__getattr__ = missing_attributes(__name__)

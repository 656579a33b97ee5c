"""`deepspeed.comm` (`from deepspeed import comm as dist`): DeepSpeed's collectives facade, on zerodp.comm.

Every collective goes through zerodp.comm, so it is counted in the communication ledger of the step it
runs in (`engine.comm_report()`), as DeepSpeed's comms logger counts a script's own calls.
"""

from __future__ import annotations

import datetime
import os

import torch
from torch.distributed import ReduceOp

from zerodp import comm as _comm
from zerodp.comm import all_gather_into_tensor, barrier, get_rank, get_world_size, is_initialized, reduce_scatter_tensor
from zerodp.compat.deepspeed._missing import missing_attributes


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: object = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """DeepSpeed's `init_distributed` signature over `zerodp.init_distributed`.

    dist_init_required=False leaves torch.distributed as it is; `distributed_port` is the master port
    when a launcher set $RANK but not $MASTER_PORT (as DeepSpeed uses it), and of a Slurm or MPI launch
    (found from srun's / mpirun's variables, as zerodp.init_distributed does); a launcher-less script
    is a 1-rank job. `auto_mpi_discovery`, `verbose` and `config` change nothing in zerodp (no mpi4py)."""
    if dist_init_required is False:
        return
    if "RANK" in os.environ:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    _comm.init_distributed(dist_backend, timeout=timeout, init_method=init_method, rank=rank, world_size=world_size,
                           distributed_port=distributed_port)


def destroy_process_group(group: object = None) -> None:
    """DeepSpeed's `destroy_process_group`: tear down `group` (None: the default group, after which
    `is_initialized()` is False and `init_distributed` may be called again). Collectives zerodp launched
    asynchronously are waited for first, so no backend thread still holds a tensor being freed."""
    if not torch.distributed.is_initialized():
        raise RuntimeError("deepspeed.comm.destroy_process_group(): there is no process group to destroy "
                           "(call deepspeed.init_distributed() first)")
    _comm.drain_pending()
    torch.distributed.destroy_process_group(group)


def is_available() -> bool:
    return torch.distributed.is_available()


def get_local_rank() -> int:
    """This process's rank on its machine ($LOCAL_RANK, set by torchrun / `zerodp run`; 0 without one)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: object = None, group_rank: int = 0) -> int:
    return torch.distributed.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group() -> object:
    return torch.distributed.group.WORLD


def new_group(ranks: list[int]) -> object:
    """DeepSpeed's `new_group(ranks)`: a process group of those global ranks (every rank calls it, for
    every group, in the same order, as torch requires)."""
    return _comm.new_group(ranks)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: object = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_reduce", debug: object = None):
    return _comm.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: object = None, async_op: bool = False, prof: bool = False,
              log_name: str = "broadcast", debug: object = None):
    """DeepSpeed's signature; zerodp broadcasts synchronously, so async_op=True returns a finished handle."""
    _comm.broadcast(tensor, src=src, group=group)
    return _comm.Pending([]) if async_op else None


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: object = None, async_op: bool = False,
           prof: bool = False, log_name: str = "reduce", debug: object = None):
    if op != ReduceOp.SUM:
        raise NotImplementedError(f"deepspeed.comm.reduce(op={op}): zerodp reduces with SUM only")
    return _comm.reduce(tensor, dst, group=group, async_op=async_op)


__all__ = ["ReduceOp", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast", "destroy_process_group",
           "get_global_rank",
           "get_local_rank", "get_rank", "get_world_group", "get_world_size", "init_distributed", "is_available",
           "is_initialized", "new_group", "reduce", "reduce_scatter_tensor"]
__getattr__ = missing_attributes(__name__)

"""The failure guard: an error on one rank becomes an error on every rank before the next collective
(design.md §2), instead of a hang until the collective timeout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from zerodp.comm.collectives import all_gather_rows, barrier
from zerodp.comm.lifecycle import backend, collective_timeout, device_for_backend, get_world_size, simulated


def gather_messages(message: str | None, max_bytes: int = 2048) -> list[str | None]:
    """Every rank's error message (None: no error), so all ranks can raise the same one (a simulated
    rank's for every rank)."""
    if simulated():
        return [message] * get_world_size()
    data = (message or "").encode()[:max_bytes]
    row = torch.zeros(max_bytes + 1, dtype=torch.uint8, device=device_for_backend())
    row[0] = message is not None
    row[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else row[1:1]
    rows = all_gather_rows(row, group=None).cpu()
    return [bytes(r[1:].tolist()).rstrip(b"\0").decode(errors="replace") if r[0] else None for r in rows]


class PeerFailed(RuntimeError):
    """Another rank failed inside an `on_every_rank` block; carries its rank, error type and message."""

    def __init__(self, rank: int, error_type: str, message: str) -> None:
        super().__init__(f"rank {rank} failed with {error_type}: {message}")
        self.rank, self.error_type, self.message = rank, error_type, message

    def __reduce__(self) -> tuple:  # pickles with its arguments (process pools re-raise it in the parent)
        return type(self), (self.rank, self.error_type, self.message)


def on_every_rank(work: Callable[[], Any]) -> Any:
    """Run `work()` on every rank; if it raises on any rank, every rank raises at once: the failing
    rank its own exception, the others `PeerFailed` naming the first failing rank and its error.
    The one collective costs a 2 KiB gather; wrap per-rank work that can fail (files, user input)
    before the collective that would otherwise wait for the failed rank until the timeout."""
    result, problem = None, None
    try:
        result = work()
    except Exception as err:  # noqa: BLE001 - every error is shared, then re-raised
        problem = err
    if get_world_size() == 1:
        if problem is not None:
            raise problem
        return result
    message = None if problem is None else f"{type(problem).__name__}\0{problem}"
    failed = [(r, m) for r, m in enumerate(gather_messages(message)) if m is not None]
    if problem is not None:
        raise problem
    if failed:
        rank, text = failed[0]
        error_type, _, detail = text.partition("\0")
        raise PeerFailed(rank, error_type, detail)
    return result


def barrier_naming_missing_ranks() -> None:
    """A barrier that, on gloo, fails naming the ranks that did not arrive within the collective
    timeout instead of waiting on them forever (torch's monitored_barrier); a plain barrier on NCCL."""
    if get_world_size() == 1:
        return
    if backend() == "gloo":
        dist.monitored_barrier(timeout=collective_timeout(), wait_all_ranks=True)
    else:
        barrier()

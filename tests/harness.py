"""The one multi-process harness: run a function on N gloo ranks, get per-rank results.

    results = run_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> picklable

Ranks are forked from a forkserver that imported torch once (fast, and never forked from a
process whose OpenMP pool is running). Every run has a timeout; the first failing rank's
traceback is re-raised in the test with its rank, and the other ranks are killed, not left hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from typing import Any, Callable

DEFAULT_TIMEOUT_S = 300.0
"""Generous: the suite must pass on a machine busy with other work (a load of 8 on 2 cores makes a
rank 4x slower). A test that waits on a hang passes its own, shorter timeout."""

COLLECTIVE_TIMEOUT_S = 120
"""The ranks' collective timeout ($ZERODP_TIMEOUT); tests of timeouts set their own."""

_ctx = mp.get_context("forkserver")
# torch._dynamo: torch.optim imports it when the first optimizer is built, 1.5 s in every rank otherwise
_ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zerodp"])


class RankFailed(AssertionError):
    """A rank raised (or timed out); the message carries its rank and traceback."""


def _entry(fn: Callable, rank: int, world_size: int, init_file: str, args: tuple, env: dict, queue) -> None:
    try:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_WORLD_SIZE": str(world_size), "ZERODP_TIMEOUT": str(COLLECTIVE_TIMEOUT_S), **env})
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle: tensors travel by value, not as shared memory that dies with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test, with its rank
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world_size: int, args: tuple = (), env: dict | None = None,
              timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return results in rank order."""
    queue = _ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [_ctx.Process(target=_entry, args=(fn, r, world_size, init_file, args, env or {}, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(queue, procs, world_size, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)


def _collect(queue, procs, world_size: int, timeout: float) -> list[Any]:
    import queue as queue_mod
    import time

    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        try:
            rank, status, payload = queue.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue_mod.Empty:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise RankFailed(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s") from None
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead:
                raise RankFailed(f"rank {dead[0]} of {world_size} died (exit code {procs[dead[0]].exitcode})")
            continue
        if status == "error":
            raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
        results[rank] = pickle.loads(payload)
    return [results[r] for r in range(world_size)]


def full_state(engine) -> dict:
    """{name: {"master" and each optimizer state key: the full flat tensor}}, assembled from every
    rank's pieces (call on every rank)."""
    import torch
    import torch.distributed as dist

    mine = [(p.name, p.offset, {k: t.detach().cpu().clone() for k, t in p.tensors.items()})
            for p in engine.strategy.pieces(saving=True)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full: dict[str, dict[str, list]] = {}
    for pieces in everyone:
        for name, offset, tensors in pieces:
            for key, t in tensors.items():
                full.setdefault(name, {}).setdefault(key, []).append((offset, t))
    return {n: {k: torch.cat([t for _, t in sorted(v, key=lambda x: x[0])]) for k, v in keys.items()}
            for n, keys in full.items()}


def json_objects(text: str) -> list:
    """Every JSON object printed in `text` by several processes sharing one stdout: each print is
    one write (atomic under 4 KiB), but a newline may come apart from its line, so objects are read
    where they start, not line by line."""
    import json

    decoder, objects, i = json.JSONDecoder(), [], text.find("{")
    while i != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:  # a "{" in other output
            i = text.find("{", i + 1)
            continue
        objects.append(obj)
        i = text.find("{", end)
    return objects

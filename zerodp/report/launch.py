"""One launch of `zerodp compare`: a job trained on N fresh spawned processes, and nothing left behind
(not even when `zerodp compare` is killed: [Note: workers die with their launcher] in zerodp/comm/lifecycle.py)."""

from __future__ import annotations

import time
from typing import Any

from zerodp.comm.lifecycle import die_with_launcher, workers_die_with_me
from zerodp.ports import free_port
from zerodp.report.worker import worker


def launch(job: dict, nproc: int) -> dict:
    """Train `job` on `nproc` fresh processes: rank 0's result, or {"error": why} when any rank failed,
    died or ran past the job's timeout (the other ranks are then stopped: nothing is left hanging).

    `job`: framework, model, micro_batch, seq_len, dtype, steps, warmup, memory (measure it: the
    first round), timeout (seconds), log (a path with {rank}), and optionally config (DeepSpeed
    config keys over the framework's own)."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").Queue()
    with workers_die_with_me():  # a SIGKILLed `zerodp compare` takes its ranks along
        procs = mp.start_processes(_worker_dying_with_launcher, args=(nproc, free_port(), job, queue), nprocs=nproc,
                                   join=False, start_method="spawn")
    results, failure = _collect(procs, queue, nproc, job["timeout"])
    for p in procs.processes:
        p.join(timeout=30 if failure is None else 2)
        if p.is_alive():
            p.kill()
            p.join()
    if failure is not None:
        tb = next((r["traceback"] for r in results.values() if "error" in r), "")
        return {"error": f"{failure} (its output: {job['log'].format(rank='*')})", "traceback": tb}
    return results[0]


def _worker_dying_with_launcher(rank: int, *args: Any) -> None:
    """`worker`, killed when `zerodp compare` dies. torch's spawn asks for SIGINT on the parent's death,
    after the import that armed SIGKILL; a SIGINT waits for a rank blocked in a collective and can be
    caught, so SIGKILL is armed again here, last ([Note: workers die with their launcher])."""
    die_with_launcher()
    worker(rank, *args)


def _collect(procs: Any, queue: Any, nproc: int, timeout: float) -> tuple[dict[int, dict], str | None]:
    """Every rank's result from `queue`, until one reports an error, one exits without reporting, or
    `timeout` seconds pass; the results so far and the first failure (None when all reported)."""
    import queue as queue_module

    results: dict[int, dict] = {}
    deadline, failure = time.monotonic() + timeout, None
    while len(results) < nproc and failure is None:
        try:
            rank, result = queue.get(timeout=0.5)
            results[rank] = result
            failure = result.get("error") and f"rank {rank}: {result['error']}"
        except queue_module.Empty:
            gone = [r for r, p in enumerate(procs.processes) if p.exitcode is not None and r not in results]
            if gone:
                failure = f"rank {gone[0]} exited with code {procs.processes[gone[0]].exitcode} before reporting"
            elif time.monotonic() > deadline:
                failure = f"no result after --timeout {timeout} s"
    return results, failure

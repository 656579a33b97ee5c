"""How a zerodp process ends: a finished one exits 0, a failed one exits non-zero with its own
traceback, and neither waits long. See [Note: leaving nothing for interpreter shutdown] in zerodp/comm/lifecycle.py.

These tests start real interpreters (subprocess), because the harness's ranks leave with
os._exit and never run interpreter shutdown, which is where the failure lives.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from zerodp.ports import free_port

# The sync all-reduce is the script's last statement, so the worker thread of gloo releases the
# tensor only after the script ends. A 30 s switch interval keeps the GIL with the main thread, so
# the worker cannot take it (to release the tensor) before interpreter shutdown starts: without the
# drain at exit, the release happens during finalisation and aborts (deterministically, not by a race).
# Rank 0 also leaves an async all-reduce that nobody waits for.
# With GO set, rank 0 raises instead, and rank 1 never joins: it waits for the file GO, which the
# test writes only after rank 0 has exited, so a rank 0 that waits for its peer at exit never ends.
_LATE_PEER = textwrap.dedent("""
    import os, sys, time, torch, zerodp
    zerodp.init_distributed()
    rank = zerodp.comm.get_rank()
    t = torch.ones(1 << 16)
    print(f"rank {rank} started", flush=True)
    sys.setswitchinterval(30)
    if rank == 1 and os.environ.get("GO"):
        while not os.path.exists(os.environ["GO"]):
            time.sleep(0.05)
    elif rank == 1:
        time.sleep(1.0)
        zerodp.comm.all_reduce(t)
    else:
        zerodp.comm.all_reduce(t, async_op=True)
        if os.environ.get("GO"):
            raise RuntimeError("the user's own error")
""")


def _start_two_ranks(script: str, tmp_path, env: dict | None = None) -> list[subprocess.Popen]:
    path = tmp_path / "script.py"
    path.write_text(script)
    port = str(free_port())
    return [subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "ZERODP_TIMEOUT": "200",
                                  **(env or {})})
            for rank in range(2)]


def test_a_script_that_ends_right_after_a_collective_exits_0(tmp_path) -> None:
    for rank, proc in enumerate(_start_two_ranks(_LATE_PEER, tmp_path)):
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err[-2000:]}"
        assert f"rank {rank} started" in out and "terminate called" not in err


def test_a_failing_script_exits_1_with_its_traceback_and_does_not_wait_for_its_peer(tmp_path) -> None:
    go = tmp_path / "go"
    failing, peer = _start_two_ranks(_LATE_PEER, tmp_path, env={"GO": str(go)})
    try:
        # Less than ZERODP_TIMEOUT: a rank 0 that waits for the collective fails the test here.
        _, err = failing.communicate(timeout=150)
    finally:
        go.write_text("")
    assert failing.returncode == 1, err[-2000:]
    assert "RuntimeError: the user's own error" in err
    assert "unfinished collectives" in err
    out, err = peer.communicate(timeout=180)
    assert peer.returncode == 0, err[-2000:]


@pytest.mark.parametrize("stage", [0, 3])
def test_collectives_leave_no_tensor_with_the_backend_once_drained(stage: int) -> None:
    from tests.harness import run_ranks

    assert run_ranks(_pending_after_training, world_size=2, args=(stage,)) == [0, 0]


def _pending_after_training(rank: int, world_size: int, stage: int) -> int:
    import zerodp
    from tests.models import batch, make_model

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zerodp.initialize(model=make_model(), config=config)
    for step in range(2):
        engine.backward(engine(*batch(rank, step, 0)))
        engine.step()
    if not zerodp.comm.drain_pending(timeout_s=30):
        raise AssertionError(f"rank {rank}: {zerodp.comm.pending_collectives()} tensors still held")
    return zerodp.comm.pending_collectives()


def test_a_collective_whose_peer_died_names_the_rank_that_is_gone(tmp_path) -> None:
    script = textwrap.dedent("""
        import os, time, torch, zerodp
        zerodp.init_distributed()
        if zerodp.comm.get_rank() == 1:
            os._exit(3)   # killed, say by the OOM killer
        time.sleep(0.5)
        try:
            zerodp.comm.all_reduce(torch.ones(4))
        except zerodp.comm.PeerGone as err:
            print(err, flush=True)
    """)
    survivor, dead = _start_two_ranks(script, tmp_path)
    out, err = survivor.communicate(timeout=180)
    dead.communicate(timeout=180)
    assert survivor.returncode == 0, err[-2000:]
    assert out.startswith("rank 0: rank 1 is gone, so this collective cannot finish"), out + err[-2000:]


def test_the_exit_waits_for_a_busy_backend_worker_thread() -> None:
    """settle_backend_threads (the exit's wait for other libraries' collectives, (4) of the Note)
    returns once no thread with the name of gloo's workers is on the CPU: one that hashes for 0.3 s
    (hashlib lets go of the GIL, so the thread stays runnable) holds it back that long."""
    import ctypes
    import hashlib
    import threading
    import time

    from zerodp.comm import settle_backend_threads

    assert settle_backend_threads(5.0)  # no such thread
    data, started, until = bytes(32 << 20), threading.Event(), time.monotonic() + 0.3

    def busy() -> None:
        ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME: the name gloo's workers have
        started.set()
        while time.monotonic() < until:
            hashlib.sha256(data)

    worker = threading.Thread(target=busy)
    worker.start()
    started.wait()
    assert settle_backend_threads(30.0)
    settled = time.monotonic()
    worker.join()
    assert settled >= until - 0.05, f"returned {until - settled:.3f} s before the worker stopped"


def test_a_settled_collective_returns_once_the_backend_let_go_of_its_tensors() -> None:
    """zerodp.plan.measure's traces run settled (comm.settled_collectives): a sync collective or a
    waited async one leaves no tensor with gloo's threads, even when the GIL stays with the main thread."""
    from tests.harness import run_ranks

    assert run_ranks(_held_after_each_collective, world_size=2) == [[0] * 5] * 2


def _held_after_each_collective(rank: int, world_size: int) -> list[int]:
    import torch

    from zerodp import comm

    held, interval = [], sys.getswitchinterval()
    sys.setswitchinterval(30)  # the worker gets the GIL only when the main thread waits
    try:
        with comm.settled_collectives():
            t, gathered = torch.ones(1024), torch.empty(2048)
            comm.all_reduce(t)
            held.append(comm.pending_collectives())
            comm.all_gather_into_tensor(gathered, t)
            held.append(comm.pending_collectives())
            comm.reduce_scatter_tensor(torch.empty(1024), gathered, async_op=True).wait()
            held.append(comm.pending_collectives())
            comm.all_to_all_single(torch.empty(1024), t)
            held.append(comm.pending_collectives())
            comm.broadcast(t, src=1)
            held.append(comm.pending_collectives())
    finally:
        sys.setswitchinterval(interval)
    return held

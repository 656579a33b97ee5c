"""Several hosts for real: network namespaces joined by a bridge (tests/netns.py), zerodp launched on
each with `zerodp run` over torchrun, gloo's traffic between hosts crossing the veth pairs.

When one of 2 hosts dies mid-run (every process SIGKILLed), the other's torchrun restarts its workers at
2 ranks (--nnodes 1:2 --max-restarts 1), which resume from the last checkpoint with train_batch_size
kept and finish as a fresh 2-rank resume from that checkpoint does.

2 hosts x 2 ranks must train as 1 host x 4 ranks does (bitwise in fp32: gloo sums in rank order), with
torchrun's static rendezvous (--master-addr) and its c10d rendezvous; a checkpoint saved on 2 hosts, each
on its own disk (checkpoint.use_node_local_storage), gathered, resumes on 1; every host's job exits 0 on
its own (none waits on another's exit barrier).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import json_objects
from tests.netns import Host, hosts

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "tests" / "scripts" / "multihost_train.py")
ZERODP = [sys.executable, "-c", "from zerodp.cli import main; raise SystemExit(main())"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "ZERODP_TIMEOUT": "60"}
TIMEOUT_S = 240


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    """Every process's stdout, once all exited 0; else every one's output tail in the error."""
    results = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(rc != 0 for rc, _, _ in results):
        tails = "\n".join(f"--- host {i}: exit {rc}\n{(out + err)[-3000:]}" for i, (rc, out, err) in enumerate(results))
        raise AssertionError(f"a host's job failed:\n{tails}")
    return [out for _, out, _ in results]


def _on_hosts(on: list[Host], rendezvous: str, *script_args: str, disks: list[tuple[str, str]] | None = None) -> dict:
    procs = []
    for node_rank, host in enumerate(on):
        # The hosts share this machine's hostname, which torchrun would advertise as the workers' master
        # address (resolving to this host's own loopback on the other host): --local-addr gives the real one.
        # Real machines have hostnames of their own and need neither this nor is_host below.
        launch = ["run", "--nnodes", str(len(on)), "--nproc-per-node", "2", "--local-addr", host.address]
        if rendezvous == "static":
            launch += ["--node-rank", str(node_rank), "--master-addr", on[0].address, "--master-port", "29611"]
        else:  # c10d: torchrun assigns the node ranks; is_host says which host serves the endpoint
            launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{on[0].address}:29612", "--rdzv-id", "zdp",
                       "--rdzv-conf", f"is_host={int(node_rank == 0)}"]
        procs.append(host.popen([*ZERODP, *launch, SCRIPT, *script_args], ENV, disk=disks and disks[node_rank],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO))
    (result,) = [obj for out in _finish(procs) for obj in json_objects(out) if "losses" in obj]
    return result


def _one_host(num_ranks: int, *script_args: str, script: str = SCRIPT) -> dict:
    proc = subprocess.Popen([*ZERODP, "run", "--nproc-per-node", str(num_ranks), script, *script_args], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    (result,) = [obj for obj in json_objects(_finish([proc])[0]) if "losses" in obj]
    return result


def test_two_hosts_train_bitwise_as_one_host_and_a_checkpoint_moves_between_them(tmp_path: Path) -> None:
    from zerodp.cli import main

    disks = [(str(tmp_path / f"disk{i}"), str(tmp_path / "b")) for i in range(2)]  # each host's own disk at b/
    for path in (*(d for d, _ in disks), tmp_path / "b"):
        os.makedirs(path)
    with hosts(2) as on:
        spread = _on_hosts(on, "static", "--stages", "0,1,2,3", "--ckpt", str(tmp_path / "a"))
        saved = _on_hosts(on, "c10d", "--stages", "3", "--steps", "2", "--save-at", "2", "--ckpt", str(tmp_path / "b"),
                          "--node-local", disks=disks)
    assert sorted(spread["hosts"]) == sorted([on[0].namespace] * 2 + [on[1].namespace] * 2)
    assert len(set(saved["hosts"])) == 2 and saved["world"] == 4
    # node-local: each host's disk holds its own two ranks' files; gathered, they load on one host
    held = [sorted(n for n in os.listdir(Path(d, "stage3", "global_step2")) if n.startswith("rank_")) for d, _ in disks]
    assert sorted(held) == [["rank_0_of_4.pt", "rank_1_of_4.pt"], ["rank_2_of_4.pt", "rank_3_of_4.pt"]]
    assert os.listdir(tmp_path / "b") == []  # nothing reached the machine's own directory
    assert main(["ckpt", "gather", *(str(Path(d, "stage3")) for d, _ in disks), "--out", str(tmp_path / "b" / "stage3")]) == 0
    together = _one_host(4, "--stages", "0,1,2,3", "--ckpt", str(tmp_path / "c"))
    assert spread["world"] == together["world"] == 4
    for stage in "0123":
        assert spread["losses"][stage] == together["losses"][stage], stage  # every rank's losses, bitwise
    # saved by 2 hosts (c10d rendezvous), resumed by 1 host with the same 4 ranks: the rest of the run
    resumed = _one_host(4, "--stages", "3", "--steps", "4", "--resume", "--ckpt", str(tmp_path / "b"))
    assert resumed["global_steps"]["3"] == 4
    assert [s + r for s, r in zip(saved["losses"]["3"], resumed["losses"]["3"])] == together["losses"]["3"]


ELASTIC = str(REPO / "tests" / "scripts" / "elastic_train.py")


def _step(tag: str) -> int:
    return int(tag.removeprefix("global_step"))


def _kill_host(host: Host) -> None:
    """Every process of the host at once, as when the machine dies (SIGKILL: no clean-up runs)."""
    pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout.split()
    subprocess.run(["kill", "-9", *pids], capture_output=True)


def test_when_a_host_dies_the_other_restarts_and_finishes_from_the_last_checkpoint(tmp_path: Path) -> None:
    import time

    ckpt = tmp_path / "elastic"  # shared by both hosts: a dead host's node-local files would be gone with it
    procs = []
    with hosts(2) as on:
        for i, host in enumerate(on):
            # last_call_timeout: both hosts join the first round even on a busy machine; keep-alives every
            # second, so the survivor's next round soon stops waiting for the dead host
            conf = f"is_host={int(i == 0)},last_call_timeout=8,keep_alive_interval=1,keep_alive_max_attempt=2"
            launch = ["run", "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1", "--local-addr",
                      host.address, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{on[0].address}:29614",
                      "--rdzv-id", "elastic", "--rdzv-conf", conf]
            procs.append(host.popen([*ZERODP, *launch, ELASTIC, "--ckpt", str(ckpt), "--steps", "8",
                                     "--step-sleep", "0.3"], ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, cwd=REPO))
        deadline = time.monotonic() + TIMEOUT_S
        while not ((ckpt / "latest").exists() and _step((ckpt / "latest").read_text()) >= 3):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                _kill_host(on[0]), _kill_host(on[1])
                _finish(procs)  # raises with both hosts' output
            time.sleep(0.05)
        _kill_host(on[1])  # mid-training: steps 3..8 are left
        procs[1].communicate(timeout=TIMEOUT_S)
        (out,) = _finish([procs[0]])
    (result,) = [obj for obj in json_objects(out) if "losses" in obj]
    assert result["world"] == 2 and result["restarts"] == 1 and result["global_steps"] == 8
    assert result["accumulation"] == 2  # train_batch_size 16 kept: 4 x 2 x 2 ranks instead of 4 x 1 x 4
    assert _step(result["resumed_from"]) >= 3
    # the same resume, uninterrupted, on one host with 2 ranks: the survivor's losses exactly
    again = _one_host(2, "--ckpt", str(ckpt), "--tag", result["resumed_from"], "--steps", "8", "--no-save",
                      script=ELASTIC)
    assert again["losses"] == result["losses"]

"""comm/launch_env.py: rank, world size, local rank and master from torchrun's, mpirun's (Open MPI,
MPICH / Intel MPI) or Slurm's srun variables; and a real 2-process job started with Slurm's
variables only, no torchrun."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerodp.comm import lifecycle
from zerodp.comm.launch_env import LaunchEnv, discover_launch_env, expand_hostlist, first_host, tasks_on_node
from zerodp.ports import free_port

REPO = Path(__file__).resolve().parent.parent

SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "10.0.0.1"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "host0"}


# --- which source, and what it gives -------------------------------------------------------------


def test_slurm_gives_rank_size_local_rank_and_the_first_host_as_master() -> None:
    assert discover_launch_env(SLURM) == LaunchEnv("slurm", 3, 4, 1, "gpu07", 29500, local_world_size=2)


def test_slurm_step_nodelist_comes_first_and_master_addr_and_port_win() -> None:
    env = {**SLURM, "SLURM_STEP_NODELIST": "n[3-4]", "SLURM_NODELIST": "m1"}
    assert discover_launch_env(env).master_addr == "n3"
    env = {**env, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "31000"}
    launch = discover_launch_env(env, default_port=1234)
    assert (launch.master_addr, launch.master_port) == ("10.1.1.1", 31000)
    assert discover_launch_env(SLURM, default_port=1234).master_port == 1234  # DeepSpeed's distributed_port


def test_openmpi_and_mpich() -> None:
    assert discover_launch_env(OPENMPI) == LaunchEnv("openmpi", 5, 8, 1, "10.0.0.1", 29500, local_world_size=4)
    assert discover_launch_env(MPICH) == LaunchEnv("mpich", 2, 4, 0, "host0", 29500, local_world_size=2)


def test_torchrun_wins_over_everything_and_is_left_to_torch() -> None:
    env = {**SLURM, **OPENMPI, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    launch = discover_launch_env(env)
    assert launch == LaunchEnv("torchrun", 1, 2, 1) and launch.exports() == {}


def test_mpirun_inside_a_slurm_allocation_is_mpi_and_srun_with_pmi2_is_slurm() -> None:
    # mpirun in a batch script: every process inherits the batch step's SLURM_PROCID=0
    assert discover_launch_env({**SLURM, "SLURM_PROCID": "0", **OPENMPI}).source == "openmpi"
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE too, to the same values: Slurm, which names the master
    pmi = {"PMI_RANK": "3", "PMI_SIZE": "4"}
    assert discover_launch_env({**SLURM, **pmi}) == discover_launch_env(SLURM)


def test_no_launcher_is_one_rank() -> None:
    assert discover_launch_env({"HOME": "/root"}) == LaunchEnv("none", 0, 1, 0)


def test_exports_are_torchruns_variables() -> None:
    assert discover_launch_env(SLURM).exports() == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                                    "MASTER_ADDR": "gpu07", "MASTER_PORT": "29500",
                                                    "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize("env,match", [
    ({"RANK": "0"}, r"\$RANK='0' is set but \$WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, r"\$WORLD_SIZE='2' is set but \$RANK is not"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, r"\$SLURM_PROCID=4 and \$SLURM_NTASKS=4 are inconsistent"),
    ({"SLURM_PROCID": "1"}, r"\$SLURM_PROCID='1' is set but \$SLURM_NTASKS is not"),
    ({**SLURM, "SLURM_LOCALID": "x"}, r"\$SLURM_LOCALID='x' is not a non-negative integer"),
    ({**SLURM, "SLURM_LOCALID": "4"}, r"\$SLURM_LOCALID=4 must be below \$SLURM_NTASKS=4"),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1(x4)"}, r"\$SLURM_STEP_TASKS_PER_NODE='1\(x4\)' does not hold"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, r"rank 0's host is unknown; set MASTER_ADDR"),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu[08-07]"}, r"\$SLURM_JOB_NODELIST: .*ends below its start; set MASTER_ADDR"),
    ({k: v for k, v in OPENMPI.items() if k != "MASTER_ADDR"}, r"openmpi launch \(mpirun\) without \$MASTER_ADDR"),
    ({k: v for k, v in MPICH.items() if k != "MPI_LOCALRANKID"}, r"\$MPI_LOCALRANKID is unset.*set LOCAL_RANK"),
    ({**MPICH, "MASTER_PORT": "http"}, r"\$MASTER_PORT='http' is not a port number"),
])
def test_inconsistent_or_incomplete_variables_are_named(env: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        discover_launch_env(env)


# --- Slurm's compact lists -----------------------------------------------------------------------


def test_hostlists_by_hand() -> None:
    assert expand_hostlist("node[01-04,07]") == ["node01", "node02", "node03", "node04", "node07"]
    assert expand_hostlist("a1,b[8-10].x,c") == ["a1", "b8.x", "b9.x", "b10.x", "c"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert first_host("node[001-100000000]") == "node001"  # without expanding the rest
    for bad in ["", "a,,b", "n[1-2", "n]1[", "n[[1]]", "n[a-b]", "n[3-1]"]:
        with pytest.raises(ValueError, match="host list"):
            expand_hostlist(bad)
        with pytest.raises(ValueError, match="host list"):
            first_host(bad)
    assert tasks_on_node("2(x3),1", 2) == 2 and tasks_on_node("2(x3),1", 3) == 1 and tasks_on_node("2(x3),1", 4) is None


_prefix = st.text(alphabet="abcxyz-", min_size=1, max_size=4)
_number_group = st.tuples(st.integers(0, 3), st.integers(0, 120), st.integers(0, 3))  # (padding, low, count - 1)


@given(st.lists(st.tuples(_prefix, st.lists(_number_group, min_size=0, max_size=3)), min_size=1, max_size=4))
def test_compact_hostlists_expand_to_the_hosts_they_stand_for(entries) -> None:
    """Build hosts and their compact form side by side; expanding the form gives the hosts back."""
    compact, hosts = [], []
    for prefix, groups in entries:
        width = [max(pad, 1) for pad, _, _ in groups]
        names = [f"{prefix}{lo + i:0{w}d}" for (_, lo, count), w in zip(groups, width) for i in range(count + 1)]
        ranges = ",".join(f"{lo:0{w}d}-{lo + count:0{w}d}" if count else f"{lo:0{w}d}"
                          for (_, lo, count), w in zip(groups, width))
        if groups and all(len(str(lo + count)) <= w for (_, lo, count), w in zip(groups, width)):
            compact.append(f"{prefix}[{ranges}]")
            hosts += names
        else:  # padding narrower than the numbers: write the hosts out
            compact.append(prefix)
            hosts.append(prefix)
    text = ",".join(compact)
    assert expand_hostlist(text) == hosts
    assert first_host(text) == hosts[0]


# --- init_distributed's use of it --------------------------------------------------------------------


def _launcher_free_env(monkeypatch: pytest.MonkeyPatch, env: dict) -> None:
    # init_distributed exports torchrun's variables into os.environ: registered here (set, then deleted) so
    # the monkeypatch removes them again, or RANK 3 / WORLD_SIZE 4 would reach every later test
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_init_distributed_exports_a_slurm_launch_and_logs_its_source(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    _launcher_free_env(monkeypatch, SLURM)
    with caplog.at_level(logging.INFO, logger="zerodp"):
        assert lifecycle._from_launcher(distributed_port=29511) == (-1, -1)  # then env://
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} == \
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07", "MASTER_PORT": "29511"}
    assert "launch from slurm: rank 3 of 4, local rank 1, master gpu07:29511" in caplog.text


def test_init_distributed_refuses_mpirun_without_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    _launcher_free_env(monkeypatch, {k: v for k, v in OPENMPI.items() if k != "MASTER_ADDR"})
    with pytest.raises(ValueError, match=r"set MASTER_ADDR to the address of rank 0's host"):
        lifecycle.init_distributed(dist_backend="gloo")
    assert "RANK" not in os.environ


_ALL_REDUCE = """
import os, sys, torch
if sys.argv[1] == "deepspeed":
    import deepspeed
    deepspeed.comm.init_distributed(dist_backend="gloo", distributed_port=int(sys.argv[2]))
else:
    import zerodp
    zerodp.init_distributed(dist_backend="gloo", distributed_port=int(sys.argv[2]))
import torch.distributed as dist
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']} sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_two_processes_started_with_slurm_variables_only_all_reduce(tmp_path) -> None:
    """What srun does: two processes, no torchrun, only SLURM_* (plus the port, as DeepSpeed's
    `distributed_port` argument, so that parallel test runs do not meet on 29500). Rank 0 calls
    zerodp.init_distributed, rank 1 deepspeed.comm.init_distributed under ZERODP_AS_DEEPSPEED=1:
    both paths in one job."""
    script = tmp_path / "all_reduce.py"
    script.write_text(textwrap.dedent(_ALL_REDUCE))
    port = str(free_port())
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            and not k.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL", "TORCHELASTIC_"))}
    base.update(PYTHONPATH=str(REPO), ZERODP_TIMEOUT="60", ZERODP_AS_DEEPSPEED="1")
    procs = [subprocess.Popen([sys.executable, str(script), api, port], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**base, "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
                                   "SLURM_NODELIST": "127.0.0.[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2"})
             for r, api in enumerate(["zerodp", "deepspeed"])]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, (out, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{err[-2000:]}"
        assert f"rank {r} of 2 local {r} sum 3" in out
        assert "launch from slurm: rank" in err and "master 127.0.0.1:" + port in err


_THREADS = textwrap.dedent("""
    import os, sys, torch, zerodp
    before = torch.get_num_threads()
    zerodp.init_distributed("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    print(before, torch.get_num_threads(), len(os.sched_getaffinity(0)))
""")


@pytest.mark.parametrize("env,shared", [({"LOCAL_WORLD_SIZE": "2"}, True), ({"LOCAL_SIZE": "2"}, True),
                                        ({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "2"}, False),
                                        ({}, False)], ids=["torch", "deepspeed", "omp set", "alone"])
def test_cpu_ranks_started_without_torchrun_share_the_cores(tmp_path, env, shared) -> None:
    """A process pool or mp.spawn (DeepSpeed's test harness) gives every rank torch's default of all
    cores; ranks that say how many share the machine get cores / ranks threads each."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")}
    result = subprocess.run([sys.executable, "-c", _THREADS, str(tmp_path / "init")], capture_output=True, text=True,
                            timeout=120, env={**clean, **env, "PYTHONPATH": str(REPO)}, check=True)
    before, after, cores = map(int, result.stdout.split())
    expected = min(before, max(1, cores // 2)) if shared else before
    assert after == expected, result.stderr

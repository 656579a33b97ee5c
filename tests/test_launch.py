"""Launches that cannot run away or leak (issue 38): a process count beyond what the machine can hold is
refused before anything starts, and the workers die with their launcher, even a SIGKILLed one.

The refusal tests run in-process with the function that would start processes replaced by one that
fails the test: a broken refusal fails here instead of starting 100,000 processes.
[Note: workers die with their launcher] in zerodp/comm/lifecycle.py;
[Note: how many processes one machine may start] in zerodp/launcher.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest

from zerodp.cli import main
from zerodp.launcher import max_local_ranks, nproc_alias, split_allow_oversubscribe

GIB = 2**30
RUNAWAY = str(10**5)  # more ranks than any machine this runs on can hold, by cores and by memory


# ---------------------------------------------------------------------------------------------
# the limit


def test_the_limit_is_the_smaller_of_cores_times_four_and_memory_over_half_a_gib() -> None:
    assert max_local_ranks(num_cores=2, available_bytes=64 * GIB) == 8  # cores bound it
    assert max_local_ranks(num_cores=64, available_bytes=4 * GIB) == 8  # memory bounds it
    assert max_local_ranks(num_cores=8, available_bytes=64 * GIB, ranks_per_core=1, rank_bytes=16 * GIB) == 4
    assert max_local_ranks(num_cores=1, available_bytes=0) == 1  # one process can always try


class _Started(Exception):
    """Raised by the replaced starter: the command got as far as starting processes."""


@pytest.fixture
def nothing_starts(monkeypatch) -> Iterator[None]:
    """torchrun's `run` (zerodp run, deepspeed, demo) and compare's runs raise `_Started` instead; the
    environment the commands set for their workers (ZERODP_AS_DEEPSPEED, ZERODP_LOG_LEVEL, ...) is put
    back after, so it reaches no later test's subprocess."""
    import torch.distributed.run

    import zerodp.report

    def started(*args: object, **kwargs: object) -> None:
        raise _Started()

    monkeypatch.setattr(torch.distributed.run, "run", started)
    monkeypatch.setattr(zerodp.report, "compare", started)
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


def _commands(tmp_path: Path, nproc: str, allow: list[str], allow_ds: list[str]) -> dict[str, list[str]]:
    script = str(tmp_path / "train.py")
    return {
        "run": ["run", *allow, "--nproc-per-node", nproc, script],
        "deepspeed": ["deepspeed", *allow_ds, "--num_gpus", nproc, script],
        "demo": ["demo", "--nproc", nproc, *allow],
        "compare": ["compare", "--nproc", nproc, "--out", str(tmp_path / "cmp"), *allow],
    }


@pytest.mark.parametrize("command,flag", [("run", "--nproc-per-node"), ("deepspeed", "--num_gpus"),
                                          ("demo", "--nproc"), ("compare", "--nproc")])
def test_a_runaway_process_count_is_refused_before_anything_starts(command, flag, tmp_path, capsys,
                                                                     nothing_starts) -> None:
    assert main(_commands(tmp_path, RUNAWAY, [], [])[command]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"zerodp {command}: {flag} {RUNAWAY}: this machine can run at most ")
    assert " cores x 4, " in err and " GB available at ~0.5 GB a rank); pass --allow-oversubscribe" in err
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("command", ["run", "deepspeed", "demo", "compare"])
def test_allow_oversubscribe_starts_them_anyway(command, tmp_path, nothing_starts) -> None:
    argv = _commands(tmp_path, RUNAWAY, ["--allow-oversubscribe"], ["--allow_oversubscribe"])[command]
    with pytest.raises(_Started):
        main(argv)


@pytest.mark.parametrize("command,flag", [("run", "--nproc-per-node"), ("deepspeed", "--num_gpus")])
def test_nproc_is_the_process_count_of_run_and_deepspeed_too(command, flag, tmp_path, capsys,
                                                            nothing_starts) -> None:
    """Issue 38's interface: `zerodp run|deepspeed|demo|compare ... --nproc N`."""
    assert main([command, "--nproc", RUNAWAY, str(tmp_path / "train.py")]) == 2
    assert capsys.readouterr().err.startswith(f"zerodp {command}: {flag} {RUNAWAY}: this machine can run at most ")
    script_own = ["--nproc-per-node", "2", "train.py", "--nproc", "7"]
    assert nproc_alias(script_own) == script_own  # after the script: the script's flag
    assert nproc_alias(["--nproc=2", "train.py"]) == ["--nproc-per-node=2", "train.py"]


def test_allow_oversubscribe_after_the_script_is_the_script_s_own() -> None:
    mine = ["--allow-oversubscribe", "--nproc-per-node", "2", "train.py", "--lr", "1"]
    assert split_allow_oversubscribe(mine) == (mine[1:], True)
    theirs = ["--nproc-per-node", "2", "train.py", "--allow-oversubscribe"]
    assert split_allow_oversubscribe(theirs) == (theirs, False)


# ---------------------------------------------------------------------------------------------
# workers die with their launcher

# Each rank writes its pid once it is in the collective loop; the loop ends by itself after two
# minutes, so even a test that fails leaves nothing running for long.
_COLLECTIVE_LOOP = textwrap.dedent("""
    import os, sys, time, torch, zerodp
    zerodp.init_distributed()
    rank, out = zerodp.comm.get_rank(), sys.argv[1]
    t = torch.ones(4)
    zerodp.comm.all_reduce(t)
    with open(os.path.join(out, f"rank{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(out, f"rank{rank}.tmp"), os.path.join(out, f"rank{rank}.pid"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        zerodp.comm.all_reduce(t)
        time.sleep(0.05)
""")


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a killed orphan waits for a reaper that may never come)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rpartition(")")[2].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout} s")
        time.sleep(0.1)


def _kill_launcher_and_expect_no_worker(launcher: subprocess.Popen, workers: list[int],
                                        sig: signal.Signals = signal.SIGKILL) -> None:
    """Send `sig` to the launcher alone (not its group); within a few seconds of its end no worker runs."""
    assert len(workers) == 2 and all(_running(pid) for pid in workers), workers
    os.kill(launcher.pid, sig)
    launcher.wait(timeout=60)  # SIGTERM and SIGINT: torchrun stops its workers first
    deadline = time.monotonic() + 5
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in workers if _running(pid)] == [], f"workers outlived their launcher ({sig.name})"


def _stop(launcher: subprocess.Popen, workers: list[int]) -> None:
    """Leave nothing behind, whatever the test found."""
    for pid in [launcher.pid, *workers]:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    launcher.wait(timeout=10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda sig: sig.name)
def test_workers_of_zerodp_run_die_with_the_launcher(sig, tmp_path) -> None:
    """SIGKILL (and an OOM kill, a crash) by the workers' PR_SET_PDEATHSIG; SIGTERM (a `timeout`) and
    SIGINT (Ctrl-C) by torchrun, which stops its workers when it is told to."""
    script = tmp_path / "loop.py"
    script.write_text(_COLLECTIVE_LOOP)
    log = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen([sys.executable, "-m", "zerodp.cli", "run", "--nproc-per-node", "2", str(script),
                                 str(tmp_path)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    pid_files = [tmp_path / f"rank{rank}.pid" for rank in range(2)]
    workers: list[int] = []
    try:
        _wait_for(lambda: launcher.poll() is not None or all(p.exists() for p in pid_files), 120, "pid files")
        assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
        workers = [int(p.read_text()) for p in pid_files]
        _kill_launcher_and_expect_no_worker(launcher, workers, sig)
    finally:
        _stop(launcher, workers)
        log.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_of_zerodp_demo_die_when_the_launcher_is_sigkilled(tmp_path) -> None:
    out = tmp_path / "demo.out"
    log = open(out, "w")
    launcher = subprocess.Popen([sys.executable, "-m", "zerodp.cli", "demo", "--nproc", "2", "--steps", "5000"],
                                stdout=log, stderr=subprocess.STDOUT)
    workers: list[int] = []
    try:
        # rank 0 prints the header after initialize(), whose collectives need rank 1 up as well
        _wait_for(lambda: launcher.poll() is not None or "zerodp demo: TinyGPT" in out.read_text(), 120, "header")
        assert launcher.poll() is None, out.read_text()[-3000:]
        workers = _children(launcher.pid)
        _kill_launcher_and_expect_no_worker(launcher, workers)
    finally:
        _stop(launcher, workers)
        log.close()


def test_a_worker_whose_launcher_is_already_gone_exits_naming_it(tmp_path) -> None:
    """The window between the fork and the worker's prctl: a launcher gone by then is seen at import."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    result = subprocess.run([sys.executable, "-c", "import zerodp; print('still here')"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "ZERODP_LAUNCHER_PID": str(gone.pid)})
    assert result.returncode == 1 and "still here" not in result.stdout
    assert f"the launcher that started this process (pid {gone.pid}, $ZERODP_LAUNCHER_PID) is gone" in result.stderr


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_of_zerodp_compare_die_when_it_is_sigkilled(tmp_path) -> None:
    """compare spawns its ranks with multiprocessing (zerodp/report/launch.py), not through torchrun.
    torch's spawn already asks for SIGINT on the parent's death, so this passes without zerodp's hook
    as well: it guards the path, and that compare's ranks still train with SIGKILL armed over it."""
    out = tmp_path / "cmp"
    log = open(tmp_path / "compare.log", "w")
    launcher = subprocess.Popen([sys.executable, "-m", "zerodp.cli", "compare", "--frameworks", "ddp", "--rounds",
                                 "1", "--steps", "100000", "--out", str(out)], stdout=log, stderr=subprocess.STDOUT)
    rank_logs = [out / "logs" / f"ddp-round1-rank{rank}.log" for rank in range(2)]
    workers: list[int] = []
    try:
        # each rank opens its log first thing, after `import zerodp` armed its parent-death signal
        _wait_for(lambda: launcher.poll() is not None or all(p.exists() for p in rank_logs), 120, "rank logs")
        assert launcher.poll() is None, (tmp_path / "compare.log").read_text()[-3000:]
        workers = [pid for pid in _children(launcher.pid) if "spawn_main" in _cmdline(pid)]
        _kill_launcher_and_expect_no_worker(launcher, workers)
    finally:
        _stop(launcher, workers)
        log.close()


# ---------------------------------------------------------------------------------------------
# nothing left behind


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "fails"])
def test_zerodp_run_leaves_no_log_directory_behind(tmp_path, fails) -> None:
    """torchrun makes a /tmp/torchelastic_* per launch and never removes it (thousands on a busy
    machine); zerodp run gives it one that goes when the launch ends, after a failure is reported."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import os
        if {fails} and os.environ["RANK"] == "1":
            raise SystemExit("rank 1 gives up")
        os.write(1, ("rank " + os.environ["RANK"] + " done\\n").encode())  # one write: the ranks share a pipe
    """))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = subprocess.run([sys.executable, "-m", "zerodp.cli", "run", "--nproc-per-node", "2", str(script)],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(scratch)})
    assert result.returncode == (1 if fails else 0), result.stderr[-2000:]
    if fails:
        assert "rank      : 1" in result.stderr and "exitcode  : 1" in result.stderr
    else:
        assert "rank 1 done" in result.stdout
    assert list(scratch.iterdir()) == []

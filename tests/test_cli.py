"""The `zerodp` command: config check, demo, run (the launcher over torchrun)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerodp.cli import main
from zerodp.launcher import torchrun_argv


def _write(tmp_path, config: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_config_check_prints_the_resolved_config_and_batch_math(tmp_path, capsys) -> None:
    path = _write(tmp_path, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})
    assert main(["config", "check", path, "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "gradient_accumulation_steps 2 (derived)" in out and "config OK" in out
    assert '"gradient_clipping": 1.0' in out  # defaults are shown resolved


def test_config_check_reports_every_problem_and_exits_1(tmp_path, capsys) -> None:
    path = _write(tmp_path, {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                             "zero_optimization": {"overlap_comms": True}, "amp": {"enabled": True}})
    assert main(["config", "check", path, "--world-size", "1"]) == 1
    err = capsys.readouterr().err
    assert "did you mean 'overlap_comm'" in err
    assert "amp" in err and "removed" in err
    assert "30" in err and "28" in err  # the batch rule with its factors and a consistent value


def test_config_check_without_world_size_says_how_to_give_it(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 4})
    assert main(["config", "check", path]) == 1
    assert "`zerodp config check CONFIG --world-size N`" in capsys.readouterr().err


def test_demo_with_an_unbuilt_feature_is_a_message_not_a_traceback(tmp_path, capsys) -> None:
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                             "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
    assert main(["demo", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "ratio: 0.5 is not supported by zerodp (partial offload (ratio < 1) is not implemented" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,standalone", [
    (["--nproc-per-node", "2", "train.py", "--lr", "1"], True),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--nproc-per-node", "2", "train.py"], False),
    (["--nproc-per-node", "2", "train.py", "--nnodes", "3"], True),  # the script's own option
    (["--nproc-per-node=2", "-m", "pkg.mod"], True),
])
def test_run_adds_standalone_only_on_one_machine(argv: list[str], standalone: bool) -> None:
    out = torchrun_argv(argv)
    assert (out[0] == "--standalone") == standalone
    assert out[-len(argv):] == argv


def _zerodp(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerodp.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_a_failing_rank_stops_the_job_instead_of_hanging(tmp_path) -> None:
    script = tmp_path / "fails_on_rank1.py"
    script.write_text(textwrap.dedent("""
        import os, torch, zerodp
        zerodp.init_distributed()
        if os.environ["RANK"] == "1":
            raise ValueError("rank 1 gives up before the collective")
        zerodp.comm.all_reduce(torch.ones(1))   # rank 0 would wait here forever
    """))
    result = _zerodp("run", "--nproc-per-node", "2", str(script), timeout=120)
    assert result.returncode == 1
    assert "rank 1 gives up" in result.stderr


def test_demo_trains_on_two_processes_and_shows_only_its_own_lines_even_beside_a_checkout_named_zerodp(tmp_path) -> None:
    """The demo trains end to end in bf16 and prints the ledger and the step's collectives. Run from a
    folder holding a directory called zerodp (a checkout's parent): the ranks import the installed
    package, not that directory as a namespace package. Nothing else is printed: no torchrun banner,
    no INFO line repeating the demo's header, no TFLOPS on a CPU."""
    (tmp_path / "zerodp").mkdir()
    result = subprocess.run([sys.executable, "-m", "zerodp.cli", "demo", "--steps", "2", "--dtype", "bf16"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=180,
                            env={k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")})
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "model states" in result.stdout and "TFLOPS" not in result.stdout and " mem " not in result.stdout
    assert "loss " in result.stdout and "memory ledger, rank 0" in result.stdout
    assert "param16" in result.stdout and "all_reduce[bfloat16]" in result.stdout


def test_demo_refuses_zero_steps_in_one_line() -> None:
    result = _zerodp("demo", "--steps", "0")
    assert result.returncode == 2 and "argument --steps: '0' is not a whole number >= 1" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("5G", 5 * 10**9), ("5GiB", 5 * 2**30), ("500MB", 5 * 10**8),
                                       ("1.5GB", 15 * 10**8), ("2KB", 2000), ("4096", 4096)])
def test_shard_sizes_are_read_as_hugging_face_writes_them(text: str, size: int) -> None:
    from zerodp.sizes import parse_size

    assert parse_size(text) == size


def test_a_bad_shard_size_and_a_missing_checkpoint_are_one_line_each(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:  # a usage error (exit 2), before the checkpoint is looked at
        main(["ckpt", "convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--max-shard-size", "5 parsecs"])
    assert exited.value.code == 2
    assert "argument --max-shard-size: '5 parsecs': expected a size such as 5GB" in capsys.readouterr().err
    assert main(["ckpt", "inspect", str(tmp_path / "nowhere")]) == 1
    assert capsys.readouterr().err == f"zerodp ckpt inspect: {tmp_path / 'nowhere'} does not exist\n"


def test_demo_at_stage_3_shards_the_parameters() -> None:
    result = _zerodp("demo", "--steps", "4", "--stage", "3", timeout=180)
    assert result.returncode == 0, result.stderr
    assert "ZeRO stage 3" in result.stdout and "gathered_params" in result.stdout
    assert "reduce_scatter[float32]" in result.stdout


def test_the_lines_a_config_asks_for_reach_stderr_without_any_logging_set_up(tmp_path) -> None:
    """steps_per_print, wall_clock_breakdown, memory_breakdown and dump_state in a plain user
    script (no launcher, no logging.basicConfig), as DeepSpeed prints them."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, zerodp
        from tests.models import batch, make_model
        config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 2, "wall_clock_breakdown": True,
                  "memory_breakdown": True, "dump_state": True, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = zerodp.initialize(model=make_model(), config=config)
        for step in range(4):
            engine.backward(engine(*batch(0, step, 0)))
            engine.step()
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            cwd=str(Path(__file__).parent.parent), env={**os.environ, "PYTHONPATH": "."})
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    steps = [line for line in lines if line.startswith("[zerodp] step ")]
    assert [s.split("|")[0].strip() for s in steps] == ["[zerodp] step      2", "[zerodp] step      4"]
    assert all(re.match(r"\[zerodp\] step +\d+ \| loss +\S+ \| grad_norm +\S+ \| lr ", s) for s in steps), steps
    times = [line for line in lines if line.startswith("[zerodp] time (ms): ")]
    assert len(times) == 2 and all(re.match(r"\[zerodp\] time \(ms\): fwd \S+ \| bwd \S+ \| step \S+$", t)
                                   for t in times), times
    breakdowns = [line for line in lines if line.startswith("[zerodp] breakdown (ms): forward ")]
    assert len(breakdowns) == 2 and all(re.search(r" of \S+ -> (compute|communication|offload|input)-bound \(\d+%", b)
                                        for b in breakdowns), breakdowns
    memory = [line for line in lines if line.startswith("[zerodp] memory: ")]
    assert len(memory) == 2 and all("param32_master (device)" in m and "| model states " in m for m in memory), memory
    assert "zerodp config, resolved (dump_state):" in result.stderr and '"steps_per_print": 2' in result.stderr


def test_log_level_in_the_config_quiets_zerodp(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import zerodp
        from tests.models import make_model
        zerodp.initialize(model=make_model(), config={"train_micro_batch_size_per_gpu": 1, "log_level": "warning",
                                                      "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        zerodp.log.log_rank0("an info line")
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            cwd=str(Path(__file__).parent.parent), env={**os.environ, "PYTHONPATH": "."})
    assert result.returncode == 0, result.stderr
    assert "an info line" not in result.stderr

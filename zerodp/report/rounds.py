"""`compare()`: every framework launched in turn, interleaved over rounds, then the report written."""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path
from typing import Callable

from zerodp.report.frameworks import FRAMEWORKS, CompareError
from zerodp.report.launch import launch
from zerodp.report.markdown import write_report
from zerodp.report.plots import draw_plots
from zerodp.report.summary import summarize

NO_DEEPSPEED = "deepspeed is not installed (pip install deepspeed)"


def compare(model: str, out: Path, frameworks: list[str], nproc: int = 2, steps: int = 10, rounds: int = 3,
            warmup: int = 2, micro_batch: int = 8, seq_len: int | None = None, dtype: str = "fp32",
            timeout: int = 600, command: str = "", progress: Callable[[str], None] = print) -> list[dict]:
    """Run every framework of `frameworks` on `model` and write `out`/report.md (+ results.json, PNGs).

    Each launch trains `warmup` + `steps` optimizer steps of `micro_batch` samples of `seq_len`
    tokens (default: the model's longest, at most 128) per rank on `nproc` fresh processes, in
    `dtype`; `rounds` launches per framework, interleaved; a launch past `timeout` seconds fails.
    `command` is the line printed in the report; `progress` gets one line per launch. Returns the
    report's rows; CompareError (before anything is launched) for bad input."""
    import datetime

    import torch

    seq_len, params = _check(model, warmup, seq_len)
    _make_out(out)
    plots_missing = _plots_missing(progress)
    job = {"model": model, "micro_batch": micro_batch, "seq_len": seq_len, "dtype": dtype, "steps": steps,
           "warmup": warmup, "timeout": timeout}
    launches = _run_rounds(out, frameworks, nproc, rounds, job, progress)
    rows = [summarize(n, launches[n], model, params, nproc, micro_batch, seq_len, dtype) for n in frameworks]
    meta = {"model": model, "params": params, "nproc": nproc, "micro_batch": micro_batch, "seq_len": seq_len,
            "dtype": dtype, "steps": steps, "rounds": rounds, "warmup": warmup, "torch": torch.__version__,
            "device": "CUDA" if torch.cuda.is_available() else "CPU, gloo",
            "date": datetime.date.today().isoformat(), "command": command, "plots_missing": plots_missing}
    if plots_missing is None and any("error" not in r for r in rows):
        meta["plots"] = draw_plots(out, rows)
    write_report(out, rows, meta)
    return rows


def _check(model: str, warmup: int, seq_len: int | None) -> tuple[int, int]:
    """The sequence length to train with and the model's trainable parameters; CompareError for what
    would fail only after a launch."""
    import torch

    from zerodp.plan.workload import workload

    work = workload(model)
    if work.inputs is None:
        raise CompareError(f"MODEL {model!r}: zerodp does not know this model's input; give the module an "
                           "`estimate_inputs(micro_batch, seq_len)` method returning (args, kwargs)")
    if warmup < 2:
        raise CompareError(f"--warmup {warmup}: at least 2 (memory is measured through the warm-up steps, and the "
                           "peak comes in the second, the first with optimizer state)")
    seq_len = seq_len or min(work.max_seq_len or 128, 128)
    if work.max_seq_len and seq_len > work.max_seq_len:
        raise CompareError(f"--seq-len {seq_len}: the model takes at most {work.max_seq_len} tokens")
    with torch.device("meta"):
        params = sum(p.numel() for p in work.build().parameters() if p.requires_grad)
    return seq_len, params


def _make_out(out: Path) -> None:
    """The output directory and its logs/, or CompareError naming --out (a file there, no permission)."""
    if out.exists() and not out.is_dir():
        raise CompareError(f"--out {out}: a file is there; name a directory (it is created when missing)")
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CompareError(f"--out {out}: cannot create it ({err.strerror or err})") from None


def _plots_missing(progress: Callable[[str], None]) -> str | None:
    """Why there will be no plots (matplotlib missing), said once through `progress`; None when there will be."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        missing = "matplotlib is not installed (pip install matplotlib, or zerodp's [plots] extra)"
        progress(f"note: {missing}; report.md is written without plots")
        return missing
    return None


def _run_rounds(out: Path, frameworks: list[str], nproc: int, rounds: int, job: dict,
                progress: Callable[[str], None]) -> dict[str, list[dict]]:
    """{framework: its launches' results}: each round launches every framework once, in order; a
    framework that failed (or cannot run: DeepSpeed not installed) is not launched again."""
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    launches: dict[str, list[dict]] = {n: [] for n in frameworks}
    runnable = [n for n in frameworks if FRAMEWORKS[n].family != "deepspeed" or has_deepspeed]
    for n in set(frameworks) - set(runnable):
        launches[n].append({"error": NO_DEEPSPEED})
    total, k = len(runnable) * rounds, 0
    for round_ in range(rounds):
        for name in runnable:
            k += 1
            if any("error" in l for l in launches[name]):
                continue  # failed once: the same error again would only cost time
            log = str(out / "logs" / f"{name}-round{round_ + 1}-rank{{rank}}.log")
            started = time.monotonic()
            result = launch({**job, "framework": name, "memory": round_ == 0, "log": log}, nproc)
            launches[name].append(result)
            where = f"[{k}/{total}] round {round_ + 1}/{rounds}: {FRAMEWORKS[name].label}"
            progress(_progress_line(where, result, time.monotonic() - started))
    return launches


def _progress_line(where: str, result: dict, took: float) -> str:
    if "error" in result:
        return f"{where}: FAILED ({took:.0f} s): {result['error']}"
    step = statistics.median(t["total"] for t in result["times"])
    return f"{where}: {step:.4f} s/step ({took:.0f} s)"

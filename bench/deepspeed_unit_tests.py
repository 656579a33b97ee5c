"""DeepSpeed's own unit tests as a measure of zerodp's compatibility: run them on zerodp, count.

    python bench/deepspeed_unit_tests.py --deepspeed-src ~/src/DeepSpeed            # the default modules
    python bench/deepspeed_unit_tests.py --deepspeed-src DIR --modules unit/runtime/test_lr_schedulers.py
    python bench/deepspeed_unit_tests.py --deepspeed-src DIR --real-deepspeed --python VENV/bin/python  # reference

Fetches nothing: DIR is a DeepSpeed source tree (a clone; its `tests/` folder is what is used). Each
module runs in a pytest process of its own, one at a time, under `nice -n 10`, with a timeout, from
DIR/tests with DeepSpeed's own conftest.py, pytest.ini and harness (tests/unit/common.py) unmodified,
and with ZERODP_AS_DEEPSPEED=1 (so `import deepspeed` is zerodp) and DS_ACCELERATOR=cpu. Per module it
prints how many tests were collected, passed, failed, errored and skipped, and the first error of each
module that did not pass (a collection error counts as one error). `--json FILE` writes the rows.

The modules by default are the CPU-runnable ones about ZeRO stages, initialize, config, precision,
lr schedules, activation checkpointing and checkpoints.

DeepSpeed's harness skips a test that needs more ranks than its accelerator counts devices; on a CPU
that count is DeepSpeed's `LOCAL_SIZE` (else its NUMA nodes; zerodp's switch: LOCAL_SIZE, else 1), so
`LOCAL_SIZE=2 python bench/deepspeed_unit_tests.py ...` runs the 2-rank tests on both sides instead of
skipping them (each as 2 processes: slower).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

DEFAULT_MODULES = (
    "unit/runtime/test_ds_initialize.py", "unit/runtime/test_ds_config_dict.py", "unit/runtime/test_ds_config_model.py",
    "unit/runtime/test_lr_schedulers.py", "unit/runtime/test_runtime_utils.py", "unit/runtime/test_autocast.py",
    "unit/runtime/test_no_sync_ctxt.py", "unit/runtime/test_multiple_models.py",
    "unit/runtime/test_precision_config_dynamic_scale.py", "unit/runtime/test_precision_config_loss_scale.py",
    "unit/runtime/half_precision/test_fp16.py", "unit/runtime/half_precision/test_dynamic_loss_scale.py",
    "unit/runtime/half_precision/test_zero_optim_overflow.py",
    "unit/runtime/zero/test_zero_config.py", "unit/runtime/zero/test_zero_context.py",
    "unit/runtime/zero/test_zero_context_return.py", "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/runtime/zero/test_zero_leaf_module.py", "unit/runtime/zero/test_zero_tensor_fragment.py",
    "unit/runtime/zero/test_unwrap_model.py", "unit/runtime/zero/test_ignore_unused_parameters.py",
    "unit/runtime/activation_checkpointing/test_activation_checkpointing.py",
    "unit/runtime/activation_checkpointing/test_activation_checkpointing_non_reentrant.py",
    "unit/checkpoint/test_latest_checkpoint.py", "unit/checkpoint/test_tag_validation.py",
    "unit/checkpoint/test_zero_optimizer.py", "unit/checkpoint/test_lr_scheduler.py",
    "unit/checkpoint/test_other_optimizer.py", "unit/checkpoint/test_shared_weights.py",
)


@dataclass
class ModuleResult:
    """One module's counts (junit's, from DeepSpeed's pytest run) and its first error."""

    module: str
    collected: int = 0
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    first_error: str = ""
    timed_out: bool = False


def _first_line(text: str | None) -> str:
    """The line of a failure message that says what went wrong (the last `E   ` line, else the first)."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    raised = [line[1:].strip() for line in lines if line.startswith("E ") and "errors.pydantic.dev" not in line]
    line = raised[-1] if raised else lines[0] if lines else ""
    line = line.split(": with ZERODP_AS_DEEPSPEED=1")[0]  # the rest of zerodp's refusal is the same each time
    return line.replace("_zerodp_as_deepspeed.", "").replace(f"{REPO}{os.sep}", "")[:240]


def parse_junit(path: Path, module: str) -> ModuleResult:
    """The counts and the first error of one module from pytest's junit XML."""
    result = ModuleResult(module)
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    for case in suite.iter("testcase"):
        result.collected += 1
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            result.passed += 1
            continue
        if outcome.tag == "skipped":
            result.skipped += 1
            continue
        setattr(result, "failed" if outcome.tag == "failure" else "errors",
                getattr(result, "failed" if outcome.tag == "failure" else "errors") + 1)
        if not result.first_error:
            result.first_error = _first_line(outcome.text or outcome.get("message"))
    if suite.get("name") == "pytest" and result.collected == result.errors == 1 and not result.passed:
        result.collected = 0  # a collection error: junit reports it as one errored case
    return result


def _run_pytest(command: list[str], cwd: Path, env: dict[str, str], timeout_s: int) -> tuple[str, bool]:
    """Run pytest in a session of its own; at the timeout kill the whole session (DeepSpeed's harness
    starts worker pools that an interrupt can leave waiting). Returns (output, timed_out)."""
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            return proc.communicate(timeout=timeout_s)[0], False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.communicate()[0] or "", True


_VERBOSE_OUTCOME = re.compile(r"::\S.*? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def parse_verbose(output: str, module: str) -> ModuleResult:
    """The counts of the tests that finished, from pytest's -v lines (`path::test PASSED [ 3%]`): what
    is left of a module killed at its timeout, which writes no junit XML."""
    result = ModuleResult(module)
    for outcome in _VERBOSE_OUTCOME.findall(re.sub(r"\x1b\[[0-9;]*m", "", output)):
        result.collected += 1
        field = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors"}.get(outcome, "skipped")
        setattr(result, field, getattr(result, field) + 1)
    return result


def run_module(tests_dir: Path, module: str, timeout_s: int, python: str = sys.executable,
               on_zerodp: bool = True) -> ModuleResult:
    """One DeepSpeed test module in its own pytest process: on zerodp (the switch on), or with
    `on_zerodp=False` on the DeepSpeed that `python` imports (the reference column). A module that
    runs past `timeout_s` counts the tests that finished (collected: those that ran) and says so."""
    env = {**os.environ, "ZERODP_AS_DEEPSPEED": "1" if on_zerodp else "0", "DS_ACCELERATOR": "cpu"}
    if on_zerodp:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = ["nice", "-n", "10", python, "-m", "pytest", module, "-v", "--color=no", "-p", "no:cacheprovider",
                   f"--junitxml={junit}", "-o", "junit_family=xunit1"]
        start = time.monotonic()
        output, timed_out = _run_pytest(command, tests_dir, env, timeout_s)
        seconds = round(time.monotonic() - start, 1)
        if timed_out:
            result = parse_verbose(output, module)
            result.first_error = f"timed out after {timeout_s} s"
        elif not junit.exists():
            return ModuleResult(module, seconds=seconds, first_error=_first_line(output))
        else:
            result = parse_junit(junit, module)
    result.seconds, result.timed_out = seconds, timed_out
    return result


def source_revision(src: Path) -> str:
    """The DeepSpeed commit of `src` (git) and its version.txt."""
    version = (src / "version.txt").read_text().strip() if (src / "version.txt").exists() else "?"
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return f"DeepSpeed {version}" + (f" at {commit}" if commit else "")


def _installed_deepspeed(python: str) -> str:
    """The version of the DeepSpeed `python` imports (the tests' version.txt may differ from it)."""
    probe = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                           text=True, timeout=300, env={**os.environ, "ZERODP_AS_DEEPSPEED": "0", "DS_ACCELERATOR": "cpu"})
    return probe.stdout.strip().splitlines()[-1] if probe.returncode == 0 and probe.stdout.strip() else "?"


def render(rows: list[ModuleResult]) -> str:
    """The per-module table (Markdown) and the totals."""
    lines = ["| module | collected | passed | failed | errors | skipped | first error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        partial = f" (timed out after {r.seconds:.0f} s: the tests that ran)" if r.timed_out and r.collected else ""
        lines.append(f"| `{r.module}`{partial} | {r.collected} | {r.passed} | {r.failed} | {r.errors} | {r.skipped} | "
                     f"{r.first_error.replace('|', '/')} |")
    total = {k: sum(getattr(r, k) for r in rows) for k in ("collected", "passed", "failed", "errors", "skipped")}
    lines.append(f"| **{len(rows)} modules** | {total['collected']} | {total['passed']} | {total['failed']} | "
                 f"{total['errors']} | {total['skipped']} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-src", required=True, type=Path, help="a DeepSpeed source tree (its tests/)")
    parser.add_argument("--modules", nargs="+", default=list(DEFAULT_MODULES),
                        help="test modules relative to DIR/tests (default: the CPU-runnable set above)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per module (default 600)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--python", default=sys.executable, help="the interpreter pytest runs in (default: this one)")
    parser.add_argument("--real-deepspeed", action="store_true",
                        help="run on the DeepSpeed that --python imports instead of zerodp (the reference)")
    args = parser.parse_args(argv)
    tests_dir = args.deepspeed_src / "tests"
    if not (tests_dir / "unit" / "common.py").exists():
        parser.error(f"--deepspeed-src {args.deepspeed_src}: no tests/unit/common.py there; expected a DeepSpeed "
                     "source tree (git clone https://github.com/deepspeedai/DeepSpeed)")
    rows = []
    for module in args.modules:
        rows.append(run_module(tests_dir, module, args.timeout, args.python, not args.real_deepspeed))
        r = rows[-1]
        print(f"{module}: {r.collected} collected, {r.passed} passed, {r.failed} failed, {r.errors} errors, "
              f"{r.skipped} skipped ({r.seconds} s{', timed out' if r.timed_out else ''})"
              f"{'; ' + r.first_error if r.first_error else ''}", flush=True)
    runs_on = f"DeepSpeed {_installed_deepspeed(args.python)}" if args.real_deepspeed else f"zerodp at {REPO}"
    print(f"\nthe tests of {source_revision(args.deepspeed_src)}, run on {runs_on}\n")
    print(render(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

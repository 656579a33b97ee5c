"""The OOM doctor: when a step runs out of device memory, one report instead of an allocator error.

    ZERODP_DEVICE_MEMORY_LIMIT=2GB python train.py     # on any device, the CPU included
    zerodp doctor zerodp_oom/                           # read the saved reports again

The engine runs its forward, backward and optimizer step inside `Doctor.watching(phase)`. On CUDA
a `torch.OutOfMemoryError` there becomes `OutOfMemoryDiagnosed`; with $ZERODP_DEVICE_MEMORY_LIMIT
set on a CPU (a shared machine, or a test), a dispatch-level count of the live bytes on the training
device (the estimator's zerodp/plan/simulate.py `LiveBytes`, seeded with every tensor the ledger
holds) raises it at the op that crosses the limit. The report says the phase (and, under the limit,
the module running), the ledger by category at that moment, the bytes beyond model states
(activations and temporaries), the allocator's reserved-but-unallocated gap on CUDA, what dominates,
and the remedies in order with what each saves: model states from the estimator's arithmetic (exact,
zerodp/plan/model_states.py), activations as about half per halved micro-batch. It is written to
$ZERODP_DOCTOR_DIR (default ./zerodp_oom) as rank{R}.json and raised on the rank that ran out. When
every rank crosses the limit at the same op, each reports (tests/test_doctor.py); when only one does,
the others are left to zerodp's handling of a lost peer at their next collective (not tested here).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch

from zerodp import comm
from zerodp.memory import DEVICE
from zerodp.plan.model_states import StrategySpec, every_strategy
from zerodp.plan.preflight import LIMIT_ENV, device_bytes, limit_from_env, strategy_of
from zerodp.plan.simulate import LiveBytes, counting_resizes
from zerodp.sizes import decimal_size

DIR_ENV = "ZERODP_DOCTOR_DIR"


class DeviceLimitExceeded(RuntimeError):
    """The live bytes on the device crossed $ZERODP_DEVICE_MEMORY_LIMIT (raised inside the op)."""


class OutOfMemoryDiagnosed(RuntimeError):
    """A step ran out of device memory; `report` is the doctor's (plain data), str(self) its text."""

    def __init__(self, report: dict) -> None:
        super().__init__(format_report(report))
        self.report = report

    def __reduce__(self) -> tuple:
        return type(self), (self.report,)


class _LimitWatch(LiveBytes):
    """LiveBytes of a real run that raises DeviceLimitExceeded when the device's bytes pass `limit`."""

    def __init__(self, device_type: str, limit: int) -> None:
        super().__init__(device_type, answer_scalars=False)
        self.limit = limit
        self.armed = False  # only inside a phase (seeding it with what already exists raises nothing)

    def resized(self, storage: torch.UntypedStorage, before: int | None = None) -> None:
        super().resized(storage, before)
        if self.armed and self.live[DEVICE] > self.limit:
            raise DeviceLimitExceeded(f"{decimal_size(self.live[DEVICE])} live on the device, over the "
                                      f"{decimal_size(self.limit)} of ${LIMIT_ENV}")


class Doctor:
    """Watches one engine's phases; see the module docstring."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.limit = limit_from_env()
        self.watch: _LimitWatch | None = None
        if self.limit is not None and engine.device.type != "cuda" and not comm.simulated():  # CUDA: its allocator's
            self.watch = _LimitWatch(engine.device.type, self.limit)
            for tensors in engine.strategy.ledger().tensors.values():  # what exists before the watch starts
                for t in tensors:
                    self.watch.track(t)
            for t in [*engine.module.parameters(), *engine.module.buffers()]:
                self.watch.track(t)

    @contextmanager
    def watching(self, phase: str) -> Iterator[None]:
        """Run `phase` ("forward", "backward", "step"); out of memory inside becomes OutOfMemoryDiagnosed."""
        watch, tracker = self.watch, None
        try:
            if watch is None:  # CUDA, or no limit: only the allocator's own error to catch
                yield
            else:
                from torch.utils.module_tracker import ModuleTracker

                tracker = ModuleTracker() if phase == "forward" else None
                watch.phase, watch.armed = phase, True
                try:
                    with counting_resizes(watch), watch, tracker or nullcontext():
                        yield
                finally:
                    watch.armed = False
        except (torch.OutOfMemoryError, DeviceLimitExceeded) as err:
            live = watch.live[DEVICE] if watch is not None else None
            module = _innermost(tracker.parents) if tracker is not None else None
            report = self.report(phase, module, live, err)
            where = save_report(report)
            report["saved_to"] = str(where)
            raise OutOfMemoryDiagnosed(report) from None

    def report(self, phase: str, module: str | None, live: int | None, error: BaseException) -> dict:
        engine = self.engine
        memory = engine.memory_report()
        held = memory["held"]
        device_states = sum(b for c, tiers in held.items() for t, b in tiers.items() if t == DEVICE)
        if engine.device.type == "cuda":
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            live = allocated
        else:
            allocated = reserved = None
        beyond = max(0, (live or 0) - device_states)
        parts = {"parameters and gradients": _bytes_of(held, ("param16", "grad", "param_secondary", "param4bit",
                                                                   "quant_state")),
                 "optimizer state and fp32 masters": _bytes_of(held, ("optim_state", "param32_master")),
                 ("the step's temporaries" if phase == "step" else "activations and temporaries"): beyond}
        return {"rank": comm.get_rank(), "world_size": comm.get_world_size(), "phase": phase, "module": module,
                "error": str(error).splitlines()[0][:500], "limit_bytes": self.limit, "live_bytes": live,
                "held": held, "transient_peak": memory["transient_peak"], "model_states_device_bytes": device_states,
                "beyond_model_states_bytes": beyond, "cuda_allocated_bytes": allocated, "cuda_reserved_bytes": reserved,
                "dominant": max(parts, key=parts.get), "parts": parts,
                "remedies": self._remedies(phase, parts, beyond, memory, (reserved or 0) - (allocated or 0), reserved)}

    def _remedies(self, phase: str, parts: dict, beyond: int, memory: dict, gap: int, reserved: int | None) -> list[dict]:
        """In order: what dominates first; each with the bytes per rank it would save."""
        engine, config = self.engine, self.engine.config
        now = strategy_of(config)
        trainable = {p for p in engine.module.parameters() if p.requires_grad}
        states: list[dict] = []
        if trainable:
            current = device_bytes(config, engine.module, trainable, comm.get_world_size(), now)
            offload_helps = engine.device.type != "cpu"  # on a CPU the host memory is the device's
            for s in every_strategy(now.dtype):
                offloads = {s.offload_optimizer, s.offload_param} - {"none"}
                if s.stage >= now.stage and s != now and "nvme" not in offloads and (offload_helps or not offloads):
                    saved = current - device_bytes(config, engine.module, trainable, comm.get_world_size(), s)
                    if saved > 0:
                        states.append({"remedy": _config_change(now, s), "saves_bytes": saved, "exact": True})
            states.sort(key=lambda r: (-r["saves_bytes"], r["remedy"]))
            states = states[:3]
        activations = []
        if beyond and phase != "step":  # in the step: its temporaries, which offload_optimizer moves to the host
            micro = config.train_micro_batch_size_per_gpu
            if micro > 1:
                activations.append({"remedy": f"train_micro_batch_size_per_gpu {micro} -> {micro // 2} with "
                                              f"gradient_accumulation_steps x2 (the same global batch)",
                                    "saves_bytes": beyond // 2, "exact": False})
            activations.append({"remedy": "activation checkpointing: zerodp.checkpointing.apply(model, \"blocks\") "
                                          "or model.gradient_checkpointing_enable() (Hugging Face)",
                                "saves_bytes": beyond // 2, "exact": False})
            activations.append({"remedy": "shorter sequences (activations grow linearly with them)",
                                "saves_bytes": beyond // 2, "exact": False})
        transients = [{"remedy": f"a smaller {key} (its peak was {decimal_size(b)})", "saves_bytes": 0, "exact": False}
                      for name, b in memory["transient_peak"].items()
                      if (key := _TRANSIENT_KEYS.get(name)) and b > 0.05 * max(1, memory["model_states"])]
        fragmentation = []
        if reserved is not None and gap > 0.1 * max(1, reserved):  # CUDA: reserved but unallocated
            fragmentation.append({"remedy": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (reserved but "
                                            f"unallocated: {decimal_size(gap)})", "saves_bytes": gap, "exact": False})
        first = activations if beyond >= max(parts["parameters and gradients"],
                                             parts["optimizer state and fp32 masters"]) else states
        rest = states if first is activations else activations
        return first + rest + transients + fragmentation


_TRANSIENT_KEYS = {"reduce_bucket": "zero_optimization.reduce_bucket_size",  # the transients a config key bounds
                   "gathered_params": "zero_optimization.stage3_max_live_parameters / stage3_prefetch_bucket_size"}


def _config_change(now: StrategySpec, to: StrategySpec) -> str:
    parts = [] if to.stage == now.stage else [f"zero_optimization.stage {now.stage} -> {to.stage}"]
    for key, old, new in (("offload_optimizer", now.offload_optimizer, to.offload_optimizer),
                          ("offload_param", now.offload_param, to.offload_param)):
        if old != new:
            parts.append(f"zero_optimization.{key}.device {new}")
    return ", ".join(parts)


def _bytes_of(held: dict, categories: tuple[str, ...]) -> int:
    return sum(b for c in categories for t, b in held.get(c, {}).items() if t == DEVICE)


def _innermost(parents: set[str]) -> str | None:
    named = [p for p in parents if p != "Global"]
    return max(named, key=lambda name: name.count(".")) if named else None


def save_report(report: dict) -> Path:
    """Write `report` to $ZERODP_DOCTOR_DIR/rank{R}.json (default ./zerodp_oom); returns the path."""
    where = Path(os.environ.get(DIR_ENV, "zerodp_oom"))
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"rank{report['rank']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)
    return path


def load_reports(path: str) -> list[dict]:
    """The reports in `path` (a report file, or a directory of rank*.json); ValueError when none."""
    target = Path(path)
    files = sorted(target.glob("rank*.json")) if target.is_dir() else [target]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"{path}: no OOM doctor report there (rank*.json files written on out-of-memory to "
                         f"${DIR_ENV}, default ./zerodp_oom)")
    return [_read_report(f) for f in files]


class ReportDamaged(ValueError):
    """A file where a doctor report should be that is not one (bad data, not a bad argument)."""


_REPORT_FIELDS = {"rank": int, "world_size": int, "phase": str, "error": str, "held": dict,
                  "beyond_model_states_bytes": int, "dominant": str, "remedies": list}
"""What format_report reads of every report, with its type."""


def _read_report(file: Path) -> dict:
    """One report, its fields checked (ReportDamaged naming the file and the field otherwise)."""
    try:
        report = json.loads(file.read_bytes()[:1 << 24].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReportDamaged(f"{file}: not a doctor report ({type(err).__name__}: {err})") from None
    if not isinstance(report, dict):
        raise ReportDamaged(f"{file}: not a doctor report (a JSON {type(report).__name__}, not an object)")
    for field, kind in _REPORT_FIELDS.items():
        if not isinstance(report.get(field), kind) or isinstance(report.get(field), bool):
            raise ReportDamaged(f"{file}: not a doctor report ({field!r} should be a {kind.__name__}, "
                                f"found {report.get(field)!r:.60})")
    if not all(isinstance(tiers, dict) for tiers in report["held"].values()) or not all(
            isinstance(r, dict) and isinstance(r.get("remedy"), str) for r in report["remedies"]):
        raise ReportDamaged(f"{file}: not a doctor report ('held' or 'remedies' is not as the doctor writes them)")
    return report


def format_report(report: dict) -> str:
    """The report as the lines a user reads."""
    where = report["phase"] + (f" of {report['module']}" if report.get("module") else "")
    lines = [f"out of device memory on rank {report['rank']} of {report['world_size']} in the {where}: {report['error']}"]
    if report.get("live_bytes") is not None:
        limit = f" (limit {decimal_size(report['limit_bytes'])})" if report.get("limit_bytes") else ""
        lines.append(f"  live on the device: {decimal_size(report['live_bytes'])}{limit}")
    if report.get("cuda_reserved_bytes") is not None:
        gap = report["cuda_reserved_bytes"] - report["cuda_allocated_bytes"]
        lines.append(f"  allocator: {decimal_size(report['cuda_allocated_bytes'])} allocated, "
                     f"{decimal_size(report['cuda_reserved_bytes'])} reserved ({decimal_size(gap)} fragmentation)")
    lines.append("  held on the device:")
    for category, tiers in report["held"].items():
        if tiers.get(DEVICE):
            lines.append(f"    {category:<16} {decimal_size(tiers[DEVICE]):>10}")
    lines.append(f"    {'beyond them':<16} {decimal_size(report['beyond_model_states_bytes']):>10}  (activations saved "
                 "for backward, gathered units, buckets, temporaries)")
    lines.append(f"  dominant: {report['dominant']}")
    if report["remedies"]:
        lines.append("  remedies, in order (bytes per rank each saves; ~ estimated):")
        for r in report["remedies"]:
            saves = "" if not r["saves_bytes"] else f": saves {'' if r['exact'] else '~'}{decimal_size(r['saves_bytes'])}"
            lines.append(f"    - {r['remedy']}{saves}")
    if report.get("saved_to"):
        lines.append(f"  (this report: {report['saved_to']}; `zerodp doctor {Path(report['saved_to']).parent}` shows it again)")
    return "\n".join(lines)


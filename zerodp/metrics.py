"""Training metrics as data, and the one formatter that turns them into text.

A step's metrics are a plain dict; the engine, the demo and the benchmarks fill in what they know
and `format_step` renders it as one dense fixed-width line (wrapped here):

    step  12/200 | loss 3.1416 | grad_norm  1.23 | lr 3.0e-03 | loss_scale 65536
        | model states  12.3 MiB | tok/s  12,345 | TFLOPS  0.01

Keys (all optional; a missing or None value leaves its field out, unknown keys are ignored):

    step, total_steps   int     the optimizer step just finished, and how many the run will take
    loss                float   (a 0-d tensor is fine too)
    grad_norm           float   global gradient norm, after unscaling, before clipping
    lr                  float
    loss_scale          float   fp16 dynamic loss scale
    model_state_bytes   int     the memory ledger's model states (params, grads, masters, optimizer state)
    tokens_per_s        float   see Throughput
    tflops              float   achieved model TFLOPS, see Throughput and flops_per_token

Each value has a minimum width sized for its usual range, so consecutive lines align; a value out
of that range widens its field rather than being cut. `ProgressBar` draws the same fields for
anything a user waits on. Nothing here prints: text goes to the stream the caller passes.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TextIO

# format_count is not used here: both stay importable from zerodp.metrics, where users found them first
from zerodp.sizes import format_bytes, format_count  # noqa: F401

STEP_METRIC_KEYS = (
    "step",
    "total_steps",
    "loss",
    "grad_norm",
    "lr",
    "loss_scale",
    "model_state_bytes",
    "tokens_per_s",
    "tflops",
)
"""Every key `format_step` reads, in the order it renders them."""

_SEPARATOR = " | "


def _number(value: Any) -> float:
    # float() accepts Python numbers and 0-d tensors alike, so callers need not call .item().
    return float(value)


def _fixed(value: float, width: int, spec: str) -> str:
    if not math.isfinite(value):
        return f"{value!s:>{width}}"
    return f"{value:>{width}{spec}}"


def _loss_scale(value: float) -> str:
    text = str(int(value)) if math.isfinite(value) and value == int(value) else f"{value:g}"
    return f"{text:>5}"


def _metric_fields(m: Mapping[str, Any]) -> list[str]:
    """Every field of format_step except the step counter, in order."""
    renderers: list[tuple[str, Callable[[float], str]]] = [
        ("loss", lambda v: "loss " + _fixed(v, 6, ".4f")),
        ("grad_norm", lambda v: "grad_norm " + _fixed(v, 5, ".2f")),
        ("lr", lambda v: "lr " + _fixed(v, 7, ".1e")),
        ("loss_scale", lambda v: "loss_scale " + _loss_scale(v)),
        ("model_state_bytes", lambda v: f"model states {format_bytes(int(v)):>9}"),
        ("tokens_per_s", lambda v: "tok/s " + _fixed(round(v) if math.isfinite(v) else v, 7, ",")),
        ("tflops", lambda v: "TFLOPS " + _fixed(v, 5, ".2f")),
    ]
    return [render(_number(m[key])) for key, render in renderers if m.get(key) is not None]


def _step_field(step: int, total_steps: int | None) -> str:
    if total_steps is None:
        return f"step {step:>6}"
    return f"step {step:>{len(str(total_steps))}}/{total_steps}"


def format_step(m: Mapping[str, Any]) -> str:
    """Render one step's metrics dict as a single fixed-width line (see the module docstring).

    Args:
        m: metrics keyed by the names in STEP_METRIC_KEYS; missing or None values are omitted.

    Returns:
        e.g. "step  12/200 | loss 3.1416 | lr 3.0e-03", without a trailing newline.
    """
    fields = _metric_fields(m)
    if m.get("step") is not None:
        fields.insert(0, _step_field(int(m["step"]), m.get("total_steps")))
    return _SEPARATOR.join(fields)


TIMER_ORDER = ("fwd", "bwd", "step", "recompute")
"""wall_clock_breakdown's phases, in the order they are printed (others follow, sorted)."""


def format_times(seconds: Mapping[str, float]) -> str:
    """One line of per-phase wall-clock times in milliseconds, in TIMER_ORDER:
    "time (ms): fwd 12.3 | bwd 30.1 | step 5.0"."""
    names = [n for n in TIMER_ORDER if n in seconds] + sorted(n for n in seconds if n not in TIMER_ORDER)
    return "time (ms): " + _SEPARATOR.join(f"{n} {seconds[n] * 1e3:.1f}" for n in names)


def format_breakdown(report: Mapping[str, Any]) -> str:
    """One line of an engine.step_report(): "breakdown (ms): forward 12.3 | ... -> compute-bound (61%)"."""
    parts = ["forward", "backward", "communication_exposed", "communication_overlapped", "optimizer",
             "offload_transfers", "nvme_wait", "input"]
    fields = [f"{name} {report[name] * 1e3:.1f}" for name in parts if report[name] or name in ("forward", "backward")]
    overlap = "" if report["overlap_ratio"] is None else f", overlap {100 * report['overlap_ratio']:.0f}%"
    rate = "" if report.get("flops_per_s") is None else f", {report['flops_per_s'] / 1e9:.1f} GFLOP/s"
    mfu = "" if report.get("mfu") is None else f", MFU {100 * report['mfu']:.1f}%"
    clock = " [cuda events]" if report.get("clock") == "cuda-events" else ""
    return (f"breakdown (ms): {_SEPARATOR.join(fields)} of {report['seconds'] * 1e3:.1f} -> {report['verdict']} "
            f"({100 * report['share']:.0f}%{overlap}){rate}{mfu}{clock}")


def format_memory(report: Mapping[str, Any]) -> str:
    """One line of an engine.memory_report(): bytes per category and tier, the model-state total
    and the activations autograd saved at the peak of the last step."""
    fields = [f"{category} ({tier}) {format_bytes(b)}" for category, tiers in report["held"].items()
              for tier, b in tiers.items()]
    fields.append(f"model states {format_bytes(report['model_states'])}")
    fields += [f"activations ({tier}) {format_bytes(b)}" for tier, b in report.get("activations", {}).items()]
    return "memory: " + _SEPARATOR.join(fields)


def _format_duration(seconds: float) -> str:
    """"MM:SS" below an hour, "H:MM:SS" from an hour on."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class ProgressBar:
    """A dependency-free progress bar for a loop of `total` steps, written to `stream`.

    On a terminal (`stream.isatty()`), each `update` redraws one line in place with `\\r`:

        [#########---------------------]  60/200 00:03<00:07 | loss 1.2345 | tok/s  12,345

    Anywhere else (a log file, a pipe, CI), it writes a full line only every
    `max(1, total // 10)` steps and at the last step, so logs stay short and readable:

        step  60/200 | loss 1.2345 | tok/s  12,345 | elapsed 00:03 | eta 00:07

    `close()` ends the line; use the bar as a context manager to close it on errors too.

    Args:
        total: number of steps the loop will take (step numbers run 1..total).
        stream: where to write, e.g. sys.stderr; never print().
        width: characters of the drawn bar (default 30).
        clock: seconds as a float, for elapsed time and ETA (default time.monotonic).
    """

    def __init__(
        self,
        total: int,
        stream: TextIO,
        width: int = 30,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total < 1:
            raise ValueError(f"ProgressBar total={total} must be >= 1 (the number of steps)")
        if width < 1:
            raise ValueError(f"ProgressBar width={width} must be >= 1")
        self.total = total
        self.stream = stream
        self.width = width
        self.every = max(1, total // 10)
        self._clock = clock
        self._start = clock()
        isatty = getattr(stream, "isatty", None)
        self.is_tty = bool(isatty()) if callable(isatty) else False
        self._last_len = 0  # length of the line now on the terminal, to blank out leftovers
        self._pending: str | None = None  # latest non-TTY line not yet written
        self._closed = False

    def _times(self, step: int) -> tuple[str, str]:
        elapsed = max(0.0, self._clock() - self._start)  # a wall clock may step backwards
        if step <= 0:
            return _format_duration(elapsed), "--:--"
        remaining = elapsed / step * max(0, self.total - step)
        return _format_duration(elapsed), _format_duration(remaining)

    def _bar(self, step: int) -> str:
        filled = min(self.width, max(0, self.width * step // self.total))
        return "[" + "#" * filled + "-" * (self.width - filled) + "]"

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Show that `step` (1..total) has finished, with its metrics dict (see format_step)."""
        metrics = metrics or {}
        elapsed, eta = self._times(step)
        if self.is_tty:
            head = f"{self._bar(step)} {step:>{len(str(self.total))}}/{self.total} {elapsed}<{eta}"
            line = _SEPARATOR.join([head, *_metric_fields(metrics)])
            padding = " " * max(0, self._last_len - len(line))
            self.stream.write("\r" + line + padding)
            self.stream.flush()
            self._last_len = len(line)
            return
        fields = {**metrics, "step": step, "total_steps": self.total}
        self._pending = _SEPARATOR.join([format_step(fields), f"elapsed {elapsed}", f"eta {eta}"])
        if step % self.every == 0 or step >= self.total:
            self._write_pending()

    def _write_pending(self) -> None:
        if self._pending is not None:
            self.stream.write(self._pending + "\n")
            self.stream.flush()
            self._pending = None

    def close(self) -> None:
        """End the bar's line. A loop that stopped early still logs the step it stopped at."""
        if self._closed:
            return
        self._closed = True
        if self.is_tty:
            if self._last_len:
                self.stream.write("\n")
                self.stream.flush()
        else:
            self._write_pending()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def flops_per_token(num_params: int, n_layer: int, seq_len: int, d_model: int) -> int:
    """Training FLOPs per token of a decoder-only transformer: 6*N + 12*L*T*d.

    See [Note: FLOPs per token]. Use it for achieved TFLOPS and MFU; it counts model FLOPs only,
    so activation recomputation (which adds about one more forward, 2*N) makes the hardware do
    more work than this reports.

    Args:
        num_params: N, parameters taking part in matmuls: nanoGPT passes the count without the
            position embedding (TinyGPT.num_parameters(non_embedding=True)).
        n_layer: L, transformer blocks.
        seq_len: T, tokens per sequence (the attention span).
        d_model: d, width of the residual stream (heads * head_dim).
    """
    # [Note: FLOPs per token]
    # The estimate of the PaLM paper (appendix B) that nanoGPT's estimate_mfu uses. Every weight
    # does one multiply-add (2 FLOPs) per token in the forward pass, and the backward pass costs
    # twice the forward (gradients for the inputs and for the weights): 2N + 4N = 6N. Attention
    # adds matmuls without weights: per layer and token, q.k^T over T keys and the weighted sum
    # of T values are 2*T*d FLOPs each, 4*T*d forward, 12*T*d with backward, so 12*L*T*d in all.
    # Causal masking skips half of that work in practice; by convention it is counted in full.
    for name, value in (("num_params", num_params), ("n_layer", n_layer),
                        ("seq_len", seq_len), ("d_model", d_model)):
        if value < 0:
            raise ValueError(f"flops_per_token: {name}={value} must be >= 0")
    return 6 * num_params + 12 * n_layer * seq_len * d_model


class Throughput:
    """Tokens per second and achieved TFLOPS from per-step wall times.

    Averages over the last `window` steps (total tokens / total time), so one slow step (a
    checkpoint save, the first step's warm-up) does not dominate the line. Pass this rank's
    tokens per step for per-rank numbers, or the global batch's tokens for the whole job.

        throughput = Throughput(tokens_per_step=micro_batch * seq_len * accum_steps,
                                flops_per_token=flops_per_token(n, layers, seq_len, d_model))
        metrics.update(throughput.update(step_time_s))   # {"tokens_per_s": ..., "tflops": ...}

    Args:
        tokens_per_step: tokens processed per optimizer step.
        flops_per_token: training FLOPs per token (see flops_per_token); None leaves TFLOPS out.
        window: steps averaged over (default 10).
    """

    def __init__(
        self, tokens_per_step: int, flops_per_token: float | None = None, window: int = 10
    ) -> None:
        if tokens_per_step < 1:
            raise ValueError(f"Throughput tokens_per_step={tokens_per_step} must be >= 1")
        if window < 1:
            raise ValueError(f"Throughput window={window} must be >= 1")
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self._step_times: deque[float] = deque(maxlen=window)

    def update(self, step_time_s: float) -> dict[str, float | None]:
        """Record one step's wall time in seconds; returns metrics() for the step line."""
        if not step_time_s > 0:
            raise ValueError(f"Throughput step_time_s={step_time_s} must be > 0 seconds")
        self._step_times.append(step_time_s)
        return self.metrics()

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second over the window, None before the first update."""
        if not self._step_times:
            return None
        return self.tokens_per_step * len(self._step_times) / sum(self._step_times)

    @property
    def tflops(self) -> float | None:
        """Achieved model TFLOPS (1e12 FLOP/s), None without flops_per_token or an update."""
        tokens_per_s = self.tokens_per_s
        if tokens_per_s is None or self.flops_per_token is None:
            return None
        return tokens_per_s * self.flops_per_token / 1e12

    def metrics(self) -> dict[str, float | None]:
        """{"tokens_per_s": ..., "tflops": ...}, ready to merge into a step's metrics dict."""
        return {"tokens_per_s": self.tokens_per_s, "tflops": self.tflops}

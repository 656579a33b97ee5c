"""Precision: the dtype policy, DeepSpeed's dynamic/static loss scalers and the overflow check.

    policy = DtypePolicy.from_config(cfg)      # which dtype params, grads, master, reduction use
    scaler = make_loss_scaler(cfg.fp16)        # DynamicLossScaler | StaticLossScaler
    loss = scaler.scale_loss(loss)             # before backward
    found_inf = has_inf_or_nan(owned_grads)    # device tensor, all-reduced by the engine
    scaler.update(bool(found_inf))             # once per optimizer step, on every rank

docs/precision.md explains the rules with a worked example.

[Note: loss scaler state machine]
DeepSpeed's `DynamicLossScaler.update_scale` (runtime/fp16/loss_scaler.py), reproduced exactly:
- overflow, and hysteresis is 1 or the hysteresis counter is down to 1: the scale becomes
  max(scale / factor, min_scale); at min_scale already it raises instead.
- overflow otherwise: the counter drops by one and the scale is kept (the overflow is "absorbed").
- every overflow records `last_overflow_iter = cur_iter`.
- good step: with consecutive_hysteresis the counter is refilled; stable = cur_iter -
  last_overflow_iter - 1, and if stable > 0 and stable % window == 0 the scale grows by the factor
  (and without consecutive_hysteresis the counter is refilled only then).
- `cur_iter` increments on every update. With last_overflow_iter starting at -1, the first growth
  is on the (window+1)-th good step after an overflow (or after the start), then every window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zerodp.log import warn_once

# DeepSpeed's fp16 defaults (runtime/precision_config.py).
_FP16_DEFAULTS = {"enabled": False, "loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 1000,
                  "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1.0}


class LossScaleAtMinimumError(RuntimeError):
    """fp16 gradients overflow even at the minimum loss scale: training cannot continue."""


def _is_positive_finite(value: Any) -> bool:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return is_number and math.isfinite(value) and value > 0


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class StaticLossScaler:
    """A fixed loss scale (`fp16.loss_scale > 0`, or 1.0 for bf16/fp32). `update` does nothing.

    Args:
        scale: the factor the loss is multiplied by before backward. Default 1.0.
    """

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not _is_positive_finite(scale):
            raise ValueError(f"fp16.loss_scale = {scale!r}: expected a finite number > 0 for a static "
                             "scale. Fix: set fp16.loss_scale to e.g. 128, or to 0 for dynamic scaling")
        self.loss_scale = float(scale)

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's name for `loss_scale`."""
        return self.loss_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current scale (call backward on this)."""
        return loss * self.loss_scale

    def update(self, overflow: bool) -> None:
        """No-op: a static scale never changes (an overflowing step is still skipped)."""

    def state_dict(self) -> dict:
        """Plain JSON-able data."""
        return {"type": "static", "loss_scale": self.loss_scale}

    def load_state_dict(self, state_dict: dict) -> None:
        """Nothing to restore: the static scale comes from the config."""
        if state_dict.get("type") == "dynamic":
            warn_once(f"the checkpoint used dynamic loss scaling; resuming with the static scale "
                      f"{self.loss_scale} from fp16.loss_scale")


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler (see [Note: loss scaler state machine]).

    Args:
        init_scale: starting scale, 2**fp16.initial_scale_power. Default 2**16.
        scale_factor: divide by it on overflow, multiply by it after a stable window. Default 2.0.
        scale_window: good steps between growths (fp16.loss_scale_window). Default 1000.
        min_scale: the floor (fp16.min_loss_scale). Default 1.0.
        delayed_shift: overflows absorbed before the scale drops (fp16.hysteresis). Default 2.
        consecutive_hysteresis: refill the hysteresis on every good step. Default False.
        raise_error_at_min_scale: raise LossScaleAtMinimumError on an overflow at min_scale
            (else stay at min_scale). Default True.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        _check_dynamic_args(init_scale, scale_factor, scale_window, min_scale, delayed_shift)
        self.loss_scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.delayed_shift = delayed_shift
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_iter = 0  # updates so far (good and overflowed steps)
        self.last_overflow_iter = -1  # cur_iter of the latest overflow; -1 = none yet
        self.cur_hysteresis = delayed_shift  # overflows left to absorb before the scale drops

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's name for `loss_scale`."""
        return self.loss_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current scale (call backward on this)."""
        return loss * self.loss_scale

    def update(self, overflow: bool) -> None:
        """Advance the state machine by one optimizer step; `overflow` must agree on every rank.

        Raises LossScaleAtMinimumError on an overflow at min_scale (with raise_error_at_min_scale).
        """
        if overflow:
            self._on_overflow()
        else:
            self._on_good_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.loss_scale <= self.min_scale and self.raise_error_at_min_scale:
                raise LossScaleAtMinimumError(self._at_minimum_message())
            self.loss_scale = max(self.loss_scale / self.scale_factor, self.min_scale)
        else:
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter

    def _on_good_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.delayed_shift
        stable_steps = self.cur_iter - self.last_overflow_iter - 1
        if stable_steps > 0 and stable_steps % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            self.loss_scale *= self.scale_factor

    def _at_minimum_message(self) -> str:
        return (f"fp16 loss scale is at its minimum ({self.loss_scale:g} = fp16.min_loss_scale) and the "
                "gradients still overflow (inf/nan): the overflow is persistent, so training cannot "
                "continue. Fix: train in bf16 (\"bf16\": {\"enabled\": true}), which needs no loss "
                "scaling; or set a lower fp16.min_loss_scale (e.g. 0.0001) so the scale can keep "
                "dropping; fp16.initial_scale_power only sets where the scale starts (2**power). If the "
                "loss itself is inf/nan, no scale helps: lower the learning rate or check the data.")

    def state_dict(self) -> dict:
        """Plain JSON-able data: the running state and the settings it ran with."""
        return {"type": "dynamic", "loss_scale": self.loss_scale, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter, "cur_hysteresis": self.cur_hysteresis,
                "scale_factor": self.scale_factor, "scale_window": self.scale_window,
                "min_scale": self.min_scale, "delayed_shift": self.delayed_shift,
                "consecutive_hysteresis": self.consecutive_hysteresis,
                "raise_error_at_min_scale": self.raise_error_at_min_scale}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume the running state (scale, counters, hysteresis). The settings (window, factor,
        min scale, hysteresis) stay those of the current config, clamping the state into them."""
        if state_dict.get("type") != "dynamic":
            warn_once("the checkpoint used a static loss scale; dynamic loss scaling starts afresh at "
                      f"{self.loss_scale:g}")
            return
        missing = {"loss_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"} - set(state_dict)
        if missing:
            raise ValueError(f"loss scaler state_dict lacks {sorted(missing)}: it was not written by "
                             "DynamicLossScaler.state_dict()")
        self.loss_scale = max(float(state_dict["loss_scale"]), self.min_scale)
        self.cur_iter = int(state_dict["cur_iter"])
        self.last_overflow_iter = int(state_dict["last_overflow_iter"])
        self.cur_hysteresis = min(max(int(state_dict["cur_hysteresis"]), 1), self.delayed_shift)


def _check_dynamic_args(
    init_scale: Any, scale_factor: Any, scale_window: Any, min_scale: Any, delayed_shift: Any
) -> None:
    """Collect every bad dynamic-scaler setting and raise once, naming the fp16 config key."""
    problems = []
    if not _is_positive_finite(init_scale):
        problems.append(f"init_scale (2**fp16.initial_scale_power) = {init_scale!r}: expected a finite "
                        "number > 0. Fix: set fp16.initial_scale_power to e.g. 16")
    if not (_is_positive_finite(scale_factor) and scale_factor > 1):
        problems.append(f"scale_factor = {scale_factor!r}: expected a number > 1. Fix: use 2.0")
    if not _is_positive_int(scale_window):
        problems.append(f"scale_window (fp16.loss_scale_window) = {scale_window!r}: expected an integer "
                        "> 0. Fix: set fp16.loss_scale_window to e.g. 1000")
    if not _is_positive_finite(min_scale):
        problems.append(f"min_scale (fp16.min_loss_scale) = {min_scale!r}: expected a finite number > 0. "
                        "Fix: set fp16.min_loss_scale to e.g. 1")
    elif _is_positive_finite(init_scale) and init_scale < min_scale:
        problems.append(f"init_scale (2**fp16.initial_scale_power) = {init_scale!r} is below min_scale "
                        f"(fp16.min_loss_scale) = {min_scale!r}. Fix: raise fp16.initial_scale_power or "
                        "lower fp16.min_loss_scale")
    if not _is_positive_int(delayed_shift):
        problems.append(f"delayed_shift (fp16.hysteresis) = {delayed_shift!r}: expected an integer > 0. "
                        "Fix: set fp16.hysteresis to e.g. 2")
    if problems:
        raise ValueError("invalid dynamic loss scaling settings:\n  " + "\n  ".join(problems))


def _field(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, _FP16_DEFAULTS[key])
    return getattr(config, key, _FP16_DEFAULTS[key])


def make_loss_scaler(fp16_config: Any) -> DynamicLossScaler | StaticLossScaler:
    """The loss scaler an `fp16` config section asks for (attributes or dict keys, DeepSpeed's names).

    Not enabled -> StaticLossScaler(1.0); loss_scale > 0 -> StaticLossScaler(loss_scale); else a
    DynamicLossScaler starting at 2**initial_scale_power with loss_scale_window, hysteresis,
    consecutive_hysteresis and min_loss_scale. Missing keys take DeepSpeed's defaults.
    """
    if fp16_config is None or not _field(fp16_config, "enabled"):
        return StaticLossScaler(1.0)
    loss_scale = _field(fp16_config, "loss_scale")
    if loss_scale is not None and loss_scale > 0:
        return StaticLossScaler(float(loss_scale))
    return DynamicLossScaler(
        init_scale=2.0 ** _field(fp16_config, "initial_scale_power"),
        scale_window=_field(fp16_config, "loss_scale_window"),
        min_scale=_field(fp16_config, "min_loss_scale"),
        delayed_shift=_field(fp16_config, "hysteresis"),
        consecutive_hysteresis=_field(fp16_config, "consecutive_hysteresis"),
    )


def overflow_message(step: int, attempted_scale: float, scaler: Any, first_bad_name: str | None) -> str:
    """The log line for a skipped step: the scale before and after `update(True)`, the hysteresis
    left, and the first parameter on this rank whose gradient holds inf/nan."""
    where = f"first inf/nan gradient on this rank: {first_bad_name}" if first_bad_name else (
        "inf/nan found on another rank")
    if not scaler.dynamic:
        change = f"static loss scale {attempted_scale:g}"
    elif scaler.loss_scale < attempted_scale:
        change = f"loss scale {attempted_scale:g} -> {scaler.loss_scale:g}"
    else:
        change = f"loss scale kept at {attempted_scale:g} (hysteresis left: {scaler.cur_hysteresis})"
    return f"OVERFLOW at step {step}: step skipped on every rank; {change}; {where}"


# ---------------------------------------------------------------------------------------------
# dtype policy
# ---------------------------------------------------------------------------------------------

_PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# DeepSpeed's DtypeEnum spellings for data_types.grad_accum_dtype.
_DTYPE_ALIASES = {
    torch.float32: ("fp32", "float32", "float", "torch.float32"),
    torch.float16: ("fp16", "float16", "half", "torch.float16"),
    torch.bfloat16: ("bf16", "bfloat16", "bfloat", "torch.bfloat16"),
}
_SHORT_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Gradient accumulation dtypes allowed per param dtype: the param dtype itself or fp32.
_ALLOWED_ACCUM = {
    torch.float32: (torch.float32,),
    torch.bfloat16: (torch.bfloat16, torch.float32),
    torch.float16: (torch.float16, torch.float32),
}


def _parse_dtype(value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    for dtype, names in _DTYPE_ALIASES.items():
        if str(value).lower() in names:
            return dtype
    raise ValueError(f"data_types.grad_accum_dtype = {value!r}: expected null, \"fp32\", \"fp16\" or "
                     "\"bf16\". Fix: set it to \"fp32\" to accumulate gradients in fp32, or remove it")


@dataclass(frozen=True)
class DtypePolicy:
    """Which dtype each training tensor uses.

    param_dtype: working precision of params and their grads (float32, bfloat16 or float16).
    grad_accum_dtype: dtype gradients are accumulated in across micro-batches.
    master_dtype: the weights the optimizer updates: float32, or bfloat16 with
        `bf16.bf16_master_weights_and_grads` (the bf16 shard is then its own master).
    optim_state_dtype: the optimizer's element-wise state: float32, or bfloat16 with
        `bf16.bf16_optimizer_states` (see [Note: bf16 master weights]).
    reduce_dtype: dtype gradients are communicated in; None (default) = grad_accum_dtype.
    """

    param_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    master_dtype: torch.dtype = torch.float32
    optim_state_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        allowed = _ALLOWED_ACCUM.get(self.param_dtype)
        if allowed is None:
            raise ValueError(f"param dtype {self.param_dtype} is not supported: use float32, bfloat16 or "
                             "float16 (precision fp32, bf16 or fp16)")
        if self.grad_accum_dtype not in allowed:
            param = _SHORT_NAMES[self.param_dtype]
            accum = _SHORT_NAMES.get(self.grad_accum_dtype, str(self.grad_accum_dtype))
            choices = " or ".join(f'"{_SHORT_NAMES[d]}"' for d in allowed)
            raise ValueError(f"data_types.grad_accum_dtype = \"{accum}\" is not supported with {param} "
                             f"training: gradients of {param} params are accumulated in {choices}. "
                             f"Fix: set data_types.grad_accum_dtype to {choices}, or null (= {param})")
        if self.master_dtype not in (torch.float32, self.param_dtype) or self.optim_state_dtype not in (
                torch.float32, self.master_dtype):
            raise AssertionError(f"dtype policy: master {self.master_dtype}, optimizer state "
                                 f"{self.optim_state_dtype} with params in {self.param_dtype}")
        if self.reduce_dtype is None:
            object.__setattr__(self, "reduce_dtype", self.grad_accum_dtype)

    @property
    def needs_master_copy(self) -> bool:
        """True when the optimizer's weights are not the working params' dtype (16-bit training)."""
        return self.param_dtype != self.master_dtype

    @property
    def step_dtype(self) -> torch.dtype:
        """The dtype the optimizer steps in: that of its state (fp32 state over bf16 masters steps
        on an fp32 copy, see [Note: bf16 master weights])."""
        return self.optim_state_dtype

    @classmethod
    def from_config(cls, cfg: Any) -> DtypePolicy:
        """From `cfg.precision` ("fp32", "bf16", "fp16"), `cfg.data_types.grad_accum_dtype` (None =
        the param dtype, as in DeepSpeed; or "fp32", "fp16", "bf16") and the bf16 section's
        bf16_master_weights_and_grads / bf16_optimizer_states."""
        precision = getattr(cfg, "precision", None)
        if precision not in _PRECISION_DTYPES:
            raise ValueError(f"precision = {precision!r}: expected \"fp32\", \"bf16\" or \"fp16\" "
                             "(set bf16.enabled or fp16.enabled in the config)")
        param_dtype = _PRECISION_DTYPES[precision]
        data_types = getattr(cfg, "data_types", None)
        accum = _parse_dtype(getattr(data_types, "grad_accum_dtype", None))
        bf16 = getattr(cfg, "bf16", None)
        master = torch.bfloat16 if precision == "bf16" and getattr(bf16, "bf16_master_weights_and_grads", False) \
            else torch.float32
        state = torch.bfloat16 if master == torch.bfloat16 and getattr(bf16, "bf16_optimizer_states", False) \
            else torch.float32
        return cls(param_dtype=param_dtype, grad_accum_dtype=accum or param_dtype, master_dtype=master,
                   optim_state_dtype=state)


# [Note: bf16 master weights]
# `bf16.bf16_master_weights_and_grads` (DeepSpeed's low-precision master option) keeps the weights
# the optimizer updates in bf16: the owned bf16 shard is its own master (under CPU/NVMe offload, a
# bf16 copy in host memory), which saves the 4 bytes of an fp32 master per owned element.
# `bf16_optimizer_states` also keeps Adam's moments in bf16 (4 of 8 bytes saved): the optimizer
# then steps directly on the bf16 master with bf16 gradients. Without it the moments stay fp32:
# torch's optimizers keep state in their parameter's dtype, so for the step each master is given
# an fp32 copy (a transient, one step's worth) which is rounded back to bf16 afterwards
# (`stepping_in` in zero/base.py). The cost is accuracy: an update smaller than half a bf16 ulp
# of its weight (8 bits of mantissa) is lost; docs/precision.md shows it on the demo task.


# ---------------------------------------------------------------------------------------------
# Overflow check
# ---------------------------------------------------------------------------------------------


def _max_abs_fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """max|x| per tensor in float32, as one fused kernel per device/dtype (inf and nan propagate)."""
    try:
        return list(torch._foreach_norm(tensors, float("inf"), dtype=torch.float32))
    except TypeError:  # torch without the dtype argument
        return [norm.float() for norm in torch._foreach_norm(tensors, float("inf"))]


def has_inf_or_nan(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """A 0-dim bool tensor, True if any tensor holds inf or nan (on the first accelerator device
    among the tensors, else on the CPU).

    One fused reduction over the list and no host sync, so the caller can all-reduce the result
    (MAX) across ranks before reading it. None and empty tensors are ignored.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor is not None and tensor.numel() > 0:
            by_device.setdefault(tensor.device, []).append(tensor.detach())
    if not by_device:
        return torch.zeros((), dtype=torch.bool)
    # Answer on an accelerator when there is one: a host->device copy of a CPU result cannot be read
    # early, a non-blocking device->host copy could.
    devices = list(by_device)
    result_device = next((d for d in devices if d.type != "cpu"), devices[0])
    found = torch.zeros((), dtype=torch.bool, device=result_device)
    for group in by_device.values():
        device_found = ~torch.isfinite(torch.stack(_max_abs_fp32(group))).all()
        found = found | device_found.to(result_device, non_blocking=True)
    return found


def first_nonfinite(
    named_tensors: Iterable[tuple[str, torch.Tensor | None]] | Mapping[str, Any],
) -> str | None:
    """The name of the first tensor holding inf or nan, or None. Syncs per tensor: call it only
    after `has_inf_or_nan` found an overflow, for the log line."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    for name, tensor in items:
        if tensor is not None and tensor.numel() > 0 and not bool(torch.isfinite(tensor).all()):
            return name
    return None

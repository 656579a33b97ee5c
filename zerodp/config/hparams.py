"""Types and ranges of `optimizer.params` and `scheduler.params`: the values zerodp passes to the
optimizer and LR scheduler it builds from a config, checked when the config is loaded (so by
`zerodp config check` and by `initialize`, before any process group), not when torch first uses
them ("lr": "0.001" was a TypeError inside torch; "lr": true trained with lr 1.0; Infinity gave NaN
parameters after two steps).

    optimizer_problems("AdamW", {"lr": "0.001"})
    # ['optimizer.params.lr: got "0.001"; expected a finite number >= 0']

[Note: where the rules come from]
A parameter's type comes from the signature of the class that will be built (torch annotates
every optimizer and scheduler argument: `lr: float | Tensor`, `betas: tuple[float, float]`,
`T_max: int`), so any torch.optim or torch.optim.lr_scheduler class a config names is checked, not
only the common ones. Ranges are torch's own (Adam refuses lr < 0, eps < 0, betas outside [0, 1),
weight_decay < 0) plus finiteness, which torch does not check. Then the class is built once on a
1-element CPU tensor, so whatever torch refuses itself (nesterov without momentum) is found here
too, in its words. DeepSpeed's five schedulers are zerodp's own (zerodp.lr_schedules, a layer above
this one): their parameters and value checks live in zerodp.config.schedulers, which their classes
call at construction, so a value they refuse (warmup_min_lr above warmup_max_lr) is refused here in
the same words.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from typing import Any

from zerodp.config.rules import did_you_mean, hint, show_value
from zerodp.config.schedulers import (
    DEEPSPEED_SCHEDULER_NAMES,
    DEEPSPEED_SCHEDULER_PARAMS,
    REQUIRED,
    check_deepspeed_scheduler,
)

DEEPSPEED_ADAM_KEYS = ("adam_w_mode", "torch_adam", "bias_correction")
"""DeepSpeed's own Adam/AdamW keys: checked here, never passed to torch."""

# ---------------------------------------------------------------------------------------------
# Value specs (pure: a value in, a problem or None out)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """What one parameter accepts: `kind` is number, integer, bool, str, tuple, list, none or any."""

    kind: str
    low: float | None = None
    high: float | None = None
    high_open: bool = False
    items: tuple[Spec, ...] = ()  # tuple: one spec per position; list: items[0] for every element
    options: tuple[Spec, ...] = ()  # set on an `either` spec

    def accepts(self, value: Any) -> bool:
        if self.options:
            return any(option.accepts(value) for option in self.options)
        if self.kind in ("number", "integer"):
            return _is_number(value, self.kind == "integer") and self._in_range(value)
        if self.kind in ("tuple", "list"):
            return isinstance(value, list) and (
                len(value) == len(self.items) and all(s.accepts(v) for s, v in zip(self.items, value))
                if self.kind == "tuple" else all(self.items[0].accepts(v) for v in value))
        return {"bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
                "none": lambda v: v is None, "any": _finite_everywhere}[self.kind](value)

    def _in_range(self, value: float) -> bool:
        return ((self.low is None or value >= self.low)
                and (self.high is None or (value < self.high if self.high_open else value <= self.high)))

    def describe(self) -> str:
        if self.options:
            return " or ".join(dict.fromkeys(option.describe() for option in self.options))
        if self.kind in ("number", "integer"):
            noun = "a finite number" if self.kind == "number" else "an integer"
            if self.low is not None and self.high is not None:
                return f"{noun} in [{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"
            bound = f" >= {_num(self.low)}" if self.low is not None else (
                f" <= {_num(self.high)}" if self.high is not None else "")
            return noun + bound
        if self.kind == "tuple":
            return f"a list of {len(self.items)} ({', '.join(s.describe() for s in self.items)})"
        if self.kind == "list":
            return f"a list of {self.items[0].describe()}"
        return {"bool": "true or false", "str": "a string", "none": "null", "any": "a JSON value"}[self.kind]


def either(*options: Spec) -> Spec:
    return Spec("either", options=options)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _is_number(value: Any, integer: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) if integer else math.isfinite(value)


def _as_number(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None


def _finite_everywhere(value: Any) -> bool:
    """A value of a parameter zerodp knows no type for: any JSON, but no Infinity or NaN in it."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite_everywhere(v) for v in value)
    if isinstance(value, dict):
        return all(_finite_everywhere(v) for v in value.values())
    return True


# ---------------------------------------------------------------------------------------------
# Specs from signatures (see [Note: where the rules come from])
# ---------------------------------------------------------------------------------------------

_ATOMS = {"float": Spec("number"), "int": Spec("integer"), "bool": Spec("bool"), "str": Spec("str"),
          "None": Spec("none")}

# torch's ranges by argument name (every optimizer that takes the name checks it the same way).
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "lr_decay", "initial_accumulator_value", "alpha",
                 "momentum_decay", "lambd", "max_iter", "history_size", "T_max", "T_0", "step_size",
                 "total_iters", "total_steps", "epochs", "steps_per_epoch", "patience", "cooldown", "min_lr",
                 "eta_min", "threshold")
_UNIT_INTERVAL = {"betas": (0.0, 1.0, True), "rho": (0.0, 1.0, False), "pct_start": (0.0, 1.0, False),
                  "gamma": (0.0, None, False), "factor": (0.0, 1.0, True)}


def spec_from_annotation(annotation: Any, default: Any = inspect.Parameter.empty) -> Spec:
    """A Spec from a signature's annotation (a type or its text); from the default's type when the
    annotation is missing. Tensor alternatives are dropped (JSON cannot give a tensor)."""
    text = _annotation_text(annotation)
    if not text:
        if default is inspect.Parameter.empty or default is None:
            return Spec("any")
        text = type(default).__name__ if not isinstance(default, tuple) else \
            f"tuple[{', '.join(type(d).__name__ for d in default)}]"
    return _parse(text)


def _annotation_text(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    text = annotation if isinstance(annotation, str) else (
        annotation.__name__ if isinstance(annotation, type) else str(annotation))
    text = re.sub(r"\b(typing|torch|collections\.abc)\.", "", text)
    return re.sub(r"Optional\[(.*)\]$", r"\1 | None", text)


def _parse(text: str) -> Spec:
    options = [_parse_one(part.strip()) for part in _split(text, "|")]
    options = [o for o in options if o is not None]
    if not options:
        return Spec("any")
    return options[0] if len(options) == 1 else either(*options)


def _parse_one(text: str) -> Spec | None:
    if text == "Tensor":
        return None
    match = re.fullmatch(r"(tuple|list|Sequence)\[(.*)\]", text)
    if match:
        inner = [_parse(part.strip()) for part in _split(match.group(2), ",")]
        if match.group(1) == "tuple" and not text.endswith("...]"):
            return Spec("tuple", items=tuple(inner))
        return Spec("list", items=(inner[0],))
    return _ATOMS.get(text, Spec("any"))


def _split(text: str, sep: str) -> list[str]:
    """Split at `sep` outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if char == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def with_range(name: str, spec: Spec) -> Spec:
    """`spec` narrowed to torch's range for an argument called `name`."""
    if spec.options:
        return either(*(with_range(name, option) for option in spec.options))
    if spec.kind in ("tuple", "list"):
        return Spec(spec.kind, items=tuple(with_range(name, s) for s in spec.items))
    if spec.kind not in ("number", "integer"):
        return spec
    if name in _NON_NEGATIVE:
        return Spec(spec.kind, low=0.0)
    if name in _UNIT_INTERVAL:
        low, high, high_open = _UNIT_INTERVAL[name]
        return Spec(spec.kind, low=low, high=high, high_open=high_open)
    return spec


def signature_specs(cls: type, skip: tuple[str, ...]) -> dict[str, tuple[Spec, bool]]:
    """{argument: (spec, required)} for the keyword arguments of `cls` (except `skip`)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    out = {}
    for name, p in inspect.signature(cls).parameters.items():
        if name not in skip and p.kind in kinds:
            out[name] = (with_range(name, spec_from_annotation(p.annotation, p.default)),
                         p.default is inspect.Parameter.empty)
    return out


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


def params_problems(path: str, owner: str, specs: dict[str, tuple[Spec, bool]], params: dict[str, Any],
                    extra: dict[str, Spec] | None = None, open_ended: bool = False) -> list[str]:
    """Unknown keys (with did-you-mean), missing required ones, and values of the wrong type or
    range, each as "path.key: got VALUE; expected ...". `extra`: keys zerodp reads itself."""
    extra = extra or {}
    problems = []
    for key, value in params.items():
        spec = extra.get(key) or (specs[key][0] if key in specs else None)
        if spec is None:
            if not open_ended:
                match = did_you_mean(key, [*specs, *extra])
                problems.append(f"{path}.{key}: not a parameter of {owner}"
                                + (f"; did you mean '{match}'?" if match else ""))
        elif not spec.accepts(value):
            unquote = " (a JSON number: write it without quotes)" if isinstance(value, str) and spec.accepts(
                _as_number(value)) else ""
            problems.append(f"{path}.{key}: got {show_value(value)}; expected {spec.describe()}{unquote}")
    problems += [f"{path}.{name}: missing; {owner} requires it"
                 for name, (_, required) in specs.items() if required and name not in params]
    return problems


def torch_optimizer_classes() -> dict[str, type]:
    """Every torch.optim optimizer class by lower-case name."""
    import torch.optim

    return {name.lower(): obj for name, obj in vars(torch.optim).items()
            if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer}


def optimizer_class(type_name: str, params: dict[str, Any]) -> type | None:
    """DeepSpeed's optimizer name -> the torch class zerodp builds, None if there is none. "Adam"
    is AdamW unless params["adam_w_mode"] is false (DeepSpeed's adam_w_mode defaults to True)."""
    import torch.optim

    if type_name.lower() == "adam":
        return torch.optim.AdamW if params.get("adam_w_mode", True) is not False else torch.optim.Adam
    return torch_optimizer_classes().get(type_name.lower())


def optimizer_kwargs(cls: type, params: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments zerodp gives `cls` for a config's `params` (DeepSpeed's own keys
    dropped, betas as a tuple)."""
    kwargs = {k: v for k, v in params.items() if k not in DEEPSPEED_ADAM_KEYS}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return kwargs


def optimizer_problems(type_name: str, params: dict[str, Any]) -> list[str]:
    """Every problem with `optimizer.params` for `optimizer.type` = `type_name` (which must name a
    class `optimizer_class` finds)."""
    cls = optimizer_class(type_name, params)
    owner = f"torch.optim.{cls.__name__}"
    is_adam = type_name.lower() in ("adam", "adamw")
    extra = {key: Spec("bool") for key in DEEPSPEED_ADAM_KEYS} if is_adam else {}
    problems = params_problems("optimizer.params", owner, signature_specs(cls, ("self", "params")), params, extra)
    if is_adam and params.get("bias_correction", True) is False:
        problems.append("optimizer.params.bias_correction: false is not supported by zerodp (torch's "
                        "Adam and AdamW always correct bias); remove it or set true")
    return problems or _refused_by_torch("optimizer.params", owner, lambda: _build_optimizer_once(cls, params))


def _build_optimizer_once(cls: type, params: dict[str, Any]) -> None:
    import torch

    cls([torch.zeros(1, requires_grad=True)], **optimizer_kwargs(cls, params))


def scheduler_problems(type_name: str, params: dict[str, Any], optimizer_lr: Any = None) -> list[str]:
    """Every problem with `scheduler.params` for scheduler `type_name`: one of DeepSpeed's (its
    parameters from DEEPSPEED_SCHEDULER_PARAMS, its values checked as its class checks them at
    construction; each takes a number or one per param group where DeepSpeed says float) or a
    torch.optim.lr_scheduler class (types and ranges from its signature, then built once).
    `optimizer_lr`: the config's optimizer lr, if any (WarmupLR warms up to it)."""
    if type_name in DEEPSPEED_SCHEDULER_PARAMS:
        specs = {name: (Spec("any"), default is REQUIRED)
                 for name, default in DEEPSPEED_SCHEDULER_PARAMS[type_name].items()}
        problems = params_problems("scheduler.params", type_name, specs, params)
        return problems or _refused_by_torch("scheduler.params", type_name,
                                             lambda: _check_deepspeed_scheduler_once(type_name, params, optimizer_lr))
    cls = torch_scheduler_classes()[type_name]
    specs = signature_specs(cls, ("self", "optimizer"))
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls).parameters.values())
    owner = f"torch.optim.lr_scheduler.{type_name}"
    problems = params_problems("scheduler.params", owner, specs, params, open_ended=open_ended)
    return problems or _refused_by_torch("scheduler.params", owner,
                                         lambda: cls(_probe_optimizer(params, optimizer_lr), **params))


def _probe_optimizer(params: dict[str, Any], optimizer_lr: Any) -> Any:
    """A 1-element SGD to try a schedule on: one param group per entry of a per-group list in
    `params`, each at the config's optimizer lr."""
    import torch

    lengths = {len(v) for v in params.values() if isinstance(v, list)}  # per-group lists: that many groups
    num_groups = max(lengths, default=1)
    # Without the config's lr (an optimizer passed to initialize), one no schedule bound can exceed.
    lr = optimizer_lr if _is_number(optimizer_lr) else 1e9
    groups = [{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(num_groups)]
    return torch.optim.SGD(groups, lr=lr, momentum=0.9)


def _check_deepspeed_scheduler_once(type_name: str, params: dict[str, Any], optimizer_lr: Any) -> None:
    probe = _probe_optimizer(params, optimizer_lr)
    check_deepspeed_scheduler(type_name, params, [float(group["lr"]) for group in probe.param_groups])


def _refused_by_torch(path: str, owner: str, build: Any) -> list[str]:
    """Build the class once on a 1-element tensor; its own refusal, if any, as a problem."""
    try:
        build()
    except (ValueError, TypeError, RuntimeError) as err:
        if hasattr(err, "problems"):  # zerodp's schedulers name each key themselves
            return list(err.problems)
        detail = " ".join(str(err).split())
        return [f"{path}: {owner} refuses these values: {detail}"]
    return []


# ---------------------------------------------------------------------------------------------
# The config's sections
# ---------------------------------------------------------------------------------------------

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad")
_DEEPSPEED_ONLY_OPTIMIZERS = {
    "lamb": "Lamb", "lion": "Lion", "onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam",
    "onebitlamb": "OneBitLamb", "muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD",
    "muon": "Muon",
}


def optimizer_section_problems(cfg: Any) -> list[str]:
    """`optimizer.type` and `optimizer.params` of a validated config (nothing without a section)."""
    if cfg.optimizer is None:
        return []
    name = cfg.optimizer.type
    params = {k: v for k, v in cfg.optimizer.params.items() if k != "max_grad_norm"}  # rules.py says why
    if optimizer_class(name, params) is None:
        return [_unknown_optimizer(name)]
    return optimizer_problems(name, params)


def _unknown_optimizer(name: str) -> str:
    others = sorted(c.__name__ for c in torch_optimizer_classes().values() if c.__name__ not in SUPPORTED_OPTIMIZERS)
    supported = (f"supported: {', '.join(SUPPORTED_OPTIMIZERS)} (case-insensitive), or any "
                 f"torch.optim class ({', '.join(others)})")
    if name.lower() in _DEEPSPEED_ONLY_OPTIMIZERS:
        return (f"optimizer.type: {show_value(name)} is not supported by zerodp (DeepSpeed's "
                f"{_DEEPSPEED_ONLY_OPTIMIZERS[name.lower()]} needs its own CUDA/C++ kernels; zerodp "
                f"builds torch.optim optimizers); {supported}")
    match = did_you_mean(name, [*SUPPORTED_OPTIMIZERS, *others])
    suggestion = f" (did you mean '{match}'?)" if match else ""
    return f"optimizer.type: {show_value(name)} is not an optimizer zerodp knows{suggestion}; {supported}"


def torch_scheduler_classes() -> dict[str, type]:
    """Every torch.optim.lr_scheduler class by name (ReduceLROnPlateau included)."""
    import torch.optim.lr_scheduler as module

    base = getattr(module, "LRScheduler", getattr(module, "_LRScheduler", object))
    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, type) and not name.startswith("_") and name != "LRScheduler"
            and (issubclass(obj, base) or name == "ReduceLROnPlateau")}


def scheduler_section_problems(cfg: Any) -> list[str]:
    """`scheduler.type` and `scheduler.params` of a validated config (nothing without a section)."""
    if cfg.scheduler is None:
        return []
    name, torch_classes = cfg.scheduler.type, torch_scheduler_classes()
    if name not in DEEPSPEED_SCHEDULER_PARAMS and name not in torch_classes:
        names = [*DEEPSPEED_SCHEDULER_NAMES, *sorted(torch_classes)]
        return [f"scheduler.type: {show_value(name)} is neither a DeepSpeed scheduler "
                f"({', '.join(DEEPSPEED_SCHEDULER_NAMES)}) nor a torch.optim.lr_scheduler class"
                f"{hint(name, names)} (names are case-sensitive)"]
    lr = cfg.optimizer.params.get("lr") if cfg.optimizer is not None else None
    return scheduler_problems(name, cfg.scheduler.params, lr)

"""Load and check a DeepSpeed JSON config: every problem reported at once, before any process group.

    cfg = load_config("ds_config.json", world_size=8)      # or a dict, a JSON string, args=...
    cfg.train_micro_batch_size_per_gpu, cfg.zero_optimization.stage, cfg.precision
    print(cfg.batch.describe())

`load_config` is stricter than DeepSpeed: unknown keys are errors at every depth (DeepSpeed
ignores top-level typos), "auto" must have been resolved by an integration, keys DeepSpeed removed
are reported with advice, features zerodp does not implement are accepted only at their defaults,
and the data-parallel world size is never assumed to be 1 (DeepSpeed does that when
torch.distributed is not initialised, the source of its most common batch-size error).
The schema and its defaults (DeepSpeed 0.19.8's code, not its docs) live in `zerodp.config_schema`.

[Note: order of checks]
1. read the input (dict / path / JSON string / ZeroDPConfig / args.deepspeed_config);
   unreadable JSON or duplicate keys stop here, since nothing after that can be trusted;
2. walk the raw dict against the schema: removed keys, "auto", deprecated names, unknown keys;
3. pydantic validation; each failing key is dropped and validation repeated so that the
   remaining checks still run on a model (the failed key paths are remembered);
4. cross-field rules, skipping any rule that reads a failed key;
5. world size, then the batch rule (skipped if a batch key itself failed).
All problems from 2-5 are raised together as one ConfigError.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import copy
import functools
import json
import math
import os
import sys
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zerodp.config_schema import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    DataTypesConfig,
    FlopsProfilerConfig,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    Section,
    TimersConfig,
    TorchAutocastConfig,
    ZeroConfig,
    ZeroDPConfig,
)
from zerodp.config_batch import BATCH_KEYS, BatchMath, batch_problems, consistent_choices
from zerodp.config_hparams import optimizer_section_problems, scheduler_section_problems
from zerodp.config_keys import not_implemented_problems, warn_keys_without_effect
from zerodp.config_rules import did_you_mean, hierarchy_problems, semantic_problems, show_value
from zerodp.log import warn_once

__all__ = [
    "ActivationCheckpointingConfig", "AioConfig", "BF16Config", "BatchMath", "CheckpointConfig",
    "CommsLoggerConfig", "ConfigError", "DataTypesConfig", "FP16Config", "FlopsProfilerConfig",
    "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig", "SchedulerConfig",
    "TimersConfig", "TorchAutocastConfig", "ZeroConfig", "ZeroDPConfig", "add_config_arguments",
    "batch_problems", "consistent_choices", "load_config", "resolve_batch",
]



class ConfigError(ValueError):
    """A DeepSpeed config zerodp cannot use. `problems` lists each one, naming its dotted key path.

    str(err) is a header line ("3 problems in DeepSpeed config 'ds.json':") then one problem a line.
    """

    def __init__(self, problems: list[str] | str, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        count = len(self.problems)
        where = f" {self.source}" if self.source else ""
        header = f"{count} problem{'' if count == 1 else 's'} in DeepSpeed config{where}:"
        return "\n".join([header, *(f"  - {problem}" for problem in self.problems)])

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.problems, self.source))


# ---------------------------------------------------------------------------------------------
# Batch math (zerodp/config_batch.py) applied
# ---------------------------------------------------------------------------------------------


def resolve_batch(train_batch_size: int | None, micro_batch_size: int | None,
                  gradient_accumulation_steps: int | None, world_size: int) -> BatchMath:
    """Derive the missing batch values exactly as DeepSpeed does, then check the batch rule.

    Given two or three of train_batch_size, micro_batch_size (train_micro_batch_size_per_gpu)
    and gradient_accumulation_steps (None = not given) and the data-parallel world size, derive
    the rest with DeepSpeed's floor divisions and check train = micro x accumulation x world.
    Raises ConfigError showing every factor and proposing consistent values.
    """
    batch, problems = batch_problems(train_batch_size, micro_batch_size,
                                     gradient_accumulation_steps, world_size)
    if problems or batch is None:
        raise ConfigError(problems)
    return batch


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


class _Report:
    """Problems found so far, and the dotted key paths whose value could not be used."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.failed: set[str] = set()

    def add(self, path: str, message: str, failed: bool = True) -> None:
        self.problems.append(f"{path}: {message}")
        if failed:
            self.failed.add(path)

    def usable(self, *paths: str) -> bool:
        """False if any of `paths`, a key inside one, or a section holding one failed."""
        return not any(f == p or f.startswith(p + ".") or p.startswith(f + ".")
                       for f in self.failed for p in paths)


# ---------------------------------------------------------------------------------------------
# Reading the input
# ---------------------------------------------------------------------------------------------


class _JsonObject(dict):
    """A parsed JSON object that remembers which of its keys appeared more than once."""

    duplicates: list[str]


def _object_hook(pairs: list[tuple[str, Any]]) -> _JsonObject:
    obj = _JsonObject()
    obj.duplicates = [key for key, _ in pairs if sum(1 for k, _ in pairs if k == key) > 1]
    obj.update(pairs)
    return obj


def _plain(value: Any, path: str, duplicates: list[str]) -> Any:
    """Convert parsed JSON to plain dicts, collecting the dotted paths of duplicate keys."""
    if isinstance(value, dict):
        for key in dict.fromkeys(getattr(value, "duplicates", [])):
            duplicates.append(_join(path, key))
        return {k: _plain(v, _join(path, k), duplicates) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, _join(path, i), duplicates) for i, v in enumerate(value)]
    return value


MAX_DEPTH = 64
"""Deepest nesting of objects and lists accepted (a DeepSpeed config has 4 levels at most)."""


def _check_depth(value: Any, source: str) -> None:
    """Refuse absurd nesting before anything recursive walks the config (iteratively: no RecursionError)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"nested more than {MAX_DEPTH} levels deep (objects and lists); a DeepSpeed "
                              "config has a few levels at most: is this file a config?", source)
        children = node.values() if isinstance(node, Mapping) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)


def _parse_json(text: str, source: str) -> dict[str, Any]:
    try:
        parsed = json.loads(text, object_pairs_hook=_object_hook)
    except json.JSONDecodeError as err:
        raise ConfigError(f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}",
                          source) from None
    except RecursionError:
        raise ConfigError(f"nested too deeply to parse (more than {MAX_DEPTH} levels is refused); a DeepSpeed "
                          "config has a few levels at most: is this file a config?", source) from None
    _check_depth(parsed, source)
    if not isinstance(parsed, dict):
        raise ConfigError(f"the top level must be a JSON object, got {show_value(parsed)}", source)
    duplicates: list[str] = []
    plain = _plain(parsed, "", duplicates)
    if duplicates:
        raise ConfigError([f"{key}: duplicate key; only the last value would count, keep one"
                           for key in duplicates], source)
    return plain


def _decode_base64(text: str) -> str | None:
    """DeepSpeed also accepts a url-safe base64 JSON config (its launcher passes them)."""
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


def _read_file(path: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    source = f"'{os.fspath(path)}'"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        decoded = _decode_base64(path) if isinstance(path, str) else None
        if decoded is None:
            raise ConfigError(f"config file not found: '{os.fspath(path)}' (working directory "
                              f"{os.getcwd()})", source) from None
        return _parse_json(decoded, "(base64)"), "(base64)"
    except (OSError, UnicodeError) as err:
        raise ConfigError(f"cannot read config file '{os.fspath(path)}': {err}", source) from None
    return _parse_json(text, source), source


def _config_from_args(args: Any) -> str | None:
    if args is None:
        return None
    new = getattr(args, "deepspeed_config", None)
    old = getattr(args, "deepscale_config", None)
    if old is not None:
        warn_once("--deepscale_config is deprecated; use --deepspeed_config")
        if new is not None:
            raise ConfigError("args.deepspeed_config and args.deepscale_config are both set; "
                              "keep --deepspeed_config only")
    return new if new is not None else old


def _read_input(config: Any, args: Any) -> tuple[dict[str, Any], str, ZeroDPConfig | None]:
    """(raw dict, source label for messages, the ZeroDPConfig it came from if any)."""
    from_args = _config_from_args(args)
    if config is not None and from_args is not None:
        raise ConfigError(f"a config was passed and args.deepspeed_config is also set "
                          f"({from_args!r}); pass only one")
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError("no config given: pass a dict, a path to a JSON file or a JSON string, "
                          "or set args.deepspeed_config (--deepspeed_config PATH)")
    if isinstance(config, ZeroDPConfig):
        return _source_of(config), "(ZeroDPConfig)", config
    if isinstance(config, Mapping):
        _check_depth(config, "(dict)")
        return copy.deepcopy(dict(config)), "(dict)", None
    if isinstance(config, str) and config.lstrip().startswith("{"):
        return _parse_json(config, "(JSON string)"), "(JSON string)", None
    if isinstance(config, (str, os.PathLike)):
        raw, source = _read_file(config)
        return raw, source, None
    raise ConfigError(f"got a {type(config).__name__}; expected a dict, a path to a JSON file, "
                      "a JSON string or a ZeroDPConfig")


def _source_of(config: ZeroDPConfig) -> dict[str, Any]:
    if config._source is not None:
        return copy.deepcopy(config._source)
    return config.model_dump(exclude_unset=True)


# ---------------------------------------------------------------------------------------------
# Walking the raw dict against the schema
# ---------------------------------------------------------------------------------------------

# Keys whose value "auto" is a real DeepSpeed value, not a Hugging Face placeholder.
_AUTO_IS_A_VALUE = frozenset({"data_types.keep_in_fp32_modules"})
# Free-form sections zerodp never reads (unsupported features): not searched for "auto".
_UNREAD_SECTIONS = frozenset({
    "pipeline", "autotuning", "tensorboard", "wandb", "csv_monitor", "comet", "hybrid_engine",
    "data_efficiency", "compile", "tensor_parallel", "expert_parallel", "weight_quantization",
    "datastates", "zero_optimization.zenflow", "checkpoint.writer",
})


_AUTO_PROBLEM = ('"auto" is a placeholder that the Hugging Face integration (Trainer / Accelerate) '
                 "fills in; it reached zerodp unresolved, so set a value")


@functools.cache
def _keys_of(cls: type[Section]) -> dict[str, str]:
    """Every key accepted in a section (field names and their aliases) -> field name."""
    keys: dict[str, str] = {}
    for name, field in cls.model_fields.items():
        keys[name] = name
        for alias in getattr(field.validation_alias, "choices", []):
            keys[str(alias)] = name
    return keys


@functools.cache
def _section_type(cls: type[Section], field: str) -> type[Section] | None:
    """The Section class a field holds (unwrapping Optional), or None for plain values."""
    annotation = cls.model_fields[field].annotation
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, Section):
            return candidate
    return None


@functools.cache
def _all_key_paths() -> tuple[str, ...]:
    paths: list[str] = []

    def visit(cls: type[Section], prefix: str) -> None:
        for key, field in _keys_of(cls).items():
            paths.append(_join(prefix, key))
            sub = _section_type(cls, field)
            if sub is not None:
                visit(sub, _join(prefix, key))

    visit(ZeroDPConfig, "")
    return tuple(paths)


def _unknown_key_message(key: str, path: str, here: list[str]) -> str:
    """Did-you-mean at the same level first, else a key of the same name elsewhere in the schema."""
    match = did_you_mean(key, here)
    if match:
        return f"unknown key; did you mean '{match}'?"
    parent = path.rpartition(".")[0]
    elsewhere: dict[str, list[str]] = {}
    for full in _all_key_paths():
        if full.rpartition(".")[0] != parent:
            elsewhere.setdefault(full.rpartition(".")[2], []).append(full)
    match = did_you_mean(key, list(elsewhere))
    if match and len(elsewhere[match]) == 1:
        return f"unknown key here; did you mean '{elsewhere[match][0]}'?"
    return "unknown key (not a DeepSpeed config key zerodp knows)"


def _drop_autos(value: Any, path: str, report: _Report) -> Any:
    """Report "auto" anywhere inside a free-form dict or list, dropping the keys that hold one."""
    if isinstance(value, dict):
        kept = {}
        for key, item in value.items():
            where = _join(path, key)
            if _holds_auto(item):
                _report_autos(item, where, report)
            else:
                kept[key] = item
        return kept
    return value


def _holds_auto(value: Any) -> bool:
    if value == "auto":
        return True
    if isinstance(value, dict):
        return any(_holds_auto(v) for v in value.values())
    return isinstance(value, list) and any(_holds_auto(v) for v in value)


def _report_autos(value: Any, path: str, report: _Report) -> None:
    if value == "auto":
        report.add(path, _AUTO_PROBLEM)
    elif isinstance(value, dict):
        for key, item in value.items():
            _report_autos(item, _join(path, key), report)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _report_autos(item, _join(path, index), report)


def _clean_section(cls: type[Section], raw: dict[str, Any], path: str, report: _Report) -> dict[str, Any]:
    """`raw` with removed, "auto", unknown and duplicate-alias keys reported and dropped,
    deprecated names renamed, and sub-sections cleaned recursively."""
    raw = _LEGACY_UPGRADES.get(cls, lambda r, p, rep: r)(raw, path, report)
    keys = _keys_of(cls)
    seen: dict[str, str] = {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        where = _join(path, str(key))
        if not isinstance(key, str):
            report.add(where, "config keys must be strings", failed=False)
        elif key in cls.removed_keys:
            feature, action = cls.removed_keys[key]
            report.add(where, f"DeepSpeed 0.19 removed this key ({feature}); {action}", failed=False)
        elif value == "auto" and where not in _AUTO_IS_A_VALUE:
            report.add(where, _AUTO_PROBLEM)
        else:
            key = _rename(cls, key, path)
            if key not in keys:
                report.add(where, _unknown_key_message(key, where, list(keys)), failed=False)
            elif keys[key] in seen:
                report.add(where, f"sets the same option as '{_join(path, seen[keys[key]])}'; keep one")
            else:
                seen[keys[key]] = key
                out[key] = _clean_value(cls, keys[key], value, _join(path, key), report)
    return out


def _rename(cls: type[Section], key: str, path: str) -> str:
    new = cls.renamed_keys.get(key)
    if new is None:
        return key
    warn_once(f"DeepSpeed config key '{_join(path, key)}' is deprecated; use '{_join(path, new)}'")
    return new


def _clean_value(cls: type[Section], field: str, value: Any, path: str, report: _Report) -> Any:
    sub = _section_type(cls, field)
    if sub is not None and isinstance(value, dict):
        return _clean_section(sub, value, path, report)
    if path in _UNREAD_SECTIONS or path in _AUTO_IS_A_VALUE:
        return value
    return _drop_autos(value, path, report)


def _upgrade_top(raw: dict[str, Any], path: str, report: _Report) -> dict[str, Any]:
    """The old `"zero_optimization": true` form (= stage 1, reading top-level `allgather_size`)."""
    raw = dict(raw)
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):
        warn_once('"zero_optimization": true/false is deprecated; use "zero_optimization": {"stage": 1}')
        section: dict[str, Any] = {"stage": 1 if zero else 0}
        if zero and "allgather_size" in raw:
            section["allgather_bucket_size"] = raw.pop("allgather_size")
        raw["zero_optimization"] = section
    if "allgather_size" in raw:
        raw.pop("allgather_size")
        report.add("allgather_size", 'only read with the old form "zero_optimization": true; '
                   "set zero_optimization.allgather_bucket_size instead", failed=False)
    return _nest_dotted_keys(raw)


def _nest_dotted_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys spelled as a path ("zero_optimization.reduce_bucket_size", the form accelerate
    fills "auto" values from and TRL's `prepare_deepspeed` passes to `deepspeed.initialize`) set that
    nested key where it is absent or "auto". DeepSpeed 0.19.8 ignores such keys; zerodp applies them
    (the caller's evident intent) but never over a value the nested section sets itself. An integer
    key given a fractional number there (TRL's `0.9 * hidden_size**2` prefetch size) is rounded down."""
    for dotted in [k for k in raw if isinstance(k, str) and "." in k and k in _all_key_paths()]:
        *parents, leaf = dotted.split(".")
        node, cls = raw, ZeroDPConfig
        for part in parents:
            if not isinstance(node.get(part, {}), dict):
                break
            node[part] = dict(node.get(part, {}))
            node, cls = node[part], _section_type(cls, _keys_of(cls)[part])
        else:
            value = raw.pop(dotted)
            if isinstance(value, float) and cls.model_fields[_keys_of(cls)[leaf]].annotation is int:
                value = math.floor(value)
            if node.get(leaf, "auto") == "auto":
                node[leaf] = value
            elif node[leaf] != value:
                warn_once(f"config key '{dotted}' ({show_value(value)}) is not applied: "
                          f"'{dotted}' is set in its section ({show_value(node[leaf])})")
    return raw


def _upgrade_zero(raw: dict[str, Any], path: str, report: _Report) -> dict[str, Any]:
    """cpu_offload / cpu_offload_param / cpu_offload_use_pin_memory -> the offload sections."""
    raw = dict(raw)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old in raw:
            _upgrade_cpu_offload(raw, path, old, new, report)
    if "cpu_offload_use_pin_memory" in raw:
        where = _join(path, "cpu_offload_use_pin_memory")
        value = raw.pop("cpu_offload_use_pin_memory")
        if not isinstance(value, bool):
            report.add(where, f"got {show_value(value)}; expected true or false")
            return raw
        warn_once(f"DeepSpeed config key '{where}' is deprecated; set pin_memory in "
                  "offload_optimizer / offload_param")
        # DeepSpeed 0.19.8 only warns about this key and ignores its value; zerodp applies it
        # to the offload sections that do not set pin_memory themselves (the user's evident intent).
        for new in ("offload_optimizer", "offload_param"):
            if isinstance(raw.get(new), dict) and "pin_memory" not in raw[new]:
                raw[new] = {**raw[new], "pin_memory": value}
    return raw


def _upgrade_cpu_offload(raw: dict[str, Any], path: str, old: str, new: str, report: _Report) -> None:
    where = _join(path, old)
    value = raw.pop(old)
    if not isinstance(value, bool):
        report.add(where, f"got {show_value(value)}; expected true or false")
    elif new in raw:
        report.add(where, f"deprecated and given together with '{_join(path, new)}'; keep only {new}")
    else:
        warn_once(f"DeepSpeed config key '{where}' is deprecated; use "
                  f"'{_join(path, new)}': {{\"device\": \"cpu\"}}")
        if value:
            raw[new] = {"device": "cpu"}


_LEGACY_UPGRADES: dict[type[Section], Callable[[dict[str, Any], str, _Report], dict[str, Any]]] = {
    ZeroDPConfig: _upgrade_top,
    ZeroConfig: _upgrade_zero,
}


# ---------------------------------------------------------------------------------------------
# Pydantic validation, translated
# ---------------------------------------------------------------------------------------------

_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "a whole number",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "true or false", "bool_parsing": "true or false", "string_type": "a string",
    "list_type": "a list", "dict_type": "a JSON object",
    "model_type": "a JSON object (a section of keys)",
    "model_attributes_type": "a JSON object (a section of keys)",
}
_COMPARISONS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
                "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}


def _loc_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path = _join(path, part)
    return path


def _expected(kind: str, ctx: dict[str, Any], message: str) -> str:
    if kind in _COMPARISONS:
        key, sign = _COMPARISONS[kind]
        return f"a value {sign} {ctx[key]}"
    if kind == "literal_error":
        return f"one of {ctx['expected']}"
    return _EXPECTED.get(kind, message)


def _pydantic_problem(error: Mapping[str, Any]) -> tuple[str, str]:
    """(dotted key path, message) for one pydantic error: the value found and what was expected."""
    path = _loc_path(error["loc"])
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "missing":
        return path, "missing; this key is required"
    found = show_value(error["input"])
    if kind == "value_error":
        return path, f"got {found}; {ctx.get('error', error['msg'])}"
    expected = _expected(kind, ctx, error["msg"])
    if isinstance(error["input"], bool) and kind in ("int_type", "float_type"):
        expected += ", not a boolean"
    return path, f"got {found}; expected {expected}"


def _drop_at(data: dict[str, Any], loc: tuple[Any, ...]) -> bool:
    """Delete the deepest dict key along `loc` that exists; False if nothing could be deleted."""
    node: Any = data
    last: tuple[dict[str, Any], str] | None = None
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            break
        last = (node, part)
        node = node[part]
    if last is None:
        return False
    del last[0][last[1]]
    return True


def _validate(cleaned: dict[str, Any], report: _Report) -> ZeroDPConfig:
    """Validate, dropping each failing key and retrying so that later checks still get a model."""
    data = copy.deepcopy(cleaned)
    for _ in range(8):
        try:
            return ZeroDPConfig.model_validate(data)
        except ValidationError as err:
            dropped = False
            for error in err.errors():
                report.add(*_pydantic_problem(error))
                dropped = _drop_at(data, error["loc"]) or dropped
            if not dropped:
                break
    return ZeroDPConfig()


# ---------------------------------------------------------------------------------------------
# World size
# ---------------------------------------------------------------------------------------------

_UNKNOWN_WORLD_SIZE = (
    "data-parallel world size: unknown (torch.distributed is not initialised and $WORLD_SIZE is "
    "not set). zerodp never assumes 1, because a wrong world size silently changes the batch "
    "math (DeepSpeed #3228, #4703). Give it: `zerodp config check CONFIG --world-size N`; in Python "
    "load_config(..., world_size=N), or initialise torch.distributed first; or launch with `zerodp run` / "
    "torchrun, which set WORLD_SIZE")


def _dist_world_size() -> int | None:
    """torch.distributed's world size if it is initialised (without importing torch for it)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_world_size()


def _resolve_world_size(world_size: Any, previous: int | None) -> tuple[int | None, str, list[str]]:
    """(world size, where it came from, problems): argument, torch.distributed, $WORLD_SIZE, or
    the world size an already-resolved ZeroDPConfig was built with."""
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            return None, "", [f"world_size argument: got {show_value(world_size)}; expected the "
                              "data-parallel world size, an integer > 0"]
        return world_size, "", []
    from_dist = _dist_world_size()
    if from_dist is not None:
        return from_dist, "from torch.distributed", []
    env = os.environ.get("WORLD_SIZE")
    if env is not None:
        if not env.strip().isdigit() or int(env) < 1:
            return None, "", [f"$WORLD_SIZE: got {env!r}; expected an integer > 0"]
        return int(env), "from $WORLD_SIZE", []
    if previous is not None:
        return previous, "as resolved before", []
    return None, "", [_UNKNOWN_WORLD_SIZE]


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def load_config(config: Any = None, *, args: Any = None, world_size: int | None = None) -> ZeroDPConfig:
    """Read, check and resolve a DeepSpeed config.

    Args:
        config: a dict; a path (str or os.PathLike) to a JSON file; a JSON string (starting with
            "{"); or a ZeroDPConfig (re-resolved, e.g. at another world size). Default None: use
            `args.deepspeed_config` (or the deprecated `args.deepscale_config`).
        args: an argparse namespace from a parser set up with `add_config_arguments`.
        world_size: the data-parallel world size for the batch rule. Default None: torch.distributed's
            world size if initialised, else $WORLD_SIZE; if neither, a ConfigError (never 1 silently).

    Returns the validated ZeroDPConfig with train_batch_size, train_micro_batch_size_per_gpu and
    gradient_accumulation_steps resolved, plus `world_size` and `batch`.
    Raises ConfigError listing every problem found (unknown keys with did-you-mean, types and
    ranges, removed keys, "auto", unsupported features, cross-field rules, the batch rule).
    """
    raw, source, previous = _read_input(config, args)
    report = _Report()
    cleaned = _clean_section(ZeroDPConfig, raw, "", report)
    cfg = _validate(cleaned, report)
    report.problems.extend(semantic_problems(cfg, report.usable))
    report.problems.extend(not_implemented_problems(cfg))
    if report.usable("optimizer"):
        report.problems.extend(optimizer_section_problems(cfg))
    if report.usable("scheduler", "optimizer"):
        report.problems.extend(scheduler_section_problems(cfg))
    ws, ws_source, ws_problems = _resolve_world_size(world_size, previous._world_size if previous else None)
    report.problems.extend(ws_problems)
    batch = None
    if ws is not None and report.usable(*BATCH_KEYS):
        batch, batch_issues = batch_problems(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                                             cfg.gradient_accumulation_steps, ws, ws_source)
        report.problems.extend(batch_issues)
    if ws is not None and report.usable("zero_optimization"):
        report.problems.extend(hierarchy_problems(cfg, ws))
    if report.problems or batch is None:
        raise ConfigError(report.problems or ["batch sizes could not be resolved"], source)
    warn_keys_without_effect(cfg)
    return _finish(cfg, batch, raw)


def precision_of(config: Any) -> str:
    """"bf16", "fp16" or "fp32" from a config's precision sections only (a dict, path, JSON string or
    ZeroDPConfig), for `zero.Init`, which runs before Hugging Face has resolved the other "auto" values.
    ConfigError when an `enabled` is "auto" or not a boolean, or both are true."""
    raw, source, parsed = _read_input(config, None)
    if parsed is not None:
        return parsed.precision
    enabled, problems = {}, []
    for name, section in (("fp16", raw.get("fp16")), ("bf16", raw.get("bf16", raw.get("bfloat16")))):
        value = section.get("enabled", False) if isinstance(section, Mapping) else False
        if value == "auto":
            problems.append(f'{name}.enabled: "auto" must be resolved before zero.Init reads the precision '
                            "(Hugging Face's TrainingArguments resolve it from --bf16 / --fp16); set true or false")
        elif not isinstance(value, bool):
            problems.append(f"{name}.enabled: got {value!r}; expected true or false")
        enabled[name] = value is True
    if enabled["fp16"] and enabled["bf16"]:
        problems.append("fp16.enabled, bf16.enabled: both are true; enable one of them")
    if problems:
        raise ConfigError(problems, source)
    return "bf16" if enabled["bf16"] else "fp16" if enabled["fp16"] else "fp32"


def param_offload_of(config: Any) -> tuple[str, str | None]:
    """(device, nvme_path) of a config's `zero_optimization.offload_param`, reading that section only
    (for `zero.Init`, like `precision_of`): ("none", None) without one. ConfigError for a device that
    is not none / cpu / nvme, or nvme without an nvme_path."""
    raw, source, parsed = _read_input(config, None)
    if parsed is not None:
        section = parsed.zero_optimization.offload_param
        return (section.device, section.nvme_path) if section is not None else ("none", None)
    zero = raw.get("zero_optimization")
    section = zero.get("offload_param") if isinstance(zero, Mapping) else None
    if not isinstance(section, Mapping):
        return "none", None
    device, path = section.get("device", "none"), section.get("nvme_path")
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError([f"zero_optimization.offload_param.device: got {show_value(device)}; expected "
                           '"none", "cpu" or "nvme"'], source)
    if device == "nvme" and not isinstance(path, str):
        raise ConfigError([f"zero_optimization.offload_param.nvme_path: got {show_value(path)}; zero.Init needs "
                           "the folder for the parameter swap files"], source)
    return device, path


def _finish(cfg: ZeroDPConfig, batch: BatchMath, raw: dict[str, Any]) -> ZeroDPConfig:
    zero = cfg.zero_optimization
    if zero.stage < 3 and zero.offload_param is not None:
        if zero.offload_param.device != "none":  # DeepSpeed-Chat sets it with --offload at every stage
            warn_once(f'zero_optimization.offload_param: "device": "{zero.offload_param.device}" has no effect below '
                      f"ZeRO stage 3 (stage is {zero.stage}): parameters stay on the device, as in DeepSpeed; "
                      "offload_optimizer moves the optimizer state")
        zero.offload_param = None
    cfg.train_batch_size = batch.train_batch_size
    cfg.train_micro_batch_size_per_gpu = batch.micro_batch_size
    cfg.gradient_accumulation_steps = batch.gradient_accumulation_steps
    cfg._world_size = batch.world_size
    cfg._batch = batch
    cfg._source = copy.deepcopy(raw)
    return cfg


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags to `parser` and return it.

    --deepspeed (flag), --deepspeed_config PATH, and the deprecated --deepscale /
    --deepscale_config. `load_config(args=parser.parse_args())` reads the config they name.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable zerodp / DeepSpeed (helper flag for scripts; zerodp does not read it)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="Path to the DeepSpeed JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated: use --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated: use --deepspeed_config")
    return parser

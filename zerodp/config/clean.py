"""Walking a raw config dict against the schema before pydantic sees it (step 2 of
[Note: order of checks] in zerodp/config/load.py): keys DeepSpeed removed, unresolved "auto"
values, deprecated names and legacy forms (upgraded, with a warning), and unknown keys (a typo is an
error with did-you-mean, a key DeepSpeed ignores is ignored with a warning: zerodp/config/unknown.py).

`clean_section(ZeroDPConfig, raw, "", report)` returns the dict pydantic validates; every key it
drops is in `report`.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Callable
from typing import Any

from zerodp.config.deprecated import upgrade_zero_keys
from zerodp.config.errors import Report, join_path
from zerodp.config.hf_auto import AUTO_IS_A_VALUE, holds_auto
from zerodp.config.rules import show_value
from zerodp.config.schema import Section, ZeroConfig, ZeroDPConfig
from zerodp.config.unknown import handle_unknown_key
from zerodp.log import warn_once

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
            paths.append(join_path(prefix, key))
            sub = _section_type(cls, field)
            if sub is not None:
                visit(sub, join_path(prefix, key))

    visit(ZeroDPConfig, "")
    return tuple(paths)


def _drop_autos(value: Any, path: str, report: Report) -> Any:
    """Report "auto" anywhere inside a free-form dict or list, dropping the keys that hold one."""
    if isinstance(value, dict):
        kept = {}
        for key, item in value.items():
            where = join_path(path, key)
            if holds_auto(item, where):
                _report_autos(item, where, report)
            else:
                kept[key] = item
        return kept
    return value


def _report_autos(value: Any, path: str, report: Report) -> None:
    if value == "auto":
        report.add(path, _AUTO_PROBLEM)
    elif isinstance(value, dict):
        for key, item in value.items():
            _report_autos(item, join_path(path, key), report)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _report_autos(item, join_path(path, index), report)


def clean_section(cls: type[Section], raw: dict[str, Any], path: str, report: Report) -> dict[str, Any]:
    """`raw` with removed, "auto", unknown and duplicate-alias keys reported and dropped,
    deprecated names renamed, and sub-sections cleaned recursively."""
    raw = _LEGACY_UPGRADES.get(cls, lambda r, p, rep: r)(raw, path, report)
    keys = _keys_of(cls)
    seen: dict[str, str] = {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        where = join_path(path, str(key))
        if not isinstance(key, str):
            report.add(where, "config keys must be strings", failed=False)
        elif key in cls.removed_keys:
            feature, action = cls.removed_keys[key]
            report.add(where, f"DeepSpeed 0.19 removed this key ({feature}); {action}", failed=False)
        elif _rename(cls, key, path) not in keys:  # unknown keys first: an ignored key may hold "auto"
            handle_unknown_key(cls, key, where, list(keys), _all_key_paths(), report)
        elif value == "auto" and where not in AUTO_IS_A_VALUE:
            report.add(where, _AUTO_PROBLEM)
        else:
            key = _rename(cls, key, path, warn=True)
            if keys[key] in seen:
                report.add(where, f"sets the same option as '{join_path(path, seen[keys[key]])}'; keep one")
            else:
                seen[keys[key]] = key
                out[key] = _clean_value(cls, keys[key], value, join_path(path, key), report)
    return out


def _rename(cls: type[Section], key: str, path: str, warn: bool = False) -> str:
    """The current name of `key` (its deprecated name mapped, with a warning when `warn`)."""
    new = cls.renamed_keys.get(key)
    if new is None:
        return key
    if warn:
        warn_once(f"DeepSpeed config key '{join_path(path, key)}' is deprecated; use '{join_path(path, new)}'")
    return new


def _clean_value(cls: type[Section], field: str, value: Any, path: str, report: Report) -> Any:
    sub = _section_type(cls, field)
    if sub is not None and isinstance(value, dict):
        return clean_section(sub, value, path, report)
    if path in _UNREAD_SECTIONS or path in AUTO_IS_A_VALUE:
        return value
    return _drop_autos(value, path, report)


def _upgrade_top(raw: dict[str, Any], path: str, report: Report) -> dict[str, Any]:
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


def _upgrade_zero(raw: dict[str, Any], path: str, report: Report) -> dict[str, Any]:
    """cpu_offload / cpu_offload_param / cpu_offload_use_pin_memory -> the offload sections
    (zerodp/config/deprecated.py); below stage 3, "auto" in a stage3_ key is dropped (see
    _drop_stage3_autos)."""
    return upgrade_zero_keys(_drop_stage3_autos(dict(raw)), path, report)


def _drop_stage3_autos(raw: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face Trainer fills "auto" in stage3_prefetch_bucket_size and
    stage3_param_persistence_threshold at stage 3 only; below it DeepSpeed drops the leftover "auto"
    (its default takes over) and so does zerodp: a stage3_ key changes nothing below stage 3."""
    stage = raw.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, (int, float)) or stage >= 3:
        return raw
    return {key: value for key, value in raw.items()
            if not (isinstance(key, str) and key.startswith("stage3_") and value == "auto")}


_LEGACY_UPGRADES: dict[type[Section], Callable[[dict[str, Any], str, Report], dict[str, Any]]] = {
    ZeroDPConfig: _upgrade_top,
    ZeroConfig: _upgrade_zero,
}


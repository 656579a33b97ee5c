"""Deprecated config keys DeepSpeed 0.19.8 still accepts, upgraded to their current form with one
warning each naming the new key.

Used twice, so a key means the same whichever way a config arrives: by `load_config` while it walks
the raw dict (zerodp/config/clean.py, problems collected into its report), and by the section classes
themselves when built directly (`ZeroConfig(**{"cpu_offload": True})`, as `deepspeed.runtime.zero.config.
DeepSpeedZeroConfig` is; a problem there is a ValueError). The mapping is DeepSpeed's:

    renamed keys (a section's `renamed_keys`)   old name -> new name, same value
                                                (zero_optimization.stage3_gather_fp16_weights_on_model_save, aio.thread_count)
    zero_optimization.cpu_offload: bool         true -> offload_optimizer {"device": "cpu"}; false -> no offload
    zero_optimization.cpu_offload_param: bool   true -> offload_param {"device": "cpu"}; false -> no offload
    zero_optimization.cpu_offload_use_pin_memory: bool
                                                DeepSpeed warns and ignores the value; zerodp sets pin_memory of
                                                the offload sections that do not set it (the evident intent)

An old key given together with its new key is a problem (DeepSpeed: an AssertionError), not a guess.
Also here: `one_name_is_a_list`, DeepSpeed's older short form of a list of names.
"""

from __future__ import annotations

from typing import Any, Mapping

from zerodp.config.errors import Report, join_path, show_value
from zerodp.log import warn_once

CPU_OFFLOAD_KEYS = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
"""zero_optimization's boolean offload switches -> the section each one turns on."""


def rename_keys(renamed: Mapping[str, str], raw: dict[str, Any], path: str, report: Report) -> dict[str, Any]:
    """`raw` with each deprecated name in `renamed` replaced by its current name (one warning each);
    an old name given with its new name is reported and dropped."""
    if not any(old in raw for old in renamed):
        return raw
    out = dict(raw)
    for old, new in renamed.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out:
            report.add(join_path(path, old), f"deprecated and given together with '{join_path(path, new)}'; "
                       f"keep only {new}")
            continue
        warn_once(f"DeepSpeed config key '{join_path(path, old)}' is deprecated; use '{join_path(path, new)}'")
        out[new] = value
    return out


def upgrade_zero_keys(raw: dict[str, Any], path: str, report: Report) -> dict[str, Any]:
    """`zero_optimization` with cpu_offload / cpu_offload_param / cpu_offload_use_pin_memory replaced by
    the offload sections (see the module docstring); `raw` itself is not modified."""
    if not any(key in raw for key in (*CPU_OFFLOAD_KEYS, "cpu_offload_use_pin_memory")):
        return raw
    raw = dict(raw)
    for old, new in CPU_OFFLOAD_KEYS.items():
        if old in raw:
            _upgrade_cpu_offload(raw, path, old, new, report)
    if "cpu_offload_use_pin_memory" in raw:
        where = join_path(path, "cpu_offload_use_pin_memory")
        value = raw.pop("cpu_offload_use_pin_memory")
        if not isinstance(value, bool):
            report.add(where, f"got {show_value(value)}; expected true or false")
            return raw
        warn_once(f"DeepSpeed config key '{where}' is deprecated; set pin_memory in "
                  f"'{join_path(path, 'offload_optimizer')}' / '{join_path(path, 'offload_param')}'")
        for new in CPU_OFFLOAD_KEYS.values():
            if isinstance(raw.get(new), dict) and "pin_memory" not in raw[new]:
                raw[new] = {**raw[new], "pin_memory": value}
    return raw


def _upgrade_cpu_offload(raw: dict[str, Any], path: str, old: str, new: str, report: Report) -> None:
    where = join_path(path, old)
    value = raw.pop(old)
    if not isinstance(value, bool):
        report.add(where, f"got {show_value(value)}; expected true or false")
    elif new in raw:
        report.add(where, f"deprecated and given together with '{join_path(path, new)}'; keep only {new}")
    else:
        warn_once(f"DeepSpeed config key '{where}' is deprecated; use "
                  f"'{join_path(path, new)}': {{\"device\": \"cpu\"}}")
        if value:
            raw[new] = {"device": "cpu"}


def one_name_is_a_list(value: Any) -> Any:
    """DeepSpeed's short form of a list of names (zero_optimization.leaf_module): one string is a list of
    that one name."""
    return [value] if isinstance(value, str) else value


def upgrade_for_model(renamed: Mapping[str, str], raw: Any, upgrade: Any = None) -> Any:
    """The before-validation step of a section built directly: the renames and `upgrade` (a function
    like upgrade_zero_keys) applied to a dict input; a problem is a ValueError naming the key. Input
    that is not a dict is left to pydantic."""
    if not isinstance(raw, dict):
        return raw
    report = Report()
    raw = rename_keys(renamed, raw, "", report)
    if upgrade is not None:
        raw = upgrade(raw, "", report)
    if report.problems:
        raise ValueError("; ".join(report.problems))
    return raw

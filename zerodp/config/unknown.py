"""What load_config does with a config key zerodp does not know: a typo is an error, a key DeepSpeed
ignores is ignored with one warning, and strict keys make every unknown key an error.

[Note: unknown keys]
DeepSpeed 0.19.8 reads the top level of a config, and the sections `activation_checkpointing`,
`aio`, `checkpoint`, `data_types`, `flops_profiler`, `optimizer`, `scheduler`, `torch_autocast` and
`timers`, with dict.get: a key it does not know there is ignored, typo or not. Its other sections
(`fp16`, `bf16`, `zero_optimization` with `offload_param`, `offload_optimizer` and `leaf_module`,
`comms_logger`, `timers.throughput`) are pydantic models with extra="forbid": an unknown key there is
an error. Stock configs carry keys of the first kind (LLaMA-Factory's `comms_config` and
`monitor_config`, `_comment`, tool-specific blocks), so refusing them all refuses configs DeepSpeed
runs, while ignoring them all lets a misspelt key silently fall back to its default. zerodp, in order:
1. a key starting with "_" is a comment: ignored with one warning, at any depth, never a did-you-mean
   (inside a section DeepSpeed forbids extras in, the warning says DeepSpeed would refuse it);
2. a key within a few edits of a key of its section (`rules.typo_of`), or of a key that exists in
   exactly one other section, is a typo: an error with did-you-mean, also where DeepSpeed ignores it;
   a top-level dotted key (`zero_optimization.stagee`, accelerate's form) is matched against every path;
3. any other key where DeepSpeed ignores it: ignored with one warning naming it;
4. any other key where DeepSpeed refuses it: an error, as in DeepSpeed.
Strict keys (`"zerodp": {"strict_keys": true}` in the config, or $ZERODP_STRICT_CONFIG=1) make
1 and 3 errors too, with the did-you-mean `rules.did_you_mean` finds.
"""

from __future__ import annotations

import os
from typing import Any

from zerodp.config.errors import Report
from zerodp.config.rules import did_you_mean, typo_of
from zerodp.config.schema import Section
from zerodp.log import warn_once

STRICT_ENV = "ZERODP_STRICT_CONFIG"
"""The environment variable that turns strict keys on for every config ("1"; "0" or unset: off)."""

_STRICT_WHY = f'strict keys are on: "zerodp": {{"strict_keys": true}} or {STRICT_ENV}=1'


def strict_keys_of(raw: dict[str, Any]) -> tuple[bool, list[str]]:
    """(whether unknown keys are all errors, problems): on when the raw config has
    `"zerodp": {"strict_keys": true}` or $ZERODP_STRICT_CONFIG is "1". A value of the variable other
    than "1", "0" or "" is a problem (strict keys then on: the user asked for something)."""
    section = raw.get("zerodp")
    from_config = isinstance(section, dict) and section.get("strict_keys") is True
    env = os.environ.get(STRICT_ENV, "").strip()
    if env not in ("", "0", "1"):
        return True, [f"${STRICT_ENV}: got {env!r}; expected 1 (every unknown config key is an error) or 0 (off)"]
    return from_config or env == "1", []


def handle_unknown_key(cls: type[Section], key: str, where: str, here: list[str],
                       all_paths: tuple[str, ...], report: Report) -> None:
    """Report or warn about `key` (dotted path `where`), unknown in section `cls` whose keys are
    `here`; `all_paths` is every key path of the schema. See [Note: unknown keys]."""
    section = where.rpartition(".")[0]
    if key.startswith("_"):
        if report.strict_keys:
            report.add(where, f"unknown key, a comment (it starts with '_'); {_STRICT_WHY}", failed=False)
        else:
            warn_once(_comment_warning(cls, where, section))
        return
    typo = _typo_message(key, where, here, all_paths)
    if typo is not None:
        report.add(where, typo, failed=False)
    elif report.strict_keys:
        report.add(where, _loose_message(key, where, here, all_paths, _STRICT_WHY), failed=False)
    elif cls.own_section:
        report.add(where, _loose_message(key, where, here, all_paths, f"'{section}' is zerodp's own section: "
                                         "every key in it is checked"), failed=False)
    elif not cls.deepspeed_ignores_unknown:
        why = f"DeepSpeed refuses unknown keys in '{section}' too"
        report.add(where, _loose_message(key, where, here, all_paths, why), failed=False)
    else:
        match = did_you_mean(key, here)
        also = f" (if you meant '{match}', spell it so)" if match else ""
        warn_once(f"DeepSpeed config key '{where}' is not one DeepSpeed reads: zerodp ignores it, as DeepSpeed "
                  f"does{also}")


def _comment_warning(cls: type[Section], where: str, section: str) -> str:
    text = f"DeepSpeed config key '{where}' starts with '_' (a comment): zerodp ignores it"
    if cls.deepspeed_ignores_unknown or cls.own_section:  # DeepSpeed ignores the whole zerodp section
        return text + ", as DeepSpeed does"
    return (text + f"; DeepSpeed refuses unknown keys inside '{section}', comments too: remove it before running "
            "this config under DeepSpeed")


def _elsewhere(key: str, where: str, all_paths: tuple[str, ...]) -> dict[str, list[str]]:
    """Key names of the other sections -> their full paths."""
    parent = where.rpartition(".")[0]
    names: dict[str, list[str]] = {}
    for full in all_paths:
        if full.rpartition(".")[0] != parent:
            names.setdefault(full.rpartition(".")[2], []).append(full)
    return names


def _typo_message(key: str, where: str, here: list[str], all_paths: tuple[str, ...]) -> str | None:
    """"unknown key; did you mean ..." when `key` is a typo of a known key, else None."""
    if "." in key and where == key:  # a top-level dotted path
        match = typo_of(key, [path for path in all_paths if "." in path])
        return f"unknown key; did you mean '{match}'?" if match else None
    match = typo_of(key, here)
    if match is not None:
        return f"unknown key; did you mean '{match}'?"
    elsewhere = _elsewhere(key, where, all_paths)
    match = typo_of(key, list(elsewhere))
    if match is not None and len(elsewhere[match]) == 1:
        return f"unknown key here; did you mean '{elsewhere[match][0]}'?"
    return None


def _loose_message(key: str, where: str, here: list[str], all_paths: tuple[str, ...], why: str) -> str:
    """The message of an unknown key refused though it is no close typo (`why` it is refused), with
    the looser did-you-mean of `rules.did_you_mean` where there is one."""
    match = did_you_mean(key, here)
    if match is None:
        elsewhere = _elsewhere(key, where, all_paths)
        found = did_you_mean(key, list(elsewhere))
        match = elsewhere[found][0] if found and len(elsewhere[found]) == 1 else None
    if match is not None:
        return f"unknown key; did you mean '{match}'? ({why})"
    return f"unknown key, not a DeepSpeed config key zerodp knows ({why})"

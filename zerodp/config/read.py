"""Reading a DeepSpeed config from what a user hands over: a dict, a path, a JSON string (or the
base64 JSON DeepSpeed's launcher passes), a ZeroDPConfig, or `args.deepspeed_config`; the
data-parallel world size from the argument, torch.distributed or $WORLD_SIZE; and the two sections
`zero.Init` reads before the rest of the config is resolved (`precision_of`, `param_offload_of`).

Unreadable JSON, duplicate keys or absurd nesting raise ConfigError at once: nothing after them
can be trusted (step 1 of [Note: order of checks] in zerodp/config/load.py).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import copy
import json
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerodp.config.errors import ConfigError, join_path
from zerodp.config.rules import show_value
from zerodp.config.schema import ZeroDPConfig
from zerodp.log import warn_once

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
            duplicates.append(join_path(path, key))
        return {k: _plain(v, join_path(path, k), duplicates) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, join_path(path, i), duplicates) for i, v in enumerate(value)]
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


MAX_CONFIG_BYTES = 16 << 20
"""Largest config file read (16 MiB). A DeepSpeed config is a few KiB; a file past this is not one,
and reading it whole (a device like /dev/zero never ends) would fill memory."""

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe), whose read could block forever"),
               (stat.S_ISCHR, "a character device (like /dev/zero), whose read may never end"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_small_file(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of `path`, a regular file (a link to one is followed) of at most `max_bytes`.
    ValueError saying what is wrong otherwise (the caller names the file and the argument): a
    directory, FIFO, device or socket is refused before it is read, so nothing blocks or reads
    without end; OSError (FileNotFoundError, PermissionError) as the system raises it."""
    kind = _special_kind(os.stat(path).st_mode)
    if kind is None:  # opened without blocking, then checked again: a FIFO swapped in meanwhile is refused too
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            kind = _special_kind(os.fstat(fd).st_mode)
            data = f.read(max_bytes + 1) if kind is None else b""
    if kind is not None:
        raise ValueError(f"not a regular file but {kind}")
    if len(data) > max_bytes:
        raise ValueError(f"over {max_bytes:,} bytes, larger than any file of its kind: is it the right file?")
    return data


def _special_kind(mode: int) -> str | None:
    """What a file that is not a regular one is ("a directory", "a FIFO ..."); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for is_kind, kind in _FILE_KINDS if is_kind(mode)), "not a regular file")


def _read_file(path: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    source = f"'{os.fspath(path)}'"
    try:
        data = read_small_file(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        decoded = _decode_base64(path) if isinstance(path, str) else None
        if decoded is None:
            raise ConfigError(f"config file not found: '{os.fspath(path)}' (working directory "
                              f"{os.getcwd()})", source) from None
        return _parse_json(decoded, "(base64)"), "(base64)"
    except (OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigError(f"cannot read config file '{os.fspath(path)}': {reason}", source) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file '{os.fspath(path)}' is not UTF-8 text (byte 0x{data[err.start]:02x} at "
                          f"offset {err.start}): a DeepSpeed config is a JSON text file", source) from None
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


def read_input(config: Any, args: Any) -> tuple[dict[str, Any], str, ZeroDPConfig | None]:
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


def resolve_world_size(world_size: Any, previous: int | None) -> tuple[int | None, str, list[str]]:
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
# Sections zero.Init reads before the config is resolved, and DeepSpeed's command-line flags
# ---------------------------------------------------------------------------------------------


def precision_of(config: Any) -> str:
    """"bf16", "fp16" or "fp32" from a config's precision sections only (a dict, path, JSON string or
    ZeroDPConfig), for `zero.Init`, which runs before Hugging Face has resolved the other "auto" values.
    ConfigError when an `enabled` is "auto" or not a boolean, or both are true."""
    raw, source, parsed = read_input(config, None)
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
    raw, source, parsed = read_input(config, None)
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

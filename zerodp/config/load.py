"""Load and check a DeepSpeed JSON config: every problem reported at once, before any process group.

    cfg = load_config("ds_config.json", world_size=8)      # or a dict, a JSON string, args=...
    cfg.train_micro_batch_size_per_gpu, cfg.zero_optimization.stage, cfg.precision
    print(cfg.batch.describe())

`load_config` accepts what DeepSpeed accepts and catches what DeepSpeed lets through: a key within a
few edits of a real key is an error with did-you-mean at every depth (DeepSpeed ignores top-level
typos), other keys DeepSpeed ignores are ignored with one warning each, unless strict keys are on
([Note: unknown keys] in zerodp/config/unknown.py); "auto" must have been resolved by an
integration, keys DeepSpeed removed are reported with advice, features zerodp does not implement are
accepted only at their defaults,
and the data-parallel world size is never assumed to be 1 (DeepSpeed does that when
torch.distributed is not initialised, the source of its most common batch-size error).
The schema and its defaults (DeepSpeed 0.19.8's code, not its docs) live in `zerodp.config.schema`.

[Note: order of checks]
1. read the input (dict / path / JSON string / ZeroDPConfig / args.deepspeed_config);
   unreadable JSON or duplicate keys stop here, since nothing after that can be trusted (read.py);
   then whether strict keys are on (`zerodp.strict_keys`, $ZERODP_STRICT_CONFIG; unknown.py);
2. walk the raw dict against the schema: removed keys, unknown keys, "auto", deprecated names (clean.py);
3. pydantic validation (below); each failing key is dropped and validation repeated so that the
   remaining checks still run on a model (the failed key paths are remembered);
4. cross-field rules (rules.py), keys zerodp does not implement (keys.py), optimizer and scheduler
   parameters (hparams.py), skipping any rule that reads a failed key;
5. world size (read.py), then the batch rule (batch.py; skipped if a batch key itself failed).
All problems from 2-5 are raised together as one ConfigError.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from zerodp.config.batch import BATCH_KEYS, BatchMath, batch_problems, sequence_parallel_problem
from zerodp.config.clean import clean_section
from zerodp.config.errors import ConfigError, Report, join_path
from zerodp.config.hparams import optimizer_section_problems, scheduler_section_problems
from zerodp.config.keys import not_implemented_problems, warn_keys_without_effect
from zerodp.config.read import read_input, resolve_world_size
from zerodp.config.rules import hierarchy_problems, semantic_problems, show_value
from zerodp.config.schema import ZeroDPConfig
from zerodp.config.unknown import strict_keys_of
from zerodp.log import warn_once

# ---------------------------------------------------------------------------------------------
# Batch math (zerodp/config/batch.py) applied
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
        path = join_path(path, part)
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


def _validate(cleaned: dict[str, Any], report: Report) -> ZeroDPConfig:
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
# Entry points
# ---------------------------------------------------------------------------------------------


def load_config(config: Any = None, *, args: Any = None, world_size: int | None = None,
                sequence_parallel_size: int | None = None) -> ZeroDPConfig:
    """Read, check and resolve a DeepSpeed config.

    Args:
        config: a dict; a path (str or os.PathLike) to a JSON file; a JSON string (starting with
            "{"); or a ZeroDPConfig (re-resolved, e.g. at another world size). Default None: use
            `args.deepspeed_config` (or the deprecated `args.deepscale_config`).
        args: an argparse namespace from a parser set up with `add_config_arguments`.
        world_size: the number of ranks. Default None: torch.distributed's world size if initialised,
            else $WORLD_SIZE; if neither, a ConfigError (never 1 silently). The batch rule counts
            world_size / sequence_parallel_size data-parallel ranks.
        sequence_parallel_size: the sequence-parallel size an `mpu=` of initialize() gives (DeepSpeed's
            Ulysses groups); None: the config key's. A config key > 1 that differs is a ConfigError.

    Returns the validated ZeroDPConfig with train_batch_size, train_micro_batch_size_per_gpu and
    gradient_accumulation_steps resolved, plus `world_size` and `batch`.
    A key DeepSpeed ignores (`comms_config`, `_comment`, ...) is ignored with one warning naming it;
    `"zerodp": {"strict_keys": true}` or $ZERODP_STRICT_CONFIG=1 make it an error.
    Raises ConfigError listing every problem found (misspelt keys with did-you-mean, types and
    ranges, removed keys, "auto", unsupported features, cross-field rules, the batch rule).
    """
    raw, source, previous = read_input(config, args)
    strict_keys, strict_problems = strict_keys_of(raw)
    report = Report(strict_keys=strict_keys)
    report.problems.extend(strict_problems)
    cleaned = clean_section(ZeroDPConfig, raw, "", report)
    cfg = _validate(cleaned, report)
    report.problems.extend(semantic_problems(cfg, report.usable))
    report.problems.extend(not_implemented_problems(cfg))
    if report.usable("optimizer"):
        report.problems.extend(optimizer_section_problems(cfg))
    if report.usable("scheduler", "optimizer"):
        report.problems.extend(scheduler_section_problems(cfg))
    ws, ws_source, ws_problems = resolve_world_size(world_size, previous.num_ranks if previous is not None and previous._world_size is not None else None)
    report.problems.extend(ws_problems)
    if ws is not None and report.usable("sequence_parallel_size"):
        ws, ws_source = _data_parallel_size(cfg, ws, ws_source, sequence_parallel_size, report)
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


def _data_parallel_size(cfg: ZeroDPConfig, num_ranks: int, source: str, given: int | None,
                        report: Report) -> tuple[int | None, str]:
    """The data-parallel world size the batch rule counts: `num_ranks` / sequence_parallel_size (the
    config key's, or `given` by an mpu), with where it came from; (None, "") and a problem when the
    size does not divide the ranks, or the mpu's and the key's differ."""
    key = cfg.sequence_parallel_size
    if given is not None and key > 1 and given != key:
        report.problems.append(f"sequence_parallel_size: {key} in the config, but the mpu passed to initialize() has "
                               f"sequence-parallel groups of {given} ranks; drop the key or make them agree")
        return None, ""
    size = given if given is not None else key
    problem = sequence_parallel_problem(num_ranks, size)
    if problem:
        report.problems.append(problem)
        return None, ""
    cfg.sequence_parallel_size = size
    if size == 1:
        return num_ranks, source
    return num_ranks // size, f"{num_ranks} ranks{' ' + source if source else ''} / sequence_parallel_size {size}"


def _finish(cfg: ZeroDPConfig, batch: BatchMath, raw: dict[str, Any]) -> ZeroDPConfig:
    """Drop offload_param below stage 3 (with a warning), write the resolved batch sizes and remember
    the world size, the batch math and the raw dict the config came from."""
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


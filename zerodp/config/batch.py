"""Batch math: train_batch_size = micro-batch x gradient accumulation x data-parallel world size,
where the data-parallel world size is the number of ranks / sequence_parallel_size (DeepSpeed's rule:
the ranks of one sequence-parallel group share each sample).

Pure: numbers in, numbers and sentences out. DeepSpeed's derivation of the missing values (its floor
divisions), the batch rule with every factor shown, and the consistent choices proposed when it
fails. zerodp.config applies it to a config and raises ConfigError with its sentences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerodp.config.rules import show_value

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
ACCUM = "gradient_accumulation_steps"
BATCH_KEYS = (TRAIN, MICRO, ACCUM)


@dataclass(frozen=True)
class BatchMath:
    """train_batch_size = micro_batch_size x gradient_accumulation_steps x world_size, resolved."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    derived: tuple[str, ...]  # config keys whose value was derived, not given

    def describe(self) -> str:
        """One line showing every factor and which were derived."""
        def part(key: str, value: int) -> str:
            return f"{key} {value}{' (derived)' if key in self.derived else ''}"
        return (f"{part(TRAIN, self.train_batch_size)} = {part(MICRO, self.micro_batch_size)} x "
                f"{part(ACCUM, self.gradient_accumulation_steps)} x data-parallel world size "
                f"{self.world_size}")


def batch_problems(train_batch_size: int | None, micro_batch_size: int | None,
                   gradient_accumulation_steps: int | None, world_size: int,
                   world_size_source: str = "") -> tuple[BatchMath | None, list[str]]:
    """`resolve_batch` returning (BatchMath or None, problems) instead of raising.

    `world_size_source` ("from $WORLD_SIZE", ...) is shown next to the world size in messages.
    """
    given = {TRAIN: train_batch_size, MICRO: micro_batch_size, ACCUM: gradient_accumulation_steps}
    problems = _batch_input_problems(given, world_size)
    if problems:
        return None, problems
    if train_batch_size is None and micro_batch_size is None:
        return None, [f"{TRAIN}, {MICRO}: neither is set; set at least one of them "
                      f"({ACCUM} alone does not give a batch size)"]
    tbs, micro, accum, how = _derive(train_batch_size, micro_batch_size, gradient_accumulation_steps,
                                     world_size)
    ws_text = f"world_size({world_size}{', ' + world_size_source if world_size_source else ''})"
    problem = _batch_rule_problem(tbs, micro, accum, world_size, how, ws_text)
    if problem:
        return None, [problem]
    return BatchMath(tbs, micro, accum, world_size, tuple(k for k in BATCH_KEYS if k in how)), []


def sequence_parallel_problem(num_ranks: int, sequence_parallel_size: int) -> str | None:
    """Why `sequence_parallel_size` cannot split `num_ranks` ranks into data-parallel x
    sequence-parallel groups, or None when it divides them."""
    if isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int) \
            or sequence_parallel_size < 1:
        return f"sequence_parallel_size: got {show_value(sequence_parallel_size)}; expected an integer >= 1"
    if num_ranks % sequence_parallel_size:
        divisors = [d for d in range(1, num_ranks + 1) if num_ranks % d == 0]
        return (f"sequence_parallel_size: {sequence_parallel_size} does not divide the world size "
                f"({num_ranks} ranks); use one of {divisors}")
    return None


MAX_BATCH = 10**9
"""The largest batch value accepted: a billion samples per step is no real run (a token count, or a typo)."""


def _batch_input_problems(given: dict[str, int | None], world_size: int) -> list[str]:
    problems = []
    for key, value in given.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            problems.append(f"{key}: got {show_value(value)}; expected an integer > 0")
        elif value is not None and value > MAX_BATCH:
            problems.append(f"{key}: got {value:,}; expected at most {MAX_BATCH:,} samples (is it a token "
                            "count, or a typo?)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        problems.append(f"world_size: got {show_value(world_size)}; expected the data-parallel world size, "
                        "an integer > 0")
    return problems


def _derive(tbs: int | None, micro: int | None, accum: int | None,
            ws: int) -> tuple[int, int, int, dict[str, str]]:
    """DeepSpeed's derivation table (reference §2.1); `how` says how each derived value came about."""
    how: dict[str, str] = {}
    if tbs is not None and micro is not None and accum is None:
        accum = tbs // micro // ws
        how[ACCUM] = f"derived as {tbs} // {micro} // {ws}"
    elif tbs is not None and accum is not None and micro is None:
        micro = tbs // ws // accum
        how[MICRO] = f"derived as {tbs} // {ws} // {accum}"
    elif micro is not None and accum is not None and tbs is None:
        tbs = micro * accum * ws
        how[TRAIN] = f"derived as {micro} x {accum} x {ws}"
    elif tbs is not None and micro is None:
        accum, micro = 1, tbs // ws
        how[ACCUM] = f"1 when only {TRAIN} is given"
        how[MICRO] = f"derived as {tbs} // {ws}"
    elif micro is not None and tbs is None:
        accum, tbs = 1, micro * ws
        how[ACCUM] = f"1 when only {MICRO} is given"
        how[TRAIN] = f"derived as {micro} x {ws}"
    return tbs, micro, accum, how  # type: ignore[return-value]


def _batch_rule_problem(tbs: int, micro: int, accum: int, ws: int, how: dict[str, str],
                        ws_text: str) -> str | None:
    def factor(key: str, value: int) -> str:
        return f"{key}({value}{', ' + how[key] if key in how else ''})"

    choices = _describe_choices(tbs, micro, accum, ws)
    if micro == 0:
        return (f"{factor(MICRO, micro)} must be at least 1: {TRAIN}({tbs}) is smaller than "
                f"{ws_text} x {ACCUM}({accum}) = {ws * accum}; consistent choices: {choices}")
    if accum == 0:
        return (f"{factor(ACCUM, accum)} must be at least 1: {TRAIN}({tbs}) is smaller than "
                f"{MICRO}({micro}) x {ws_text} = {micro * ws}; consistent choices: {choices}")
    product = micro * accum * ws
    if tbs == product:
        return None
    text = (f"{factor(TRAIN, tbs)} != {factor(MICRO, micro)} x {factor(ACCUM, accum)} x {ws_text} "
            f"= {product}; consistent choices: {choices}")
    if tbs % (micro * accum) == 0 and tbs // (micro * accum) != ws:
        text += (f". The values fit a data-parallel world size of {tbs // (micro * accum)}: "
                 "if that is what you run, the world size is what is wrong")
    return text


def consistent_choices(tbs: int, micro: int, accum: int, ws: int) -> list[tuple[int, int, int]]:
    """Up to three (train, micro, accumulation) triples that satisfy the batch rule at `ws`,
    each close to the given values: keep micro and accumulation; keep micro and round the train
    batch up; keep the train batch and pick the largest micro batch <= `micro` that divides it."""
    micro, accum = max(micro, 1), max(accum, 1)
    candidates = [(micro * accum * ws, micro, accum)]
    up = -(-tbs // (micro * ws))
    candidates.append((micro * up * ws, micro, up))
    if tbs % ws == 0:
        per_rank = tbs // ws
        if per_rank % accum == 0:
            candidates.append((tbs, per_rank // accum, accum))
        divisor = largest_divisor_at_most(per_rank, micro)
        candidates.append((tbs, divisor, per_rank // divisor))
    down = tbs // (micro * ws)
    if down >= 1:
        candidates.append((micro * down * ws, micro, down))
    unique = list(dict.fromkeys(c for c in candidates if c != (tbs, micro, accum)))
    return unique[:3]


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of `n` that is <= `limit` (>= 1): divisors come in pairs (d, n // d) with
    d <= sqrt(n), so sqrt(n) trial divisions find it (31,623 at MAX_BATCH)."""
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            best = max([best] + [x for x in (d, n // d) if x <= limit])
    return best


def _describe_choices(tbs: int, micro: int, accum: int, ws: int) -> str:
    current = (tbs, micro, accum)
    texts = []
    for choice in consistent_choices(tbs, micro, accum, ws):
        changed = [f"{key}={new}" for key, old, new in zip(BATCH_KEYS, current, choice) if old != new]
        texts.append(" with ".join(changed))
    return ", or ".join(texts)

"""The "auto" placeholders of a DeepSpeed config filled as the Hugging Face Trainer fills them
(transformers' `HfTrainerDeepSpeedConfig.trainer_config_process` / `trainer_config_finalize`), so that
`zerodp config check --hf` and the tests can check a stock LLaMA-Factory / Axolotl config the way it
reaches `deepspeed.initialize`.

    filled, notes = fill_hf_auto(raw, TrainerArgs(world_size=8, micro_batch_size=4, hidden_size=2048))

Pure: a dict in, a new dict and the list of what was filled out; nothing here reads a model or a file.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from zerodp.config.rules import show_value


@dataclass(frozen=True)
class TrainerArgs:
    """The TrainingArguments values the Trainer fills "auto" from; defaults are transformers'
    (per_device_train_batch_size 8, gradient_accumulation_steps 1, max_grad_norm 1.0, lr 5e-5, Adam
    betas (0.9, 0.999), eps 1e-8, weight_decay 0, neither --bf16 nor --fp16, warmup_steps 0).
    `hidden_size` stands for the model config's hidden_size (default 4096, a 7B LLaMA's) and
    `num_training_steps` for the Trainer's computed step count (default 1000)."""

    world_size: int
    micro_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    hidden_size: int = 4096
    dtype: str = "fp32"  # "bf16" = --bf16, "fp16" = --fp16
    max_grad_norm: float = 1.0
    learning_rate: float = 5e-5
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    num_training_steps: int = 1000
    warmup_steps: int = 0


@dataclass(frozen=True)
class Filled:
    """One placeholder filled: its dotted key path, the value written, and the Trainer argument it came from."""

    path: str
    value: Any
    source: str

    def describe(self) -> str:
        """`zero_optimization.reduce_bucket_size = 4194304 (hidden_size 2048 ** 2)`, values as in JSON."""
        return f"{self.path} = {show_value(self.value)} ({self.source})"


def _plan(args: TrainerArgs, zero3: bool) -> list[tuple[str, Any, str]]:
    """(path, value, source) in the Trainer's order; stage-3 keys only when the config is at stage 3."""
    h = args.hidden_size
    train = args.world_size * args.micro_batch_size * args.gradient_accumulation_steps
    plan = [
        ("train_micro_batch_size_per_gpu", args.micro_batch_size, "per_device_train_batch_size"),
        ("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps"),
        ("train_batch_size", train, f"world_size {args.world_size} x per_device_train_batch_size "
                                    f"{args.micro_batch_size} x gradient_accumulation_steps "
                                    f"{args.gradient_accumulation_steps}"),
        ("gradient_clipping", args.max_grad_norm, "max_grad_norm"),
        ("optimizer.params.lr", args.learning_rate, "learning_rate"),
        ("optimizer.params.betas", list(args.adam_betas), "adam_beta1, adam_beta2"),
        ("optimizer.params.eps", args.adam_epsilon, "adam_epsilon"),
        ("optimizer.params.weight_decay", args.weight_decay, "weight_decay"),
        ("scheduler.params.warmup_min_lr", 0, "always 0"),
        ("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate"),
        ("fp16.enabled", args.dtype == "fp16", f"--fp16 {'on' if args.dtype == 'fp16' else 'off'}"),
        ("bf16.enabled", args.dtype == "bf16", f"--bf16 {'on' if args.dtype == 'bf16' else 'off'}"),
        ("zero_optimization.reduce_bucket_size", h * h, f"hidden_size {h} ** 2"),
    ]
    if zero3:
        plan += [("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * h * h), f"0.9 x hidden_size {h} ** 2"),
                 ("zero_optimization.stage3_param_persistence_threshold", 10 * h, f"10 x hidden_size {h}")]
    return plan + [
        ("scheduler.params.total_num_steps", args.num_training_steps, "num_training_steps"),
        ("scheduler.params.warmup_num_steps", max(1, args.warmup_steps), "max(1, warmup_steps)"),
    ]


def fill_hf_auto(raw: dict[str, Any], args: TrainerArgs) -> tuple[dict[str, Any], list[Filled]]:
    """A copy of `raw` with every "auto" the Hugging Face Trainer fills replaced by its value, and
    what was filled. "auto" the Trainer leaves (a key it does not fill) stays for load_config to
    report; below stage 3 that includes the stage3_ keys, which load_config drops as DeepSpeed does."""
    filled_raw = copy.deepcopy(raw)
    zero = filled_raw.get("zero_optimization")
    zero3 = isinstance(zero, dict) and zero.get("stage") == 3
    filled: list[Filled] = []
    for path, value, source in _plan(args, zero3):
        *parents, leaf = path.split(".")
        node: Any = filled_raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) == "auto":
            node[leaf] = value
            filled.append(Filled(path, value, source))
    return filled_raw, filled


def trainer_mismatches(raw: dict[str, Any], args: TrainerArgs, paths: set[str]) -> list[str]:
    """The Trainer's refusals among `paths`: a key set to a value (not "auto") that differs from the
    TrainingArguments value it would fill, which transformers reports as "DeepSpeed config values
    that mismatch TrainingArguments values" and refuses."""
    zero = raw.get("zero_optimization")
    problems = []
    for path, value, source in _plan(args, isinstance(zero, dict) and zero.get("stage") == 3):
        node: Any = raw
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if path in paths and node is not None and node != "auto" and node != value:
            problems.append(f"{path}: {show_value(node)}, but the Trainer's {source} gives {show_value(value)}; "
                            'the Hugging Face Trainer refuses the mismatch: set it to "auto" or change the argument')
    return problems


AUTO_IS_A_VALUE = frozenset({"data_types.keep_in_fp32_modules"})
"""Keys whose value "auto" is a real DeepSpeed value, not a Hugging Face placeholder."""


def holds_auto(value: Any, path: str = "") -> bool:
    """Whether a Hugging Face "auto" appears anywhere in `value` (a config dict, list or scalar) at
    dotted `path`; "auto" at a key of AUTO_IS_A_VALUE is DeepSpeed's own value, not a placeholder."""
    if value == "auto":
        return path not in AUTO_IS_A_VALUE
    if isinstance(value, dict):
        return any(holds_auto(item, f"{path}.{key}" if path else str(key)) for key, item in value.items())
    return isinstance(value, list) and any(holds_auto(item, path) for item in value)

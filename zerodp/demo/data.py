"""A synthetic sequence task that a small model learns visibly within ~100-200 optimizer steps.

Each sample is a random prefix of `k = seq_len // 2` content tokens, a separator, then the prefix
again (task "copy") or reversed (task "reverse"):

    x = [a_1 ... a_k, SEP, b_1 ... b_k]          b = a (copy) or b = reversed(a) (reverse)
    idx     = x[:-1]                             length 2k (= seq_len when seq_len is even)
    targets = x[1:], with -100 wherever the next token is not predictable

Only the k tokens after the separator are predictable, so the loss (mean over those) starts at
about ln(vocab_size) and falls towards 0 as the model learns to attend back to the prefix.
Content tokens are drawn from [1, vocab_size); token 0 is the separator.

Sample i is generated from (seed, i) alone, so every rank and every sampler sees the same data.
"""

from __future__ import annotations

import math
import random

import torch
from torch.utils.data import Dataset

from zerodp.demo.model import IGNORE_INDEX

SEPARATOR = 0
"""Token id that separates the prefix from its copy; never a content token."""

TASKS = ("copy", "reverse")

# Per-sample seed = seed * _SEED_STRIDE + index, distinct for every (seed, index) with index below
# 2**32. It seeds Python's random.Random, which uses every bit of an int seed; torch.Generator's
# CPU generator keeps only the low 32 bits, so it would give seeds 7 and 8 the same data.
_SEED_STRIDE = 2**32


class SyntheticTaskDataset(Dataset):
    """`(idx, targets)` pairs of LongTensors of shape (seq_len,) for the copy / reverse task.

    Args:
        num_samples: length of the dataset.
        seq_len: model input length; the prefix has seq_len // 2 tokens (an odd seq_len is padded
            with one trailing separator that is never a target).
        vocab_size: token ids lie in [0, vocab_size); needs at least 3 (separator + 2 contents).
        seed: selects the data; sample i depends only on (seed, i).
        task: "copy" (default) or "reverse".
    """

    def __init__(
        self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0, task: str = "copy"
    ) -> None:
        problems = []
        if num_samples < 1:
            problems.append(f"num_samples={num_samples} must be >= 1")
        if seq_len < 2:
            problems.append(f"seq_len={seq_len} must be >= 2 (a prefix and its copy)")
        if vocab_size < 3:
            problems.append(f"vocab_size={vocab_size} must be >= 3 (separator + 2 content tokens)")
        if num_samples > _SEED_STRIDE:
            problems.append(f"num_samples={num_samples} must be <= 2**32")
        if seed < 0:
            problems.append(f"seed={seed} must be >= 0")
        if task not in TASKS:
            problems.append(f"task={task!r} must be one of {TASKS}")
        if problems:
            raise ValueError("invalid SyntheticTaskDataset: " + "; ".join(problems))
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.task = task
        self.prefix_len = seq_len // 2

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        index %= self.num_samples
        rng = random.Random(self.seed * _SEED_STRIDE + index)
        prefix = torch.tensor([rng.randrange(1, self.vocab_size) for _ in range(self.prefix_len)])
        answer = prefix if self.task == "copy" else prefix.flip(0)
        sep = torch.tensor([SEPARATOR])
        pad = torch.full((self.seq_len - 2 * self.prefix_len,), SEPARATOR)  # odd seq_len: one
        sequence = torch.cat([prefix, sep, answer, pad])
        idx = sequence[:-1].clone()
        targets = sequence[1:].clone()
        # Position t predicts sequence[t + 1]; only the answer tokens, which follow the separator
        # at position prefix_len, are predictable.
        targets[: self.prefix_len] = IGNORE_INDEX
        targets[2 * self.prefix_len :] = IGNORE_INDEX
        return idx, targets

    def describe(self) -> str:
        """One line for the demo's header: "copy task: 16 random tokens from a vocabulary of
        63, a separator, then the same tokens; the loss covers ..."."""
        what = "the same tokens" if self.task == "copy" else "them reversed"
        return (
            f"{self.task} task: {self.prefix_len} random tokens from a vocabulary of "
            f"{self.vocab_size - 1}, a separator, then {what}; the loss covers the "
            f"{self.prefix_len} answer tokens (chance level ln({self.vocab_size - 1}) = "
            f"{math.log(self.vocab_size - 1):.2f}), {self.num_samples:,} samples, seed {self.seed}"
        )


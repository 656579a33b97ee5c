"""Pure partition arithmetic shared by every strategy, the checkpoint resharder and the estimator.

Numbers in, numbers out: no tensors, no process group. Stage 0 uses the flat-buffer offsets and
the bucket assignment; the sharded stages add owned ranges on top of the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class Bucket:
    """A run of consecutive entries [first, last) of a flat buffer covering elements [start, stop)."""

    first: int
    last: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def flat_offsets(numels: list[int]) -> list[int]:
    """Start offset of each entry when `numels` are packed back to back (no padding)."""
    return [0, *accumulate(numels)][:-1]


def assign_buckets(numels: list[int], bucket_numel: int) -> list[Bucket]:
    """Group consecutive entries into buckets of at most `bucket_numel` elements.

    An entry larger than the bucket size gets a bucket of its own; empty entries join the current
    bucket. Every entry is in exactly one bucket, in order.
    """
    if bucket_numel <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_numel}")
    buckets: list[Bucket] = []
    first, start, size = 0, 0, 0
    for i, n in enumerate(numels):
        if size > 0 and size + n > bucket_numel:
            buckets.append(Bucket(first, i, start, start + size))
            first, start, size = i, start + size, 0
        size += n
    if numels:
        buckets.append(Bucket(first, len(numels), start, start + size))
    return buckets

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


DDP_FIRST_BUCKET_BYTES = 1024 * 1024
"""torch DDP's first bucket after its rebuild (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`)."""

DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""torch DDP's other buckets (`bucket_cap_mb=25`, its default)."""


def assign_buckets_like_ddp(numels: list[int], element_size: int,
                            limits_bytes: tuple[int, ...] = (DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES)) -> list[Bucket]:
    """Group consecutive entries into buckets by torch DDP's rule (its C++
    `compute_bucket_assignment_by_size` for one dtype): add an entry, then close the bucket once it
    holds at least the current limit; the limit moves to the next of `limits_bytes` after each closed
    bucket and stays at the last one. `element_size`: bytes per element. Default limits: DDP's
    rebuilt buckets (1 MiB, then 25 MiB). See stage0.py's [Note: stage-0 bucket sizes].
    """
    if element_size <= 0 or not limits_bytes or min(limits_bytes) <= 0:
        raise ValueError(f"element size and bucket limits must be positive, got {element_size} and {limits_bytes}")
    buckets: list[Bucket] = []
    first, start, size, limit = 0, 0, 0, 0
    for i, n in enumerate(numels):
        size += n
        if size * element_size >= limits_bytes[limit]:
            buckets.append(Bucket(first, i + 1, start, start + size))
            first, start, size, limit = i + 1, start + size, 0, min(limit + 1, len(limits_bytes) - 1)
    if first < len(numels):
        buckets.append(Bucket(first, len(numels), start, start + size))
    return buckets


# ---------------------------------------------------------------------------------------------
# flat groups and owned shards (stages 1-3, the checkpoint resharder, the estimator)


@dataclass(frozen=True)
class ParamSlice:
    """Elements [param_offset, param_offset + numel) of parameter `index`, which sit at
    [flat_offset, flat_offset + numel) of its group's flat buffer."""

    index: int
    param_offset: int
    flat_offset: int
    numel: int


@dataclass(frozen=True)
class GroupLayout:
    """One param group flattened: parameter i occupies [offsets[i], offsets[i] + numels[i]) of a flat
    buffer of `padded_numel` elements, cut into `num_ranks` equal owned shards. Padding (alignment
    gaps and the tail) belongs to no parameter and stays zero."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    padded_numel: int
    num_ranks: int

    @property
    def numel(self) -> int:
        """Elements that belong to parameters (padding excluded)."""
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        """Elements of every rank's owned shard (padding included)."""
        return self.padded_numel // self.num_ranks

    def owned_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the flat buffer that `rank` owns."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} is outside 0..{self.num_ranks - 1}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def owned_slice(self, index: int, rank: int) -> ParamSlice:
        """The part of parameter `index` inside `rank`'s owned shard (numel 0 when it owns none of
        it): the tensor-fragment API's "local" piece (zero/fragments.py)."""
        offset, numel = self.offsets[index], self.numels[index]
        start, stop = self.owned_range(rank)
        lo, hi = max(start, offset), min(stop, offset + numel)
        if lo >= hi:  # none of it: an empty piece at the start of the shard
            return ParamSlice(index, 0, start, 0)
        return ParamSlice(index, lo - offset, lo, hi - lo)

    def slices_in(self, start: int, stop: int) -> list[ParamSlice]:
        """The pieces of parameters inside flat range [start, stop), in flat order."""
        pieces = []
        for i, (offset, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi:
                pieces.append(ParamSlice(i, lo - offset, lo, hi - lo))
        return pieces


def group_layout(numels: list[int], num_ranks: int, alignment: int = 1) -> GroupLayout:
    """Flatten parameters of `numels` elements in order, each starting at a multiple of
    `alignment` elements, and pad the total to a multiple of `num_ranks` (at most num_ranks - 1
    tail elements, plus alignment gaps)."""
    if num_ranks < 1 or alignment < 1:
        raise ValueError(f"num_ranks ({num_ranks}) and alignment ({alignment}) must be positive")
    offsets, position = [], 0
    for n in numels:
        position = -(-position // alignment) * alignment
        offsets.append(position)
        position += n
    padded = -(-position // num_ranks) * num_ranks
    return GroupLayout(tuple(numels), tuple(offsets), padded, num_ranks)


def owner_pieces(start: int, stop: int, shard_numel: int) -> list[tuple[int, int, int]]:
    """Split flat range [start, stop) by owner: (rank, piece_start, piece_stop) in order."""
    pieces = []
    while start < stop:
        rank = start // shard_numel
        piece_stop = min(stop, (rank + 1) * shard_numel)
        pieces.append((rank, start, piece_stop))
        start = piece_stop
    return pieces

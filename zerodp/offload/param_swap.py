"""The parameter swapper: stage 3's parameter shards on NVMe (`offload_param.device: nvme`).

Beside the optimizer swapper (offload/swap.py) this holds the tier mechanics of parameter offload;
stage 3 decides which unit needs which shard when (zero/stage3.py, zero/stage3_hooks.py).

[Note: parameter shards on NVMe]
Each unit's owned parameter shard becomes a `SwapSlot` in the parameter `SwapStore`, except the
first `offload_param.max_in_cpu` elements, which stay in host memory. A swapped shard is read just
before its unit's all-gather (or earlier: read-ahead, at most `buffer_count` shards and
`buffer_count` x `buffer_size` elements at once, DeepSpeed's parameter buffer pool) and freed when
the gather completes. After the optimizer step each updated shard is written back in the
background while the step goes on, at most SHARD_WRITES_IN_FLIGHT of them resident at once.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from zerodp.offload.nvme import SwapStore
from zerodp.offload.swap import SwapSlot

SHARD_WRITES_IN_FLIGHT = 2
"""Updated shards being written back during the step at once."""


class ParamSwapper:
    """Places stage-3 parameter shards in host memory or swap files and writes them back after a step."""

    def __init__(self, store: SwapStore, max_in_cpu: int, buffer_count: int, buffer_size: int) -> None:
        self.store = store
        self.max_in_cpu = max_in_cpu  # offload_param.max_in_cpu: shard elements that stay in host memory
        self.numel_in_cpu = 0  # of those, placed so far
        self.buffer_count, self.buffer_size = buffer_count, buffer_size  # the read-ahead buffer pool
        self._writes: list = []  # shard write-backs of the step in flight

    def place(self, name: str, shard: torch.Tensor) -> SwapSlot | None:
        """Keep `shard` in host memory while offload_param.max_in_cpu allows (None), else write it to
        swap region `name`, free it and return its slot."""
        if self.numel_in_cpu + shard.numel() <= self.max_in_cpu:
            self.numel_in_cpu += shard.numel()
            return None
        slot = SwapSlot(self.store, name, shard)
        slot.write().wait()
        slot.evict()
        return slot

    def write_back(self, slot: SwapSlot, fill: Callable[[], None]) -> None:
        """Give the slot's shard memory, `fill` it (the updated values) and write it back in the
        background; waits for the oldest write while more than SHARD_WRITES_IN_FLIGHT are in flight."""
        slot.allocate_storage()
        fill()
        self._writes.append(slot.write_then_evict())
        while len(self._writes) > SHARD_WRITES_IN_FLIGHT:
            self._writes.pop(0).wait()

    def finish_writes(self) -> None:
        """Wait for every write-back in flight (the end of a step or a load)."""
        while self._writes:
            self._writes.pop(0).wait()

    def read_ahead_room(self, reading_numels: list[int]) -> tuple[int, int]:
        """(shards, elements) that may still be read ahead, given the elements of each shard group
        being read ahead now (one entry per unit)."""
        return (self.buffer_count - len(reading_numels),
                self.buffer_count * self.buffer_size - sum(reading_numels))


@contextmanager
def resident(slot: SwapSlot | None, modify: bool = False, overwrite: bool = False) -> Iterator[None]:
    """The slot's shard in memory inside the block (nothing to do without a slot); `overwrite` skips
    the read when every element will be written; written back on exit if `modify`."""
    if slot is None:
        yield
        return
    if overwrite:
        slot.allocate_storage()
    else:
        slot.read().wait()
    try:
        yield
    finally:
        if modify:
            slot.write().wait()
        slot.evict()

"""NVMe offload at stage 3 (ZeRO-Infinity): optimizer state (`offload_optimizer.device: nvme`) and
parameter shards (`offload_param.device: nvme`) in swap files.

[Note: NVMe offload]
Each stage-3 unit's fp32 master shard and its optimizer state (Adam: exp_avg, exp_avg_sq) are one
swap chunk in a `SwapStore` under `nvme_path`. Between steps none of it is in memory: the tensors
keep their Python objects (the optimizer's params are views of the master, its state is keyed by
them) but their storage is resized to 0, as stage 3 releases gathered units. The step walks the
units through `run_swap_pipeline`: read unit i+1's chunk while unit i steps on the CPU (torch's
optimizer, only unit i's params have a .grad) and unit i-1's chunk is written back and freed, so
at most `buffer_count` chunks are resident. The first step creates the optimizer state; it is
given swap space as it appears. Checkpoints and GatheredParameters edits bring chunks in through
`resident_chunk(i)`, one at a time (a checkpoint writes or reads one file per chunk).
With `offload_param.device: nvme`, each unit's owned parameter shard is a `SwapSlot` too (beyond
the first `max_in_cpu` elements, which stay in host memory): read just before the unit's
all-gather, freed when the gather completes, rewritten after the step.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator, Sequence

import torch

from zerodp.memory import CPU, NVME, Category, MemoryLedger, optimizer_state_tensors
from zerodp.offload.aio import ALIGN_BYTES, AsyncFileIO, run_swap_pipeline
from zerodp.offload.nvme import SwapStore


CHUNK_ALIGN_NUMEL = 512
"""NVMe swap chunks start at multiples of this many elements. torch's fused CPU optimizers compute
the elements of a tensor's last partial SIMD vector in a separate tail loop whose rounding can
differ (measured: AdamW, 16-float AVX-512 vectors, chunks of 100,003 elements changed one element
in 800K after 2 steps, and diverged further), so a chunk boundary inside a vector made NVMe offload
differ from CPU offload; 512 covers any vector width and unroll."""


def swap_chunk_numel(sub_group_size: int) -> int:
    """`sub_group_size` rounded down to a multiple of CHUNK_ALIGN_NUMEL (at least one multiple)."""
    return max(CHUNK_ALIGN_NUMEL, sub_group_size // CHUNK_ALIGN_NUMEL * CHUNK_ALIGN_NUMEL)


class SwapSlot:
    """One contiguous CPU tensor whose bytes live in `store` region `name` while evicted.

    [Note: aligned swap-ins]
    The tensor keeps its storage object while evicted (resized to 0), so views of it (stage 3's
    optimizer params are views of a unit's master) stay valid. torch's CPU allocator aligns a
    resized storage to 64 bytes only, and O_DIRECT then goes through a bounce buffer (one memmove
    per block, on the CPU that also runs the step; on this machine a 2 GiB read of just-written
    data ran at 1.2 GB/s bounced against 2.7 GB/s in place, though the disk's sustained rate is
    about 1.2 GB/s either way). So a swap-in allocates ALIGN_BYTES more and moves the tensor and its
    `views` (as_strided_, same sizes and strides) to the first aligned address: every full block
    is read and written in place.
    """

    def __init__(self, store: SwapStore, name: str, tensor: torch.Tensor, views: Sequence[torch.Tensor] = ()) -> None:
        self.store, self.name = store, name
        self.num_bytes = tensor.numel() * tensor.element_size()
        self._views = [(v, v.storage_offset() - tensor.storage_offset()) for v in views]
        self.tensor = tensor
        store.allocate(name, tensor.numel(), tensor.dtype)

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    @tensor.setter
    def tensor(self, tensor: torch.Tensor) -> None:
        if getattr(self, "_tensor", None) is not tensor:  # the same one may be shifted already
            self._tensor = tensor
            self._base_offset = tensor.storage_offset()

    def allocate_storage(self) -> None:
        """Give the tensor its storage back, data aligned to ALIGN_BYTES (contents undefined until
        read or overwritten)."""
        storage = self.tensor.untyped_storage()
        if storage.size() != 0:
            return
        storage.resize_(self._base_offset * self.tensor.element_size() + self.num_bytes + ALIGN_BYTES)
        base = storage.data_ptr() + self._base_offset * self.tensor.element_size()
        shift = (-base) % ALIGN_BYTES // self.tensor.element_size()
        t = self.tensor
        t.as_strided_(t.size(), t.stride(), self._base_offset + shift)
        for view, relative in self._views:
            view.as_strided_(view.size(), view.stride(), t.storage_offset() + relative)

    def read(self):
        """Give the tensor its storage back and start reading its bytes into it."""
        self.allocate_storage()
        return self.store.read(self.name, self.tensor)

    def write(self):
        return self.store.write(self.name, self.tensor)

    def evict(self) -> None:
        self.tensor.untyped_storage().resize_(0)

    def write_then_evict(self) -> "_Handles":
        """Start writing; the handle's wait() waits and then frees the tensor's memory."""
        return _Handles([self.write()], then=self.evict)


class _Handles:
    """Several I/O handles waited as one, then `then()` (evict what was written)."""

    def __init__(self, handles: list, then: Callable[[], None] | None = None) -> None:
        self.handles, self.then = handles, then

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
        if self.then is not None:
            self.then()
            self.then = None


class OptimizerSwapper:
    """Per chunk (a unit): its fp32 master and the optimizer's state for the params that are views
    of it, kept in `store` between uses."""

    def __init__(self, store: SwapStore, optimizer: torch.optim.Optimizer,
                 chunks: list[tuple[str, SwapSlot, list[torch.Tensor]]], buffer_count: int) -> None:
        """`chunks`: (name, the slot of an fp32 master already written and evicted, the optimizer
        params that are views of that master)."""
        self.store, self.optimizer, self.buffer_count = store, optimizer, max(1, buffer_count)
        self.chunks = chunks
        self.slots: list[dict[str, SwapSlot]] = [{"master": slot} for _, slot, _ in chunks]

    def _state(self, i: int) -> dict[str, torch.Tensor]:
        """Chunk i's element-wise optimizer state tensors by slot name (none before the first step)."""
        out = {}
        for j, view in enumerate(self.chunks[i][2]):
            for key, value in self.optimizer.state.get(view, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    out[f"{j}/{key}"] = value
        return out

    def _sync_slots(self, i: int) -> None:
        """Point chunk i's slots at the optimizer's current state tensors (new ones after the first
        step or a checkpoint load get swap space)."""
        name = self.chunks[i][0]
        for key, tensor in self._state(i).items():
            slot = self.slots[i].get(key)
            if slot is None:
                self.slots[i][key] = SwapSlot(self.store, f"{name}/{key}", tensor.contiguous())
            else:
                slot.tensor = tensor

    def _read(self, i: int) -> _Handles:
        return _Handles([slot.read() for slot in self.slots[i].values()])

    def _write_and_evict(self, i: int) -> _Handles:
        self._sync_slots(i)
        slots = list(self.slots[i].values())
        return _Handles([slot.write() for slot in slots], then=lambda: [slot.evict() for slot in slots])

    def step(self, compute: Callable[[int], None]) -> None:
        """Run compute(i) (set grads, optimizer.step(), publish) for every chunk, pipelined."""
        run_swap_pipeline(len(self.chunks), self._read, compute, self._write_and_evict,
                          buffer_count=self.buffer_count)

    @contextmanager
    def resident_chunk(self, i: int, modify: bool = True) -> Iterator[None]:
        """Chunk i in memory inside the block; freed on exit, and written back first if `modify`
        (pass False only when the block neither changes nor creates state)."""
        self._read(i).wait()
        try:
            yield
        finally:
            if modify:
                self._write_and_evict(i).wait()
            else:
                for slot in self.slots[i].values():
                    slot.evict()

    def resident_pieces(self, pieces_of: Callable[[int], list],
                        saving: bool) -> Iterator[tuple[list[torch.Tensor], Callable]]:
        """Strategy.resident_pieces over the chunks: chunk i's optimizer tensors and its pieces
        (`pieces_of(i)`) while it is in memory; written back when the next is asked for unless `saving`."""
        for i in range(len(self.chunks)):
            with self.resident_chunk(i, modify=not saving):
                yield self.chunks[i][2], partial(pieces_of, i)

    def layout(self) -> dict:
        """The swap chunks, for the offload diagnosis: `chunks`, `elements` (all the masters'),
        `largest_chunk` (elements) and `buffer_count`."""
        numels = [s["master"].num_bytes // s["master"].tensor.element_size() for s in self.slots]
        return {"chunks": len(numels), "elements": sum(numels), "largest_chunk": max(numels, default=0),
                "buffer_count": self.buffer_count}

    def nvme_bytes(self) -> tuple[int, int]:
        """(master bytes, optimizer state bytes) held in the swap file."""
        master = sum(s["master"].num_bytes for s in self.slots)
        state = sum(slot.num_bytes for s in self.slots for key, slot in s.items() if key != "master")
        return master, state


def swap_store(section, key: str, aio) -> SwapStore | None:
    """A swap store under the section's nvme_path when its device is nvme (space was checked by
    zerodp.offload.cpu.preflight_offload before any rank communicated)."""
    if section is None or section.device != "nvme":
        return None
    return SwapStore(section.nvme_path, key=key, engine=AsyncFileIO.from_aio_config(aio))


def add_optimizer_state(led: MemoryLedger, optimizer: torch.optim.Optimizer, tier: str,
                        swapper: OptimizerSwapper | None) -> None:
    """The ledger's optimizer-state lines: its tensors in `tier`; or, kept in swap files by
    `swapper`, the masters' and the state's bytes in the nvme tier and the scalar state (Adam's
    step) in host memory."""
    if swapper is None:
        led.add(Category.OPTIM_STATE, optimizer_state_tensors(optimizer), tier)
        return
    master_bytes, state_bytes = swapper.nvme_bytes()
    led.add_bytes(Category.PARAM32_MASTER, NVME, master_bytes)
    led.add_bytes(Category.OPTIM_STATE, NVME, state_bytes)
    led.add(Category.OPTIM_STATE, [t for t in optimizer_state_tensors(optimizer) if t.dim() == 0], CPU)

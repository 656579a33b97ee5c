"""Park tensors' storages in host memory and bring them back: `engine.offload_states()` / `reload_states()`.

[Note: parking storages]
RLHF loops free the device between phases (generation, then training): the engine's flat buffers,
masters, gradients and optimizer state leave the device and come back unchanged. Parameters and
optimizer state are views into a few flat buffers, and the strategies, the optimizer and the
module all hold such views, so moving tensors (`t.data = t.cpu()`) would leave every other view on
the old memory. Instead each distinct *storage* is copied to a host buffer and resized to 0 bytes,
which frees its device memory while every tensor viewing it stays the same Python object; restoring
resizes it back and copies the bytes in, so every view sees its old values at its old offsets. A
storage is parked once however many tensors view it. The same code runs on a CPU-only machine,
where it frees the storage and keeps a copy, so the tests exercise the path a GPU takes.

A storage torch does not own (not resizable: a safetensors file that `from_pretrained` maps into
host memory when the weights need no cast or move, as a QLoRA model's frozen embedding and norms on a
CPU-only machine; memory imported through DLPack; a CPU tensor once shared with numpy by `.numpy()`, which
makes its storage fixed for good) cannot be freed by resizing. It stays where it is,
values intact, counted where it was, and a warning says how many bytes stayed (a host copy
would free nothing). On a GPU, `from_pretrained` copies the weights to the device, so this is the
CPU case in practice.
"""

from __future__ import annotations

from typing import Iterable

import torch

from zerodp.log import logger


class ParkedStorages:
    """Storages moved to host memory by `park`, restored by `restore` (see [Note: parking storages])."""

    def __init__(self) -> None:
        self._parked: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}  # id -> (storage, host copy)

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, tensors: Iterable[torch.Tensor], pin_memory: bool = True, non_blocking: bool = False) -> int:
        """Move the storages of `tensors` (those not parked already, and not empty) to host memory;
        returns the bytes moved. `pin_memory`: page-locked host buffers (CUDA only)."""
        moved, kept = 0, 0
        for storage in _distinct_storages(tensors):
            key = storage._cdata
            if key in self._parked or storage.nbytes() == 0:
                continue
            if not storage.resizable():  # memory torch does not own: see [Note: parking storages]
                kept += storage.nbytes()
                continue
            source = _bytes_of(storage)
            pin = pin_memory and storage.device.type == "cuda"
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(source, non_blocking=non_blocking and pin)
            if source.device.type == "cuda" and not (non_blocking and pin):
                torch.cuda.current_stream(source.device).synchronize()
            storage.resize_(0)
            self._parked[key] = (storage, host)
            moved += host.numel()
        if kept:
            logger.warning("offload_states: %d bytes stay where they are: their storage is not torch's to free "
                           "(a file mapped into memory by from_pretrained, memory imported through DLPack or shared "
                           "with numpy)", kept)
        return moved

    def restore(self, non_blocking: bool = False) -> int:
        """Bring every parked storage back to where it was; returns the bytes moved."""
        moved = 0
        for storage, host in self._parked.values():
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=non_blocking and host.is_pinned())
            moved += host.numel()
        self._parked.clear()
        return moved


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage._cdata, storage)
    return list(seen.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

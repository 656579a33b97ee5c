"""The sampler behind `initialize(training_data=...)`: DistributedSampler that can resume mid-epoch."""

from __future__ import annotations

from typing import Iterator

from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that counts the indices it has handed out in the current epoch, so a
    checkpoint can record the position and a resumed run skips exactly what was already seen.

    The count is exact when the DataLoader has no worker processes (the default of
    `initialize`'s loader); workers prefetch, which makes the count run ahead by up to
    `num_workers x prefetch_factor` batches.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_yielded = 0  # indices handed out in this epoch
        self._resume_at = 0  # indices to skip at the next __iter__ of epoch _resume_epoch
        self._resume_epoch = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start = self._resume_at if self.epoch == self._resume_epoch else 0
        self._resume_at = 0
        self.num_yielded = start
        for index in indices[start:]:
            self.num_yielded += 1
            yield index

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (a new shuffle): from its beginning, or, right after a checkpoint
        load, from where the saved run stopped if `epoch` is the saved one."""
        super().set_epoch(epoch)
        self.num_yielded = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "num_yielded": self.num_yielded, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """The next iteration continues epoch `epoch` after the samples the saved run's ranks had seen.

        Rank r of R ranks reads positions r, r + R, r + 2R, ... of the epoch's one permutation (the same
        at any world size: only the tail padding to a multiple of R differs), so `num_yielded` indices on
        each of the saved `num_replicas` ranks are the first num_yielded x num_replicas positions. At
        another world size each rank skips that many positions divided by its own count, rounded down: a
        resume replays at most (this world size - 1) samples, never skips one. (A state without
        `num_replicas`, saved before it was recorded, is taken as this world size's.)"""
        self.epoch = self._resume_epoch = state["epoch"]
        seen = state["num_yielded"] * state.get("num_replicas", self.num_replicas)
        self._resume_at = seen // self.num_replicas

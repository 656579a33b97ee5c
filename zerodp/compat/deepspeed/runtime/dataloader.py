"""`deepspeed.runtime.dataloader` (also `deepspeed.utils.RepeatingLoader`): a loader that starts over."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from zerodp.compat.deepspeed._missing import missing_attributes


class RepeatingLoader:
    """Iterate `loader` forever: when it is exhausted, a new pass over it begins (DeepSpeed's
    `RepeatingLoader(loader)`, what pipeline-style loops hand to `engine.train_batch(data_iter=...)`
    and scripts use to run a fixed number of steps). A DataLoader with a DistributedSampler keeps its
    epoch: call `loader.sampler.set_epoch(e)` yourself to reshuffle, as with DeepSpeed."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.data_iter: Iterator = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            try:
                return next(self.data_iter)
            except StopIteration:  # a second empty pass would loop forever
                raise ValueError("RepeatingLoader: the loader yields no batch at all (an empty dataset, or "
                                 "drop_last with fewer samples than one batch)") from None


__all__ = ["RepeatingLoader"]
__getattr__ = missing_attributes(__name__)

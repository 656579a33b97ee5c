"""Reduce buckets launched in one fixed order while backward runs (stages 0 and 2).

[Note: bucket order]
Gradients become final in an order that can differ between ranks (data-dependent branches,
parameters unused on one rank). Collectives must not: every rank issues bucket k's collective only
after buckets 0..k-1, so ranks always pair up the same collectives. A bucket whose gradients are all
final but whose predecessors are not waits (READY); at the end of backward the ones still FILLING
(parameters this backward did not use) are launched too, with the gradients they have.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable


class BucketState(Enum):
    """Where a reduce bucket is within one backward."""

    FILLING = "filling"  # some of its gradients are not final yet
    READY = "ready"  # all final, waiting for earlier buckets to launch first
    REDUCING = "reducing"  # its collective is in flight


class BucketSequence:
    """`num_grads[k]` gradients per bucket; `launch(k)` starts bucket k's collective."""

    def __init__(self, num_grads: list[int], launch: Callable[[int], None]) -> None:
        self.num_grads = num_grads
        self.launch = launch
        self.reset()

    def reset(self) -> None:
        """Start a new backward: every bucket FILLING again."""
        self.state = [BucketState.FILLING] * len(self.num_grads)
        self.num_pending = list(self.num_grads)
        self.next_bucket = 0

    def grad_ready(self, k: int, name: str) -> None:
        """One gradient of bucket k is final; launch whatever the order allows."""
        if self.state[k] is not BucketState.FILLING:
            raise RuntimeError(
                f"gradient of '{name}' was produced twice in one backward after its bucket was reduced; this "
                "happens with reentrant activation checkpointing, whose recomputation runs a backward inside the "
                "backward. Use non-reentrant checkpointing (zerodp.checkpointing, or torch.utils.checkpoint(..., "
                "use_reentrant=False))."
            )
        self.num_pending[k] -= 1
        if self.num_pending[k] == 0:
            self.state[k] = BucketState.READY
            self.launch_in_order()

    def launch_in_order(self, force: bool = False) -> None:
        """Launch READY buckets from the next one on, in order; `force` launches FILLING ones too."""
        while self.next_bucket < len(self.state):
            k = self.next_bucket
            if not (force or self.state[k] is BucketState.READY):
                return
            self.launch(k)
            self.state[k] = BucketState.REDUCING
            self.next_bucket += 1

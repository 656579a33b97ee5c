"""ShardState: everything checkpoint/ reads and writes for one rank, in one object.

The engine builds one per save or load (`engine.shard_state()`); zerodp/checkpoint/ takes it instead
of the engine, so the checkpoint code sees the strategy's pieces API, the loop's counters, the loss
scaler, the schedule, the data sampler and the few config values a checkpoint records, and nothing
else of the engine. The pieces API stays on the Strategy (pieces, piece_index, resident_pieces, ...):
ShardState forwards to it, so a strategy is one class and the checkpoint has one door.

[Note: what a ShardState holds]
    strategy        the Strategy: pieces, piece index, resident batches, layout state, full state
    module          the user's module (parameter names, shapes, tied aliases, buffers)
    optimizer       the optimizer over the strategy's tensors (param groups, scalar state)
    loss_scaler     precision.py's scaler (state_dict / load_state_dict)
    lr_scheduler    the schedule, or None
    sampler         the training data loader's sampler, or None (its position is saved when it has one)
    stage, precision, checkpoint_config   what meta.json records and how a save writes
    counters        global_steps, global_samples, skipped_steps, micro_steps at the time it was built
    restore_counters  puts loaded counters back into the engine
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from zerodp import comm
from zerodp.zero.base import Piece, Strategy

COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps", "micro_steps_in_step")
"""The engine's counters a checkpoint saves (engine.pt's "counters"), in this order (restored in it too:
micro_steps_in_step re-bases micro_steps on the restored global_steps; checkpoints written before it was
saved keep their micro_steps)."""


@dataclass
class ShardState:
    """One rank's training state as a checkpoint sees it ([Note: what a ShardState holds])."""

    strategy: Strategy
    module: nn.Module
    optimizer: torch.optim.Optimizer
    loss_scaler: Any
    lr_scheduler: Any
    sampler: Any
    stage: int
    precision: str
    checkpoint_config: Any
    counters: dict[str, int]
    restore_counters: Callable[[dict[str, int]], None]

    # --- the strategy's pieces API ----------------------------------------------------------------

    def piece_index(self, rank: int) -> list[tuple[str, int, int]]:
        """(name, offset, numel) of what `rank` saves (Strategy.piece_index)."""
        return self.strategy.piece_index(rank)

    def resident_pieces(self, saving: bool) -> Iterator[tuple[list[torch.Tensor], Callable[[], list[Piece]]]]:
        """This rank's pieces in batches that are in memory together (Strategy.resident_pieces)."""
        return self.strategy.resident_pieces(saving)

    def num_piece_batches(self) -> int:
        """How many batches `resident_pieces` yields (Strategy.num_piece_batches)."""
        return self.strategy.num_piece_batches()

    def trainable_numels(self) -> dict[str, int]:
        """Every trainable parameter's name and numel, from every rank's piece index."""
        totals: dict[str, int] = {}
        for r in range(comm.get_world_size()):
            for name, _, numel in self.piece_index(r):
                totals[name] = totals.get(name, 0) + numel
        return totals

    @property
    def optim_state_dtype(self) -> torch.dtype:
        """The dtype of element-wise optimizer state a load creates (bf16 masters may keep fp32 state)."""
        return self.strategy.policy.optim_state_dtype

    def after_load(self) -> None:
        """Make the working parameters equal the loaded masters on every rank (may communicate)."""
        self.strategy.after_load()

    def layout_state(self) -> dict | None:
        """The strategy's communication layout to keep (Strategy.layout_state)."""
        return self.strategy.layout_state()

    def load_layout_state(self, state: dict | None) -> None:
        """Restore what `layout_state` returned."""
        self.strategy.load_layout_state(state)

    def gathered_state_dict(self, keep: Callable[[str], bool] | None = None) -> dict:
        """Full tensors of the module's state dict (Strategy.gathered_state_dict; every rank calls)."""
        return self.strategy.gathered_state_dict(keep)

    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy full buffers and frozen parameters into the module (Strategy.load_full_state)."""
        self.strategy.load_full_state(state)

    # --- the loop's state -------------------------------------------------------------------------

    def sampler_state(self) -> dict | None:
        """The sampler's position, when it can tell it (zerodp.data's sampler can); else None."""
        return self.sampler.state_dict() if hasattr(self.sampler, "state_dict") else None

    def load_sampler_state(self, state: dict | None) -> None:
        """Put the sampler back at a saved position, when there is one and the sampler can take it."""
        if state is not None and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state)

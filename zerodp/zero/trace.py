"""The order stage-3 units run in, per pass: recorded, followed for prefetch, compared across ranks.

See stage3_hooks.py's [Note: prefetch and the recorded order].
"""

from __future__ import annotations

import hashlib

from zerodp.log import logger


class UnitTrace:
    """The order units ran in per phase ("forward", "backward"): recorded, then followed."""

    def __init__(self) -> None:
        self.recorded: dict[str, list[int] | None] = {"forward": None, "backward": None}
        self.current: dict[str, list[int]] = {"forward": [], "backward": []}
        self.following: dict[str, bool] = {"forward": False, "backward": False}
        self.history: list[int] = []  # this forward + backward, for the cross-rank check

    def begin(self, phase: str) -> None:
        self.current[phase] = []
        self.following[phase] = self.recorded[phase] is not None
        if phase == "forward":
            self.history = []

    def visit(self, phase: str, index: int) -> bool:
        """Record unit `index`; True while the pass still follows the recorded order."""
        current, recorded = self.current[phase], self.recorded[phase]
        position = len(current)
        current.append(index)
        self.history.append(index)
        if self.following[phase] and (position >= len(recorded) or recorded[position] != index):
            logger.debug("stage 3: the %s order changed at position %d; prefetch off until it is re-recorded",
                         phase, position)
            self.following[phase] = False
        return self.following[phase]

    def upcoming(self, phase: str) -> list[int]:
        recorded = self.recorded[phase]
        return recorded[len(self.current[phase]) :] if self.following[phase] and recorded else []

    def end(self, phase: str) -> None:
        if self.current[phase] != self.recorded[phase]:
            self.recorded[phase] = list(self.current[phase])

    def digest(self) -> int:
        raw = hashlib.blake2b(repr(self.history).encode(), digest_size=7).digest()
        return int.from_bytes(raw, "little")

    def describe(self, unit_names: list[str]) -> str:
        """This pass's units by name, for an error message."""
        names = [unit_names[i] for i in self.history]
        return " -> ".join(names[:40]) + (f" ... ({len(names)} in all)" if len(names) > 40 else "")

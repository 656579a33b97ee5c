"""The frameworks `zerodp compare` trains, the settings they share, and the parse of --frameworks."""

from __future__ import annotations

from dataclasses import dataclass

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}  # every framework's optimizer, clipping at 1.0
CATEGORIES = ("parameters", "gradients", "fp32 masters", "optimizer state", "other held", "transient")


@dataclass(frozen=True)
class Framework:
    """One way to train the model: its family ("ddp", "fsdp2", "deepspeed", "zerodp") and the ZeRO
    stage it amounts to (DDP 0; FSDP2 without resharding 2, with resharding 3)."""

    label: str
    family: str
    stage: int
    offload: bool = False
    checkpointing: bool = False

    @property
    def paper_volume(self) -> int:
        """Multiples of Psi the ZeRO paper counts per rank and step: 2, or 3 for stage 3."""
        return 3 if self.stage == 3 else 2


FRAMEWORKS = {
    "ddp": Framework("torch DDP", "ddp", 0),
    "fsdp2": Framework("FSDP2, reshard_after_forward=False", "fsdp2", 2),
    "fsdp2_3": Framework("FSDP2, reshard_after_forward=True", "fsdp2", 3),
    **{f"deepspeed{s}": Framework(f"DeepSpeed stage {s}", "deepspeed", s) for s in (1, 2, 3)},
    **{f"zerodp{s}": Framework(f"zerodp stage {s}", "zerodp", s) for s in (0, 1, 2, 3)},
    "zerodp2_offload": Framework("zerodp stage 2, optimizer offloaded to CPU", "zerodp", 2, offload=True),
    "zerodp2_ac": Framework("zerodp stage 2, blocks checkpointed", "zerodp", 2, checkpointing=True),
}


class CompareError(ValueError):
    """Bad input to `zerodp compare`, found before anything is launched."""


def parse_frameworks(text: str) -> list[str]:
    """The names in --frameworks' comma-separated `text`; CompareError naming the unknown ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        raise CompareError(f"--frameworks: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                           f"choose from {', '.join(FRAMEWORKS)}")
    return names

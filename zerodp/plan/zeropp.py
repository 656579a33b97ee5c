"""ZeRO++ in the estimator: quantized weight gathers (qwZ), quantized gradient reduces (qgZ) and hpZ's
secondary partition, as the stage-3 rows of `zerodp estimate` train them.

[Note: ZeRO++ in the estimate]
Nothing here computes a quantized collective's bytes. The keys go into the simulated rank's config
(zerodp/plan/simulate.py), so the runtime's own code runs them: zero/quantized_comm.py quantizes each
unit's shard into int8 blocks of zero/quantize.py's BLOCK_NUMEL (256) with one fp32 scale each, padding
and all, and the comm ledger counts the payload and the scales, each under its own dtype; the rows
carry that ledger (`comm_ops`), so the estimate is the runtime's count. The memory side is the model-state
arithmetic (zerodp/plan/model_states.py): hpZ's secondary copy (`param_secondary`) is the one model
state ZeRO++ adds; qwZ and qgZ add none (their int8 staging buffers live for one collective: in the
simulated peak, not in the ledger). With hpZ the simulated ledger counts bytes by link as if each
secondary group of S consecutive ranks were one node, which is what hpZ is for (DeepSpeed: S = the
GPUs per node).
The keys apply where the runtime reads them: stage 3 (below it DeepSpeed and zerodp ignore qwZ / qgZ,
and refuse hpZ), and hpZ not with parameter offload (refused by the runtime, so those rows are left out).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodp.plan.model_states import StrategySpec


@dataclass(frozen=True)
class ZeroPlusPlus:
    """Which ZeRO++ features the stage-3 rows use: DeepSpeed's zero_optimization keys
    zero_quantized_weights, zero_quantized_gradients and zero_hpz_partition_size (1: no hpZ)."""

    quantized_weights: bool = False
    quantized_gradients: bool = False
    hpz_partition_size: int = 1

    def __bool__(self) -> bool:
        return self.quantized_weights or self.quantized_gradients or self.hpz_partition_size > 1

    def trains(self, s: StrategySpec) -> bool:
        """Whether the runtime trains `s` with these keys (hpZ refuses offloaded parameters)."""
        return self.hpz_partition_size <= 1 or s.stage != 3 or s.offload_param == "none"

    def zero_keys(self, s: StrategySpec) -> dict:
        """The zero_optimization keys `s` runs with: these at stage 3, none below (see [Note: ZeRO++ in the
        estimate])."""
        if s.stage != 3:
            return {}
        keys: dict = {"zero_quantized_weights": True} if self.quantized_weights else {}
        keys.update({"zero_quantized_gradients": True} if self.quantized_gradients else {})
        return {**keys, "zero_hpz_partition_size": self.hpz_partition_size} if self.hpz_partition_size > 1 else keys

    def hpz(self, s: StrategySpec) -> int:
        """hpZ's secondary partition size for `s` (1: none)."""
        return self.hpz_partition_size if s.stage == 3 else 1

    def ranks_per_node(self, s: StrategySpec) -> int | None:
        """The node size the simulated ledger assumes for `s`: hpZ's S (None: one node)."""
        return self.hpz_partition_size if self.hpz(s) > 1 else None

    def describe(self) -> str:
        """'qwZ + qgZ + hpZ 8' for the table's note."""
        parts = ["qwZ"] * self.quantized_weights + ["qgZ"] * self.quantized_gradients
        return " + ".join(parts + [f"hpZ {self.hpz_partition_size}"] * (self.hpz_partition_size > 1))

    def problems(self, world_size: int | None) -> list[str]:
        """The flags' problems, naming each (the runtime's rules: hpZ's S divides the ranks)."""
        size = self.hpz_partition_size
        if size < 1:
            return [f"--zero-hpz-partition-size {size}: expected a number of ranks >= 1 (1: no hpZ)"]
        if world_size is not None and size > 1 and world_size % size:
            divisors = [d for d in range(2, world_size + 1) if world_size % d == 0]
            return [f"--zero-hpz-partition-size {size} does not divide --world-size {world_size}: hpZ's secondary "
                    f"groups hold S ranks each (the ranks per node); use one of {divisors or [1]}"]
        return []

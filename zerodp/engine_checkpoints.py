"""The Engine's checkpoints, as a mixin of the Engine: sharded saves and loads, and full 16-bit weights.

`save_checkpoint` / `load_checkpoint` / `wait_for_checkpoint` hand checkpoint/ a `ShardState` (what this
rank saves: zero/shard_state.py), never the engine; `save_16bit_model` and
`_zero3_consolidated_16bit_state_dict` write or return the full working-precision weights. They live
beside the engine so engine.py holds the loop (design.md §2), as DeepSpeed's accessors do in
engine_accessors.py.
"""

from __future__ import annotations

from zerodp import comm
from zerodp.log import log_rank0
from zerodp.zero.shard_state import COUNTERS, ShardState


class EngineCheckpoints:
    """Checkpoints of an Engine (`strategy`, `module`, `optimizer`, `loss_scaler`, `lr_scheduler`,
    `config`, `training_dataloader`, `async_saves`, `_async_save_default`, `comm_ledger`, the counters,
    `_check_resident` and `zero_optimization_stage()` are the engine's)."""

    def shard_state(self) -> ShardState:
        """What a checkpoint saves and loads for this rank: the strategy's pieces, the optimizer,
        scaler, schedule, sampler and counters (zerodp/zero/shard_state.py)."""
        loader = self.training_dataloader
        return ShardState(strategy=self.strategy, module=self.module, optimizer=self.optimizer,
                          loss_scaler=self.loss_scaler, lr_scheduler=self.lr_scheduler,
                          sampler=getattr(loader, "sampler", None),  # a loader of the user's may have none
                          stage=self.zero_optimization_stage(), precision=self.config.precision,
                          checkpoint_config=self.config.checkpoint,
                          counters={name: getattr(self, name) for name in COUNTERS},
                          restore_counters=self._restore_counters)

    def _restore_counters(self, counters: dict[str, int]) -> None:
        for name, value in counters.items():
            setattr(self, name, value)

    @comm.records_to_own_ledger
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: bool | None = None) -> bool:
        """Save a sharded, crash-safe checkpoint into `save_dir/tag` (default tag
        `global_step{N}`); call it on every rank. `async_save` (default: the config's
        checkpoint.async_save): copy the state to host memory and write it on a background thread
        while training continues (`wait_for_checkpoint()`). See docs/checkpoints.md."""
        from zerodp.checkpoint import save_checkpoint

        if async_save not in (None, True, False):
            raise ValueError(f"save_checkpoint(async_save={async_save!r}): expected True, False or None (the config's "
                             f"checkpoint.async_save, here {self._async_save_default})")
        self._check_resident("save_checkpoint")
        if self._async_save_default if async_save is None else async_save:
            return self.async_saves.save(self.shard_state(), save_dir, tag, client_state or {}, save_latest,
                                         exclude_frozen_parameters)
        self.async_saves.wait()  # the previous async save is published first
        return save_checkpoint(self.shard_state(), save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    @comm.records_to_own_ledger
    def wait_for_checkpoint(self) -> None:
        """Block until the last async save is durable and published (`latest` names it); a failed
        background write raises here, on every rank. Call it on every rank; no-op without one in flight."""
        self.async_saves.wait()

    @comm.records_to_own_ledger
    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """Load a checkpoint saved at any world size and ZeRO stage; returns (path, client_state)
        or (None, None) when `load_dir/latest` does not exist. Call it on every rank."""
        from zerodp.checkpoint import load_checkpoint

        self._check_resident("load_checkpoint")
        self.async_saves.wait()  # a save of this engine still being written is published first
        return load_checkpoint(self.shard_state(), load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only)

    def _frozen_names(self) -> set[str]:
        """State-dict names of the module's frozen parameters (tied aliases included)."""
        return {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    @comm.records_to_own_ledger
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The full 16-bit state dict of a stage-3 model on rank 0's host, gathered one unit at a time;
        None on the other ranks (DeepSpeed's method, which accelerate's `get_state_dict` calls). Call
        it on every rank. ValueError below stage 3."""
        if self.zero_optimization_stage() != 3:
            raise ValueError("_zero3_consolidated_16bit_state_dict() needs ZeRO stage 3 "
                             f"(this engine runs stage {self.zero_optimization_stage()}); use module.state_dict()")
        frozen = self._frozen_names()
        state = self.strategy.gathered_state_dict(keep=(lambda n: n not in frozen) if exclude_frozen_parameters else None)
        return state if comm.get_rank() == 0 else None

    @comm.records_to_own_ledger
    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the full working-precision weights to `save_dir/save_filename` from rank 0 (a
        `.safetensors` name writes safetensors, tied aliases once), and beside it a transformers model's
        config.json and generation_config.json; call it on every rank. At stage 3
        it needs `stage3_gather_16bit_weights_on_model_save` (parameters are gathered one unit at a
        time into rank 0's host memory). Returns True."""
        from pathlib import Path

        from zerodp.checkpoint.convert import save_full_weights, save_hf_config
        from zerodp.checkpoint.save import tied_names

        self.strategy.check_full_weights_allowed()  # stage 3: explains the missing config key
        state = self.module.state_dict()  # stage 3: gathers one unit at a time
        if exclude_frozen_parameters:
            frozen = self._frozen_names()
            state = {n: t for n, t in state.items() if n not in frozen}
        if comm.get_rank() == 0:
            path = Path(save_dir) / save_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            save_full_weights(path, state, skip=tied_names(self.module))  # tmp created fresh, renamed
            save_hf_config(self.module, save_dir)  # a transformers model: from_pretrained(save_dir) works
            log_rank0("saved 16-bit model weights to %s", path)
        comm.barrier()
        return True

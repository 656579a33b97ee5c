"""One training step's three calls, the same for every framework: forward(args, kwargs) -> loss,
backward(loss), step(); built around torch's DDP or FSDP2, or a DeepSpeed or zerodp engine."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from zerodp.report.frameworks import ADAMW, Framework


class Runner:
    """forward(args, kwargs) -> loss, backward(loss), step(); and what holds the memory: the model,
    the optimizer and (zerodp only) the engine, whose ledger names its own bytes."""

    def __init__(self, forward: Callable, backward: Callable, step: Callable, model: Any, optimizer: Any,
                 engine: Any = None) -> None:
        self.forward, self.backward, self.step = forward, backward, step
        self.model, self.optimizer, self.engine = model, optimizer, engine


def loss_of(out: Any) -> Any:
    """The loss in a model's output: the output itself, or a Hugging Face output's `.loss`."""
    return out if hasattr(out, "backward") else out.loss


def ds_config(fw: Framework, micro_batch: int, world: int, dtype: str) -> dict:
    """The DeepSpeed config of an engine framework: the shared AdamW, clipping at 1.0, its ZeRO stage."""
    zero: dict = {"stage": fw.stage}
    if fw.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    params = dict(ADAMW, betas=list(ADAMW["betas"]))
    if fw.family == "deepspeed":
        params["torch_adam"] = True  # no JIT-built CPU Adam: the same torch AdamW as the others
    config = {"train_batch_size": micro_batch * world, "train_micro_batch_size_per_gpu": micro_batch,
              "gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": params}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _wrap_ddp(model: Any, dtype: str, device: Any) -> tuple[Any, Callable]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model.to(device), device_ids=[device] if device.type == "cuda" else None)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if dtype == "bf16" else contextlib.nullcontext
    return wrapped, autocast


def _wrap_fsdp2(fw: Framework, model: Any, dtype: str, device: Any) -> tuple[Any, Callable]:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zerodp.checkpointing import repeated_blocks

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == "bf16" else MixedPrecisionPolicy()
    model.to(device)
    for _, block in repeated_blocks(model):
        fully_shard(block, reshard_after_forward=fw.stage == 3, mp_policy=policy)
    wrapped = fully_shard(model, reshard_after_forward=fw.stage == 3, mp_policy=policy)
    return wrapped, contextlib.nullcontext  # mixed precision is FSDP2's policy, not autocast


def torch_runner(fw: Framework, model: Any, dtype: str, device: Any) -> Runner:
    """`model` under torch's DDP or FSDP2 (one unit per repeated block), with torch's AdamW."""
    import torch

    wrapped, autocast = _wrap_ddp(model, dtype, device) if fw.family == "ddp" else \
        _wrap_fsdp2(fw, model, dtype, device)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, foreach=True)

    def forward(args: tuple, kwargs: dict) -> Any:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            return loss_of(wrapped(*args, **kwargs))

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return Runner(forward, lambda loss: loss.backward(), step, model, optimizer)


def engine_runner(fw: Framework, model: Any, dtype: str, world: int, micro_batch: int, overrides: dict) -> Runner:
    """`model` in a DeepSpeed or zerodp engine built from `ds_config`, with `overrides` on top: a
    section's keys join the section's, any other key replaces."""
    config = ds_config(fw, micro_batch, world, dtype)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    if fw.family == "deepspeed":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
    else:
        from zerodp.api import initialize

        engine, *_ = initialize(model=model, config=config)
    return Runner(lambda args, kwargs: loss_of(engine(*args, **kwargs)), engine.backward, engine.step,
                  engine.module, engine.optimizer, engine if fw.family == "zerodp" else None)

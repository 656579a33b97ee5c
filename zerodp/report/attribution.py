"""Who holds the bytes live after a warm-up step, on this rank: parameters, gradients, fp32 masters,
optimizer state ([Note: what compare measures] in zerodp/report/__init__.py)."""

from __future__ import annotations

from typing import Any, Iterable

from zerodp.report.runners import Runner


def storage_bytes(tensors: Iterable[Any]) -> dict[tuple, int]:
    """{storage key: bytes} of each distinct storage behind `tensors` (views of one buffer count once)."""
    out = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor: this rank's shard
        storage = t.untyped_storage()
        if storage.nbytes():
            out[(storage.data_ptr(), str(t.device))] = storage.nbytes()
    return out


def held_by_category(runner: Runner) -> dict[str, int]:
    """Bytes held after a step by parameters, gradients, fp32 masters and optimizer state, on this rank."""
    return _held_by_ledger(runner.engine) if runner.engine is not None else _held_by_storages(runner)


def _held_by_ledger(engine: Any) -> dict[str, int]:
    """zerodp: its own ledger, every tier (on a CPU-only machine all are RAM)."""
    held = engine.memory_report()["held"]
    total = lambda category: sum(held.get(category, {}).values())  # noqa: E731
    masters = total("param32_master")
    working = total("param16")
    if not working:  # fp32: the device's masters are the parameters; an offloaded copy is a master
        working = held.get("param32_master", {}).get("device", 0)
        masters -= working
    return {"parameters": working + total("param_secondary") + total("param4bit") + total("quant_state"),
            "gradients": total("grad"),
            "fp32 masters": masters, "optimizer state": total("optim_state")}


def _held_by_storages(runner: Runner) -> dict[str, int]:
    """DDP, FSDP2, DeepSpeed: the storages of the parameters (FSDP2's local shards, DeepSpeed's
    partitions), of their `.grad`, of the innermost torch optimizer's parameters that are not the
    model's (fp32 masters) and of its state; a storage is counted once, in the first category."""
    import torch

    inner = runner.optimizer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer  # DeepSpeed's ZeRO optimizers wrap a torch one
    model_params = list(runner.model.parameters())
    params = storage_bytes([getattr(p, "ds_tensor", None) for p in model_params] + model_params)
    opt_params = [p for group in inner.param_groups for p in group["params"]]
    grads = storage_bytes([p.grad for p in model_params + opt_params])
    masters = {k: b for k, b in storage_bytes(opt_params).items() if k not in params}
    state = storage_bytes(v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    seen: set = set()

    def count(storages: dict) -> int:
        fresh = {k: b for k, b in storages.items() if k not in seen}
        seen.update(fresh)
        return sum(fresh.values())

    return {"parameters": count(params), "gradients": count(grads), "fp32 masters": count(masters),
            "optimizer state": count(state)}

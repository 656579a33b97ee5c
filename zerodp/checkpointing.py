"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

    import zerodp
    zerodp.checkpointing.apply(model, policy="blocks")          # every repeated block, no model edits
    out = zerodp.checkpointing.checkpoint(block, x, mask=mask)  # or by hand, DeepSpeed's name

A checkpointed block keeps only its inputs during forward; backward runs its forward a second time
(about one extra forward of compute) to rebuild what it needs. zerodp uses torch's non-reentrant
checkpoint, which restores the RNG state for the recompute (dropout masks are identical), accepts
keyword arguments, non-tensor outputs and inputs that do not require grad, and composes with the
gradient hooks every ZeRO stage relies on (the reentrant variant runs a nested backward, which
breaks per-parameter gradient hooks: DeepSpeed's "gradient computed twice" error).

[Note: counting saved activations]
While the engine runs a forward, a saved-tensor hook sees every tensor autograd keeps for backward.
`SavedActivations` adds up the storage bytes of those tensors once per storage, leaving out
parameter storage (the ledger counts it already). Inside a checkpointed region torch's own hook
replaces ours, so nothing is counted there; the checkpoint's inputs, which it keeps alive itself,
are added by `checkpoint`. The total at the end of a forward is that micro-batch's peak: backward
only frees.

The hook has a cost beyond its time: torch unpacks every tensor saved under a saved-tensor hook as a
new tensor object, so a custom autograd Function that saved a parameter gets a plain tensor back in
backward, without the parameter's attributes. TRL's fused LM head saves `lm_head.weight` and reads
DeepSpeed's `ds_status` from it in backward. So engines built through `deepspeed.initialize` (code
written for DeepSpeed, which installs no such hook) count only when `memory_breakdown` is on;
`engine.count_activations` turns the count on or off for any engine.
"""

from __future__ import annotations

import functools
import inspect
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Collection, Iterator

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from zerodp.log import warn_once


@dataclass
class CheckpointingOptions:
    """The `activation_checkpointing` config section (DeepSpeed's keys)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass
class RecomputeProfile:
    """What `profile: true` measures: recompute calls and their wall time, since the last take()."""

    calls: int = 0
    seconds: float = 0.0

    def take(self) -> dict[str, float]:
        taken = {"recompute_calls": self.calls, "recompute_s": self.seconds}
        self.calls, self.seconds = 0, 0.0
        return taken


options = CheckpointingOptions()
profile = RecomputeProfile()


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> CheckpointingOptions:
    """Set checkpointing options (DeepSpeed's `deepspeed.checkpointing.configure`).

    Args:
        deepspeed_config: a config (path, dict or ZeroDPConfig) whose `activation_checkpointing`
            section is read first; the keyword arguments then override it.
        checkpoint_in_cpu: keep checkpoint inputs in host memory (`cpu_checkpointing`).
        synchronize: synchronise the device at each checkpoint boundary (to time it).
        profile: time recomputation (reported by the engine's timers as "recompute").
        partition_activations, contiguous_checkpointing, num_checkpoints: accepted for DeepSpeed
            configs; they need model parallelism or DeepSpeed's own allocator, so they do nothing
            here (said once in the log).
    Returns the options now in force.
    """
    if mpu_ is not None:
        raise NotImplementedError("configure(mpu_=...): zerodp has no model parallelism")
    if deepspeed_config is not None:
        from zerodp.config import ZeroDPConfig, load_config

        if not isinstance(deepspeed_config, ZeroDPConfig):
            deepspeed_config = load_config(deepspeed_config, world_size=1)
        section = deepspeed_config.activation_checkpointing
        for f in fields(CheckpointingOptions):
            setattr(options, f.name, getattr(section, f.name))
    overrides = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
                 "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                 "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    for key, value in overrides.items():
        if value is not None:
            setattr(options, key, value)
    _explain_inert_options()
    return options


def _explain_inert_options() -> None:
    if options.partition_activations:
        warn_once("activation_checkpointing.partition_activations has no effect: it splits checkpoints "
                  "across model-parallel ranks, and zerodp is data-parallel only")
    if options.contiguous_memory_optimization or options.number_checkpoints:
        warn_once("activation_checkpointing.contiguous_memory_optimization / number_checkpoints have no "
                  "effect: they size DeepSpeed's own checkpoint buffer; torch's caching allocator is used")
    if options.cpu_checkpointing and not torch.cuda.is_available():
        warn_once("activation_checkpointing.cpu_checkpointing has no effect without CUDA: "
                  "checkpoint inputs are already in host memory")


# ---------------------------------------------------------------------------------------------
# checkpoint


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` without keeping its intermediate activations; backward
    recomputes them (RNG restored, so dropout matches). Returns what `function` returns."""
    if options.cpu_checkpointing and torch.cuda.is_available():
        function, args, kwargs = _inputs_on_host(function, args, kwargs)
    _note_checkpoint_inputs(args, kwargs)
    run = _profiled(function) if options.profile else function
    with _synchronized():
        return torch_checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


def _inputs_on_host(function: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
    """Hand the checkpoint host copies of its CUDA tensor inputs, positional and keyword (pinned,
    so the copy back is asynchronous); `function` moves them back to the device. The device
    copies can then be freed."""

    def to_host(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            # Copy on the current stream into pinned memory; the copy back in the recompute is
            # queued on the same stream, so it never reads the buffer before it is filled.
            host = torch.empty_like(value, device="cpu", pin_memory=True)
            return host.copy_(value, non_blocking=True), value.device
        return value, None

    host_args = [to_host(a) for a in args]
    host_kwargs = {k: to_host(v) for k, v in kwargs.items()}

    @functools.wraps(function)
    def on_device(*host: Any, **kw: Any) -> Any:
        moved = [h.to(d, non_blocking=True) if d is not None else h for h, (_, d) in zip(host, host_args)]
        moved_kw = {k: v.to(host_kwargs[k][1], non_blocking=True) if k in host_kwargs and host_kwargs[k][1] is not None
                    else v for k, v in kw.items()}
        return function(*moved, **moved_kw)

    return on_device, tuple(h for h, _ in host_args), {k: h for k, (h, _) in host_kwargs.items()}


def _profiled(function: Callable) -> Callable:
    """`function` that times every call after its first (the first is the forward, the rest are
    recomputations in backward)."""
    calls = 0

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return function(*args, **kwargs)
        start = time.perf_counter()
        try:  # torch stops a recompute early by raising once it has what backward needs
            with _synchronized():
                return function(*args, **kwargs)
        finally:
            profile.calls += 1
            profile.seconds += time.perf_counter() - start

    return timed


@contextmanager
def _synchronized() -> Iterator[None]:
    sync = options.synchronize_checkpoint_boundary and torch.cuda.is_available()
    if sync:
        torch.cuda.synchronize()
    yield
    if sync:
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# policies


def apply(model: nn.Module, policy: str = "blocks", k: int = 1, module_classes: tuple[type, ...] | None = None,
          selective: bool = False) -> list[str]:
    """Checkpoint repeated blocks of `model` in place, without editing its code.

    Args:
        policy: "blocks" (every block) or "every_k" (blocks 0, k, 2k, ...).
        k: the stride for "every_k" (default 1).
        module_classes: the block classes; default: the children of the model's largest
            `nn.ModuleList` (a transformer's layers).
        selective: keep matmul / attention outputs (expensive to recompute, cheap to store) and
            recompute the rest (torch's selective checkpointing).
    Returns the names of the checkpointed modules. `remove(model)` undoes it.
    """
    if policy not in ("blocks", "every_k"):
        raise ValueError(f"policy={policy!r}: use 'blocks' or 'every_k'")
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    blocks = _find_blocks(model, module_classes)
    if policy == "every_k":
        blocks = blocks[::k]
    context_fn = _selective_context if selective else torch_checkpoint.noop_context_fn
    for _, block in blocks:
        _wrap(block, context_fn)
    if blocks:
        _train_without_cache(model)
    return [name for name, _ in blocks]


# [Note: no key/value cache under checkpointing]
# transformers' models fill a key/value cache in every forward where `use_cache` is on, which their configs
# default to, training included. Under checkpointing the cache would keep every layer's keys and values
# from forward to backward, which checkpointing is there to free, and each recompute would append them a
# second time (Llama 2 7B's shape, 2,048 tokens, 8 ranks: `zerodp estimate`'s saved activations 2.1 GB
# with the cache, 1.0 GB without; stage 3's peak 20.87 and 17.11 GB). So, as transformers' own
# checkpointing does, a Hugging Face model whose blocks `apply` checkpoints trains with `use_cache=False`:
# a forward pre-hook passes it in every forward with gradients where the caller passed neither
# `use_cache` nor a cache (a cache given on purpose, PEFT's prefix tuning, is kept). Forwards without
# gradients (evaluation, generation) keep the cache, and the config is left alone (it is saved with
# the model). It is the model's own switch, so every transformers release and model (a cache passed
# to the layers by keyword or by position) honours it.

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""What transformers' models call a key/value cache argument, across releases."""


def _train_without_cache(model: nn.Module) -> None:
    """Hook every Hugging Face model in `model` whose forward takes `use_cache` (see [Note: no key/value
    cache under checkpointing])."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is None or hasattr(module, "_zerodp_cache_hook"):
            continue
        try:
            names = list(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            continue
        if "use_cache" in names:
            hook = functools.partial(_without_cache, position=names.index("use_cache"))
            module._zerodp_cache_hook = module.register_forward_pre_hook(hook, with_kwargs=True)


def _without_cache(module: nn.Module, args: tuple, kwargs: dict, position: int) -> tuple[tuple, dict] | None:
    if not torch.is_grad_enabled() or len(args) > position or "use_cache" in kwargs or \
            any(kwargs.get(name) is not None for name in _CACHE_KWARGS):
        return None
    return args, {**kwargs, "use_cache": False}


def remove(model: nn.Module) -> None:
    """Undo `apply`: every checkpointed module runs its own forward again, with its key/value cache."""
    for module in model.modules():
        if "_zerodp_cache_hook" in vars(module):
            module._zerodp_cache_hook.remove()
            del module._zerodp_cache_hook
    for module in model.modules():
        if "forward" in vars(module) and hasattr(module, "_zerodp_checkpointed"):
            del module.forward
            del module._zerodp_checkpointed


def repeated_blocks(model: nn.Module, skip: Collection[nn.Module] = ()) -> list[tuple[str, nn.Module]]:
    """(name, block) for each child of the model's largest outermost non-empty nn.ModuleList (a
    transformer's layers), the same module object once; [] when there is none. Checkpointing's "blocks"
    policy and stage 3's default units both use it; stage 3 skips the lists inside MoE blocks (`skip`).

    Outermost: a list inside a block of another list (an MoE layer's 64 experts, a block's heads) is
    never chosen over the list of blocks, however long it is."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) and m not in skip]
    names = [n for n, _ in lists]
    lists = [(n, m) for n, m in lists if not any(o != n and n.startswith(f"{o}." if o else "") for o in names)]
    if not lists:
        return []
    name, largest = max(lists, key=lambda nm: len(nm[1]))
    blocks, seen = [], set()
    for i, child in enumerate(largest):
        if child not in seen:  # a block listed twice (shared weights) is one block
            seen.add(child)
            blocks.append((f"{name}.{i}" if name else str(i), child))
    return blocks


def _find_blocks(model: nn.Module, module_classes: tuple[type, ...] | None) -> list[tuple[str, nn.Module]]:
    if module_classes:
        found = [(n, m) for n, m in model.named_modules() if isinstance(m, tuple(module_classes))]
        if not found:
            raise ValueError(f"no module of classes {module_classes} in the model")
        return found
    found = repeated_blocks(model)
    if not found:
        raise ValueError("the model has no nn.ModuleList of blocks; pass module_classes=(YourBlock,)")
    return found


def _wrap(block: nn.Module, context_fn: Callable) -> None:
    """Make `block(...)` run its forward under checkpoint (an instance attribute shadows the class's
    forward, so parameter names, state_dict keys and module hooks are unchanged)."""
    if hasattr(block, "_zerodp_checkpointed"):
        return
    original = block.forward

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved anyway
            return original(*args, **kwargs)
        return checkpoint(original, *args, context_fn=context_fn, **kwargs)

    block.forward = checkpointed_forward
    block._zerodp_checkpointed = True


_RECOMPUTE_IS_EXPENSIVE = {
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    policy = torch_checkpoint.CheckpointPolicy
    name = getattr(getattr(op, "_overloadpacket", op), "__name__", str(op))
    return policy.MUST_SAVE if name in _RECOMPUTE_IS_EXPENSIVE else policy.PREFER_RECOMPUTE


def _selective_context() -> tuple[Any, Any]:
    make = getattr(torch_checkpoint, "create_selective_checkpoint_contexts", None)
    if make is None:
        raise NotImplementedError("selective checkpointing needs torch >= 2.4 (create_selective_checkpoint_contexts)")
    return make(_selective_policy)


# ---------------------------------------------------------------------------------------------
# counting what autograd saves (see [Note: counting saved activations])


@dataclass
class SavedActivations:
    """Bytes autograd keeps for backward during one forward, by tier, each storage once."""

    excluded: set[int] = field(default_factory=set)  # parameter storages
    seen: set[int] = field(default_factory=set)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)

    def add(self, tensor: torch.Tensor) -> None:
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = storage._cdata  # the storage object: stable across stage 3's resize_ of gathered buffers
        if key in self.excluded or key in self.seen:
            return
        self.seen.add(key)
        tier = tensor.device.type
        self.bytes_by_tier[tier] = self.bytes_by_tier.get(tier, 0) + storage.nbytes()

    @property
    def total(self) -> int:
        return sum(self.bytes_by_tier.values())


_active: SavedActivations | None = None


def storage_keys(tensors: Any) -> set[int]:
    """Identities of the storages behind `tensors` (to leave parameters out of the count)."""
    return {t.untyped_storage()._cdata for t in tensors}


@contextmanager
def count_saved_activations(excluded: set[int], enabled: bool = True) -> Iterator[SavedActivations]:
    """Count what autograd saves inside the block, leaving out the storages in `excluded`
    (nothing is counted, and no hook installed, when not `enabled`)."""
    global _active
    counter = SavedActivations(excluded=excluded)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        counter.add(tensor)
        return tensor

    previous, _active = _active, counter
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor) \
                if enabled and torch.is_grad_enabled() else nullcontext():
            yield counter
    finally:
        _active = previous


def _note_checkpoint_inputs(args: tuple, kwargs: dict) -> None:
    if _active is not None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                _active.add(value)

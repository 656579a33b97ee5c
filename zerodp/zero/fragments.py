"""DeepSpeed's tensor-fragment API: read or edit one parameter's fp32 master, gradient or optimizer
state under ZeRO, whatever the stage.

    from zerodp.zero.fragments import safe_get_full_fp32_param, safe_get_full_grad
    engine.backward(loss)                      # at the accumulation boundary
    grad = safe_get_full_grad(p)               # the reduced gradient, p's shape (every rank calls)
    engine.step()
    safe_set_full_fp32_param(p, torch.zeros(p.ds_shape if hasattr(p, "ds_shape") else p.shape))

Also `deepspeed.utils.safe_get_full_fp32_param` ... with ZERODP_AS_DEEPSPEED=1 (docs/deepspeed.md).

[Note: fragments and collectives]
A strategy says, for a parameter it trains, which elements this rank holds (`Strategy.fragment`:
views of the master, the optimizer state and the reduced gradient) and which every rank of its
shard group holds (`fragment_spans`, zero/layout.py's `owned_slice`). "full" getters gather the
pieces with one all-gather over that group (stages 1-3): a collective, so every rank calls them for
the same parameters in the same order, as in DeepSpeed. At stage 0 every rank holds every
parameter whole and nothing is sent. "full" setters take the whole value on every rank (the same
value): each rank writes its own piece and, since every rank has the value, the 16-bit working
copy too, without communication. "local" getters and setters work on this rank's piece, flat
(empty where the rank holds none of the parameter, so every rank gets a tensor as in DeepSpeed;
the whole parameter at stage 0, where nothing is partitioned); `safe_set_local_fp32_param` gathers the new masters to refresh the working copy,
so it is a collective at stages 1-3.

Gradients exist between the boundary backward (which reduces them) and the step. Before the reduction
at stages 0-1 (inside `no_sync`, between the micro-batches of an accumulation) `safe_get_full_grad`
returns this rank's own accumulated gradient, unreduced, as DeepSpeed returns `param.grad` there;
elsewhere the getters return None, as DeepSpeed does for a gradient it does not hold. They come in the gradient
accumulation dtype (`data_types.grad_accum_dtype`), loss-scaled under fp16 as DeepSpeed's are.
Returned tensors are copies on the engine's device; a parameter no zerodp engine trains (frozen,
forward only) gives None, and setting it is an error. NVMe optimizer offload is refused.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from zerodp import comm
from zerodp.zero.base import Fragment, Strategy, strategy_training

MASTER = "master"
"""The fragment key of the fp32 master weights (optimizer state keys are the optimizer's: "exp_avg")."""


# --- finding the strategy and the pieces --------------------------------------------------------------


def _strategy(param: nn.Parameter, api: str, required: bool) -> Strategy | None:
    """The strategy training `param`; None (or, when `required`, a ValueError) for any other."""
    strategy = strategy_training(param)
    if strategy is None and required:
        raise ValueError(f"{api}(param): the parameter (shape {tuple(full_shape(param))}) is not trained by any live "
                         "zerodp engine (frozen, in a forward-only engine, or never passed to initialize()): there is "
                         "no fp32 master or optimizer state to set")
    if strategy is not None and strategy.swapper is not None:
        raise NotImplementedError(f"{api} with offload_optimizer.device=nvme: the masters and optimizer state are "
                                  "in swap files; use offload_optimizer.device=cpu, or save a checkpoint and read "
                                  "it (zerodp.checkpoint.convert)")
    return strategy


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's full shape (a released stage-3 parameter keeps it in `ds_shape`)."""
    return getattr(param, "ds_shape", param.shape)


def _state_key(strategy: Strategy, key: str, api: str) -> bool:
    """Whether optimizer state `key` exists yet (False before the first step); a ValueError for a key
    the optimizer does not keep. Decided from the whole optimizer so every rank agrees, also one
    that holds none of the parameter."""
    keys = {k for state in strategy.optimizer.state.values() for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not keys or key in keys:
        return bool(keys)
    raise ValueError(f"{api}(param, optim_state_key={key!r}): {type(strategy.optimizer).__name__} keeps no "
                     f"element-wise state {key!r}; it keeps {sorted(keys)}")


def _state_dtype(strategy: Strategy, key: str) -> torch.dtype:
    """The dtype of optimizer state `key` (which exists): for the empty piece of a rank holding none
    of a parameter, which may have no state tensor to slice."""
    return next(v.dtype for state in strategy.optimizer.state.values() for k, v in state.items() if k == key)


def _gather(strategy: Strategy, param: nn.Parameter, pick: Callable[[Fragment], torch.Tensor]) -> torch.Tensor:
    """The whole tensor whose pieces `pick` takes from every rank's fragment, in `param`'s shape."""
    local = pick(strategy.fragment(param))
    spans = strategy.fragment_spans(param)
    if spans is None or len(spans) == 1:  # nothing partitioned: this rank holds it whole
        return local.detach().to(strategy.device, copy=True).view(full_shape(param))
    width = max(numel for _, numel in spans)
    send = torch.zeros(width, dtype=local.dtype, device=strategy.device)
    send[: local.numel()].copy_(local.detach())
    received = torch.empty(width * len(spans), dtype=local.dtype, device=strategy.device)
    with comm.ledger.outside_step():  # one-off reads, not the step's traffic
        comm.all_gather_into_tensor(received, send, group=strategy.fragment_group())
    full = torch.empty(sum(numel for _, numel in spans), dtype=local.dtype, device=strategy.device)
    for rank, (offset, numel) in enumerate(spans):
        full[offset : offset + numel].copy_(received[rank * width : rank * width + numel])
    return full.view(full_shape(param))


def _full_value(param: nn.Parameter, value: torch.Tensor, api: str) -> torch.Tensor:
    """`value` flattened, checked to hold the whole parameter."""
    shape = full_shape(param)
    if not isinstance(value, torch.Tensor) or value.numel() != shape.numel():
        found = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{api}(param, value): value has shape {found}, the parameter {tuple(shape)} "
                         f"({shape.numel()} elements); pass the whole unpartitioned tensor")
    return value.detach().reshape(-1)


def _local_value(fragment: Fragment, value: torch.Tensor | None, api: str) -> torch.Tensor:
    """`value` flattened, checked to hold exactly this rank's fragment (None or empty where it holds none)."""
    numel = 0 if value is None else value.numel()
    if numel != fragment.numel:
        raise ValueError(f"{api}(param, value): value has {numel} elements, this rank (rank {comm.get_rank()}) "
                         f"holds {fragment.numel} of the parameter (elements {fragment.offset}.."
                         f"{fragment.offset + fragment.numel}); pass safe_get_local_*'s tensor, edited")
    return torch.empty(0) if value is None else value.detach().reshape(-1)


@torch.no_grad()
def _refresh_working_copy(strategy: Strategy, param: nn.Parameter, full_master: torch.Tensor) -> None:
    """Write the new master values into the working (16-bit) parameter: every rank passes the same
    whole value and writes what it holds of the working copy."""
    strategy.load_full_state({strategy.names[param]: full_master.reshape(full_shape(param))})


# --- full getters ----------------------------------------------------------------------------------------


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's fp32 master weights, whole, in its shape (a copy); None for a parameter no
    engine trains. A collective at stages 1-3: every rank calls it."""
    strategy = _strategy(param, "safe_get_full_fp32_param", required=False)
    return None if strategy is None else _gather(strategy, param, lambda f: f.tensors[MASTER])


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's reduced (averaged over ranks) gradient, whole, in its shape, between the boundary
    backward and the step (a collective at stages 1-3: every rank calls it). Before the reduction at
    stages 0-1 (inside no_sync, between micro-batches) this rank's own accumulated gradient, as
    DeepSpeed's `param.grad` (no communication); None elsewhere."""
    strategy = _strategy(param, "safe_get_full_grad", required=False)
    if strategy is None:
        return None
    if strategy.fragment(param).grad is None:  # the same answer on every rank
        local = strategy.local_grad(param)
        return None if local is None else local.detach().to(strategy.device, copy=True)
    return _gather(strategy, param, lambda f: f.grad)


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The parameter's optimizer state `optim_state_key` (Adam: "exp_avg", "exp_avg_sq"), whole, in its
    shape; None before the first step. A collective at stages 1-3: every rank calls it."""
    strategy = _strategy(param, "safe_get_full_optimizer_state", required=False)
    if strategy is None or not _state_key(strategy, optim_state_key, "safe_get_full_optimizer_state"):
        return None
    none = torch.empty(0, dtype=_state_dtype(strategy, optim_state_key), device=strategy.device)
    return _gather(strategy, param, lambda f: f.tensors.get(optim_state_key, none))


# --- full setters ----------------------------------------------------------------------------------------


@torch.no_grad()
def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set the parameter's fp32 master weights to `value` (whole, its shape) and its working copy to
    `value` in the working dtype. Every rank calls it with the same value."""
    strategy = _strategy(param, "safe_set_full_fp32_param", required=True)
    flat = _full_value(param, value, "safe_set_full_fp32_param")
    fragment = strategy.fragment(param)
    master = fragment.tensors[MASTER]
    master.copy_(flat[fragment.offset : fragment.offset + fragment.numel].to(master.device))
    _refresh_working_copy(strategy, param, flat)


@torch.no_grad()
def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the parameter's optimizer state `optim_state_key` to `value` (whole, its shape); the state
    must exist (after the first step). Every rank calls it with the same value."""
    api = "safe_set_full_optimizer_state"
    strategy = _strategy(param, api, required=True)
    flat = _full_value(param, value, api)
    _require_state(strategy, optim_state_key, api)
    fragment = strategy.fragment(param)
    if fragment.numel:
        state = fragment.tensors[optim_state_key]
        state.copy_(flat[fragment.offset : fragment.offset + fragment.numel].to(state.device))


def _require_state(strategy: Strategy, key: str, api: str) -> None:
    if not _state_key(strategy, key, api):
        raise ValueError(f"{api}(param, value, optim_state_key={key!r}): the optimizer has no state yet; it is "
                         "created by the first engine.step()")


@torch.no_grad()
def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Replace the parameter's reduced gradient by `value` (whole, its shape), between the boundary
    backward and the step (the step then uses it). Every rank calls it with the same value."""
    strategy = _strategy(param, "safe_set_full_grad", required=True)
    flat = _full_value(param, value, "safe_set_full_grad")
    fragment = strategy.fragment(param)
    if fragment.grad is None:
        raise RuntimeError("safe_set_full_grad(param, value): there is no reduced gradient to replace; call it "
                           "after engine.backward() at the accumulation boundary, before engine.step()")
    fragment.grad.copy_(flat[fragment.offset : fragment.offset + fragment.numel].to(fragment.grad.device))


def safe_update_full_grad_vectorized(param_list: list[nn.Parameter],
                                     update_func: Callable[[torch.Tensor, nn.Parameter], torch.Tensor]) -> None:
    """For each trained parameter: its gradient becomes `update_func(full_grad, param)` (DeepSpeed's
    signature). A collective at stages 1-3: every rank calls it with the same list."""
    for p in param_list:
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))


# --- local getters and setters -----------------------------------------------------------------------------


def _local(param: nn.Parameter, api: str, pick: Callable[[Fragment], torch.Tensor | None]) -> torch.Tensor | None:
    strategy = _strategy(param, api, required=False)
    if strategy is None:
        return None
    piece = pick(strategy.fragment(param))  # empty where this rank holds none of the parameter
    return None if piece is None else piece.detach().to(strategy.device, copy=True)


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of the parameter's fp32 master, flat (a copy); empty where it holds none."""
    return _local(param, "safe_get_local_fp32_param", lambda f: f.tensors[MASTER])


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of the parameter's reduced gradient, flat (empty where it holds none); None
    before the boundary backward."""
    return _local(param, "safe_get_local_grad", lambda f: f.grad)


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's piece of the parameter's optimizer state `optim_state_key`, flat (empty where it
    holds none); None before the first step."""
    strategy = _strategy(param, "safe_get_local_optimizer_state", required=False)
    if strategy is None or not _state_key(strategy, optim_state_key, "safe_get_local_optimizer_state"):
        return None
    none = torch.empty(0, dtype=_state_dtype(strategy, optim_state_key), device=strategy.device)
    return _local(param, "safe_get_local_optimizer_state", lambda f: f.tensors.get(optim_state_key, none))


@torch.no_grad()
def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor | None) -> None:
    """Set this rank's piece of the parameter's fp32 master (safe_get_local_fp32_param's shape; None
    where it holds none) and refresh the working copy: a collective at stages 1-3, every rank calls."""
    api = "safe_set_local_fp32_param"
    strategy = _strategy(param, api, required=True)
    fragment = strategy.fragment(param)
    flat = _local_value(fragment, value, api)
    if fragment.numel:
        fragment.tensors[MASTER].copy_(flat.to(fragment.tensors[MASTER].device))
    _refresh_working_copy(strategy, param, _gather(strategy, param, lambda f: f.tensors[MASTER]))


@torch.no_grad()
def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor | None, optim_state_key: str) -> None:
    """Set this rank's piece of the parameter's optimizer state `optim_state_key` (no communication)."""
    api = "safe_set_local_optimizer_state"
    strategy = _strategy(param, api, required=True)
    _require_state(strategy, optim_state_key, api)
    fragment = strategy.fragment(param)
    flat = _local_value(fragment, value, api)
    if fragment.numel:
        fragment.tensors[optim_state_key].copy_(flat.to(fragment.tensors[optim_state_key].device))


@torch.no_grad()
def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor | None) -> None:
    """Set this rank's piece of the parameter's reduced gradient, between the boundary backward and the step."""
    api = "safe_set_local_grad"
    strategy = _strategy(param, api, required=True)
    fragment = strategy.fragment(param)
    if fragment.grad is None:
        raise RuntimeError(f"{api}(param, value): there is no reduced gradient to replace; call it after "
                           "engine.backward() at the accumulation boundary, before engine.step()")
    flat = _local_value(fragment, value, api)
    if fragment.numel:
        fragment.grad.copy_(flat.to(fragment.grad.device))


__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]

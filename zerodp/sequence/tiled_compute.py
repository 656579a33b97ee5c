"""ALST's generic tiled compute and tiled loss, with DeepSpeed's signatures: `sequence_tiled_compute`
(`SequenceTiledCompute`) runs any function a sequence shard at a time, `TiledFusedLogitsLoss` runs
the language-model head and the loss a shard of tokens at a time, so the logits (tokens x vocabulary,
the largest activation of a long-sequence step) exist for one shard only.

Both recompute each shard in backward and deliver each parameter's gradient once, summed over the
shards (tiled.py's [Note: one gradient per parameter]).

[Note: the tiled loss recomputes]
DeepSpeed's `TiledFusedLogitsLoss` runs each shard's backward inside its forward and keeps the input's
gradient for backward, saving the recomputation of the head. Here the forward computes the shards'
losses without a graph and backward recomputes each shard: one more head matmul per step, the same
peak (one shard's logits and their graph). A backward inside the forward would fire ZeRO's gradient
hooks before `engine.backward` opened its pass (stage 3 would open and close it in the middle of the
forward), and its parameter gradients would miss what backward multiplies the loss by (gradient
accumulation's 1/steps, fp16's loss scale); recomputed in backward, they get the incoming gradient
like every other gradient.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from zerodp.sequence.tiled import backward_by_tile

_REDUCTIONS = (None, "mean", "sum")


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: dict, kwargs_to_pass: dict,
                           grad_requiring_tensor_key: str, compute_params: Any = None,
                           output_unshard_dimension: int = 1, output_reduction: str | None = "mean") -> torch.Tensor:
    """`fn(**shard_of(kwargs_to_shard), **kwargs_to_pass)` on `shards` slices of dimension 1 (the
    sequence, `seqlen` long; slices of ceil(seqlen / shards), so the last may be shorter or empty, as
    in DeepSpeed), the outputs concatenated along `output_unshard_dimension` (0: each shard's output
    stacked, the per-shard loss case) and reduced by `output_reduction` (None, "mean" or "sum").
    Only `kwargs_to_shard[grad_requiring_tensor_key]` gets a gradient; the other tensors are constants
    of the computation. `compute_params` is accepted for DeepSpeed's signature (the parameters come
    from the graph)."""
    if output_reduction not in _REDUCTIONS:
        raise ValueError(f"sequence_tiled_compute: output_reduction={output_reduction!r}; expected None, 'mean' "
                         "or 'sum'")
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"sequence_tiled_compute: grad_requiring_tensor_key={grad_requiring_tensor_key!r} is not a "
                         f"key of kwargs_to_shard ({sorted(kwargs_to_shard)}); name the sharded input that needs "
                         "a gradient")
    if shards < 1 or seqlen < 1:
        raise ValueError(f"sequence_tiled_compute: seqlen={seqlen}, shards={shards}; both must be at least 1")
    keys = list(kwargs_to_shard) + list(kwargs_to_pass)
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *[{**kwargs_to_shard, **kwargs_to_pass}[k] for k in keys])


class SequenceTiledCompute(torch.autograd.Function):
    """DeepSpeed's autograd function behind `sequence_tiled_compute` (same positional arguments: fn,
    seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
    output_unshard_dimension, output_reduction, *values of the sharded then the passed keys)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, seqlen: int, shards: int, keys_to_shard: list, keys_to_pass: list,
                key: str, compute_params: Any, dim: int, reduction: str | None, *args: Any) -> torch.Tensor:
        sharded = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        step = math.ceil(seqlen / shards)
        outs = [fn(**{k: v[:, i * step:(i + 1) * step] for k, v in sharded.items()}, **passed) for i in range(shards)]
        whole = torch.cat([o.unsqueeze(0) for o in outs]) if dim == 0 else torch.cat(outs, dim=dim)
        # tensors through save_for_backward (what autograd keeps, and what the memory ledger counts),
        # the rest on ctx
        ctx.keys = keys_to_shard + keys_to_pass
        ctx.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_at])
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.fn, ctx.step, ctx.key, ctx.dim, ctx.reduction = fn, step, key, dim, reduction
        ctx.sharded_keys, ctx.shape = keys_to_shard, whole.shape
        ctx.sizes = [o.shape[dim] for o in outs] if dim != 0 else None
        ctx.wants_grad = sharded[key].requires_grad
        if reduction is None:
            return whole
        return whole.mean() if reduction == "mean" else whole.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.reduction is not None:  # the gradient of the unreduced output
            grad = (grad / math.prod(ctx.shape) if ctx.reduction == "mean" else grad).expand(ctx.shape)
        out_grads = list(grad.unbind(0)) if ctx.dim == 0 else list(torch.split(grad, ctx.sizes, dim=ctx.dim))
        args = list(ctx.others)
        for i, tensor in zip(ctx.tensor_at, ctx.saved_tensors):
            args[i] = tensor.detach()  # constants of the recomputation (recomputing attached would backpropagate
            # into the caller's graph a second time); the wanted input gets its own detached tiles
        values = dict(zip(ctx.keys, args))
        others = {k: values[k] for k in ctx.sharded_keys if k != ctx.key}
        passed = {k: values[k] for k in ctx.keys[len(ctx.sharded_keys):]}
        step = ctx.step
        tiles = [values[ctx.key][:, i * step:(i + 1) * step].requires_grad_(ctx.wants_grad)
                 for i in range(len(out_grads))]

        def run(i: int, tile: torch.Tensor) -> torch.Tensor:
            return ctx.fn(**{ctx.key: tile}, **{k: v[:, i * step:(i + 1) * step] for k, v in others.items()},
                          **passed)

        tile_grads = backward_by_tile(run, tiles, out_grads)
        grads: list = [None] * len(args)
        if ctx.wants_grad:
            grads[ctx.keys.index(ctx.key)] = torch.cat(tile_grads, dim=1)
        return (None,) * 9 + tuple(grads)


def _check_loss_inputs(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, reduction: str) -> None:
    """DeepSpeed's checks of TiledFusedLogitsLoss's inputs, as ValueErrors that name the argument."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"TiledFusedLogitsLoss: output_reduction={reduction!r}; expected 'mean' or 'sum'")
    if x.dim() < 2 or y.dim() < 2:
        raise ValueError(f"TiledFusedLogitsLoss: x has shape {tuple(x.shape)} and y {tuple(y.shape)}; both must be "
                         "at least [batch_size, seq_len]")
    if x.shape[:2] != y.shape[:2]:
        raise ValueError(f"TiledFusedLogitsLoss: x's batch and sequence dimensions {tuple(x.shape[:2])} differ from "
                         f"y's {tuple(y.shape[:2])}")
    if mask is not None and mask.shape != x.shape[:2]:
        raise ValueError(f"TiledFusedLogitsLoss: mask has shape {tuple(mask.shape)}; expected x's [batch_size, "
                         f"seq_len] {tuple(x.shape[:2])}")


class TiledFusedLogitsLoss(torch.autograd.Function):
    """`TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)`:
    `fn(module, x_shard, y_shard[, mask_shard])` (a scalar loss, typically the head and a cross-entropy)
    on `shards` shards of the batch x sequence tokens, reduced by "mean" (over the shards: use "sum" and
    divide yourself when shards hold different numbers of labelled tokens) or "sum". `mask` is passed to
    `fn` only when not None. Backward recomputes each shard ([Note: the tiled loss recomputes])."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, module: Any, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
                shards: int, compute_params: Any, output_reduction: str) -> torch.Tensor:
        _check_loss_inputs(x, y, mask, output_reduction)
        pieces = [torch.chunk(t.reshape(-1, *t.shape[2:]), shards) for t in (x, y)]
        if mask is not None:
            pieces.append(torch.chunk(mask.reshape(-1), shards))
        losses = torch.stack([fn(module, *parts) for parts in zip(*pieces)])
        ctx.fn, ctx.module, ctx.shards, ctx.reduction = fn, module, shards, output_reduction
        ctx.count = losses.numel()
        ctx.save_for_backward(x, y, mask)
        return losses.mean() if output_reduction == "mean" else losses.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, y, mask = ctx.saved_tensors
        flat = x.detach().reshape(-1, *x.shape[2:])
        tiles = [t.requires_grad_(x.requires_grad) for t in (c.detach() for c in torch.chunk(flat, ctx.shards))]
        rest = [torch.chunk(y.reshape(-1, *y.shape[2:]), ctx.shards)]
        if mask is not None:
            rest.append(torch.chunk(mask.reshape(-1), ctx.shards))
        share = grad / ctx.count if ctx.reduction == "mean" else grad
        x_grads = backward_by_tile(lambda i, tile: ctx.fn(ctx.module, tile, *(r[i] for r in rest)), tiles,
                                   [share] * len(tiles))
        x_grad = torch.cat(x_grads).reshape(x.shape) if x.requires_grad else None
        return None, None, x_grad, None, None, None, None, None

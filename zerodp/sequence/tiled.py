"""Tiled MLP: an MLP run on a long sequence a tile at a time, so its wide intermediate activations
exist for one tile only (DeepSpeed's ALST `TiledMLP`, with its `apply` signature).

[Note: one gradient per parameter]
Forward runs each tile without a graph and keeps only the input. Backward recomputes each tile with
a graph and backpropagates it at once, so the parameters' gradients arrive once per tile. ZeRO's
gradient hooks expect one arrival per backward (stage 3 counts them per unit; stage 2 moves each
gradient into a bucket as it arrives), so all tiles but the last compute their parameter gradients
with `torch.autograd.grad`, which fires no hook, and sum them; before the last tile's backward the
sum is placed in `.grad`, and autograd adds the last tile's share to it and fires each hook once,
with the whole gradient. DeepSpeed marks its parameters `ds_grad_is_ready` instead.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _place(params: list[torch.nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    """Add the earlier tiles' gradients to `.grad` before the last tile's backward adds its own."""
    for p, g in zip(params, grads):
        if g is not None and p.grad is None:
            p.grad = g
        elif g is not None:
            p.grad.add_(g)  # in place: a strategy's .grad may be a view of its flat gradient buffer


class TiledMLP(torch.autograd.Function):
    """`TiledMLP.apply(fn, module, x, shards, compute_params)`: `fn(module, x_tile)` on `shards` tiles of
    `x` along its second-to-last (sequence) dimension; `compute_params` are the parameters `fn` uses
    (None: the module's trainable ones). The result equals `fn(module, x)` up to the rounding of
    summing the parameter gradients tile by tile (see [Note: one gradient per parameter])."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, module: Any, x: torch.Tensor, shards: int, compute_params: Any) -> torch.Tensor:
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        params = module.parameters() if compute_params is None else compute_params
        ctx.params = [p for p in params if p.requires_grad]
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, tile) for tile in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        tiles = torch.chunk(x.detach(), ctx.shards, dim=-2)
        grads = torch.chunk(grad, ctx.shards, dim=-2)
        x_grads, param_grads = [], [None] * len(ctx.params)
        for i, (tile, tile_grad) in enumerate(zip(tiles, grads)):
            tile = tile.detach().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, tile)
            if i < len(tiles) - 1:
                inputs = ([tile] if x.requires_grad else []) + ctx.params
                got = torch.autograd.grad(out, inputs, tile_grad, allow_unused=True)
                x_grads.extend(got[:1] if x.requires_grad else [])
                got = got[1:] if x.requires_grad else got
                param_grads = [g if s is None else (s if g is None else s + g) for s, g in zip(param_grads, got)]
            else:
                _place(ctx.params, param_grads)
                torch.autograd.backward(out, tile_grad)
                x_grads.extend([tile.grad] if x.requires_grad else [])
        x_grad = torch.cat(x_grads, dim=-2) if x.requires_grad else None
        return None, None, x_grad, None, None

"""Tiled MLP: an MLP run on a long sequence a tile at a time, so its wide intermediate activations
exist for one tile only (DeepSpeed's ALST `TiledMLP`, with its `apply` signature), and the per-tile
backward that every tiled computation here shares (tiled_compute.py builds the generic one and the
tiled loss on it).

[Note: one gradient per parameter]
Forward runs each tile without a graph and keeps only the input. Backward recomputes each tile with
a graph and takes its gradients with `torch.autograd.grad`, which fires no hook, summing each
parameter's share over the tiles. ZeRO's gradient hooks expect one arrival per backward (stage 3
counts them per unit; stage 2 moves each gradient into a bucket as it arrives), so once every tile
is done the sums are handed to autograd in one `torch.autograd.backward(params, sums)`: a leaf's
backward runs its AccumulateGrad, which adds the sum to `.grad` (a strategy's view into its flat
buffer included) and fires each parameter's hook once, with the whole gradient. DeepSpeed marks its
parameters `ds_grad_is_ready` instead and lets each tile's backward reach them.

Which parameters: those autograd reaches from each tile's output (the AccumulateGrad nodes of its
graph), not only the `compute_params` the caller lists. DeepSpeed's `compute_params` only says which
flags to set, and a parameter missing from it still gets each tile's gradient there; here a missing
one would lose all but one tile's share, so the graph decides, and a tile may reach parameters the
others do not (an expert that only some tiles route to).

[Note: tiles under ZeRO-3]
Backward runs inside autograd's engine, so stage 3 sees each tile's forward as a recomputation
(zero/stage3_hooks.py's [Note: stage-3 hooks]): it makes sure the unit is gathered and adds no
backward hooks. The unit was gathered when backward reached its output, or by the first tile, and
stays so until its gradients are final, which is after the last tile: parameters are gathered once
per pass, not once per tile.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def graph_leaves(out: torch.Tensor, skip: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors that need grad which autograd reaches from `out` (their AccumulateGrad nodes),
    except `skip` (the tile itself), in the order first met."""
    seen, stack, found = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # only AccumulateGrad nodes carry one
        if leaf is not None:
            if leaf is not skip:
                found.append(leaf)
            continue
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found


def backward_by_tile(run: Callable[[int, torch.Tensor], torch.Tensor], tiles: list[torch.Tensor],
                     out_grads: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Recompute `run(i, tiles[i])` for every tile with a graph, backpropagate `out_grads[i]` through
    it, and deliver each parameter's gradient summed over the tiles in one backward (see [Note: one
    gradient per parameter]). `tiles` are detached and require grad where the caller wants theirs;
    returns each tile's gradient (None where it needs none)."""
    sums: dict[int, list] = {}  # id(leaf) -> [leaf, summed gradient]
    tile_grads: list[torch.Tensor | None] = []
    for i, (tile, out_grad) in enumerate(zip(tiles, out_grads)):
        with torch.enable_grad():
            out = run(i, tile)
        leaves = graph_leaves(out, tile) if out.requires_grad else []
        own = [tile] if tile.requires_grad else []
        if out.requires_grad:
            got = torch.autograd.grad(out, own + leaves, out_grad, allow_unused=True)
        else:  # the tile's output depends on nothing that needs grad
            got = (None,) * len(own)
        if tile.requires_grad:
            tile_grads.append(torch.zeros_like(tile) if got[0] is None else got[0])
        else:
            tile_grads.append(None)
        for leaf, grad in zip(leaves, got[len(own):]):
            if grad is None:
                continue
            entry = sums.setdefault(id(leaf), [leaf, None])
            entry[1] = grad if entry[1] is None else entry[1] + grad
    if sums:
        leaves, grads = zip(*sums.values())
        torch.autograd.backward(list(leaves), list(grads))
    return tile_grads


class TiledMLP(torch.autograd.Function):
    """`TiledMLP.apply(fn, module, x, shards, compute_params)`: `fn(module, x_tile)` on `shards` tiles of
    `x` along its second-to-last (sequence) dimension; `compute_params` is accepted for DeepSpeed's
    signature (the parameters come from the graph, see [Note: one gradient per parameter]). The output
    and the input's gradient equal `fn(module, x)`'s row for row; the parameters' gradients differ by
    the rounding of summing them tile by tile."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, module: Any, x: torch.Tensor, shards: int, compute_params: Any) -> torch.Tensor:
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, tile) for tile in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        tiles = [t.detach().requires_grad_(x.requires_grad) for t in torch.chunk(x.detach(), ctx.shards, dim=-2)]
        grads = list(torch.chunk(grad, ctx.shards, dim=-2))
        x_grads = backward_by_tile(lambda i, tile: ctx.fn(ctx.module, tile), tiles, grads)
        x_grad = torch.cat(x_grads, dim=-2) if x.requires_grad else None
        return None, None, x_grad, None, None

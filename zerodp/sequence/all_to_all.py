"""Ulysses' two all-to-alls: a sequence shard of every head becomes the whole sequence of a head shard
before attention, and back after it.

[Note: the Ulysses all-to-all]
Each of the S ranks of a sequence-parallel group holds its S-th of the sequence for every head. Before
attention, rank j needs the whole sequence for its S-th of the heads: every rank cuts its tensor into
S head blocks, sends block j to rank j, and rank j stacks the S pieces it receives in rank order,
which is sequence order (rank i holds the i-th sequence shard). After attention the same exchange
runs with the roles swapped. The tensors are only permuted and copied: no element is added or
multiplied, so the attention sees exactly the values an unsplit run gives it. An all-to-all over
chunks laid out first is its own adjoint (chunk j of rank i goes to chunk i of rank j, and the
gradient goes back the same way), so backward is the same all-to-all on the incoming gradient.
Every element is handed to the collective, (S-1)/S of them leave the rank; the comm ledger counts
the tensor handed over.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp import comm


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 of a contiguous [S, ...] tensor; backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, chunks: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(chunks)
        comm.all_to_all_single(out, chunks, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        comm.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def exchange(chunks: torch.Tensor, group: Any) -> torch.Tensor:
    """Send chunk r of `chunks` (dim 0, one chunk per rank of `group`) to rank r; the result's chunk r
    came from rank r. Differentiable (see [Note: the Ulysses all-to-all])."""
    return _AllToAll.apply(chunks.contiguous(), group)


def heads_to_ranks(x: torch.Tensor, num_ranks: int, group: Any) -> torch.Tensor:
    """[batch, heads, seq/S, dim] (this rank's sequence shard, every head) -> [batch, heads/S, seq, dim]
    (the whole sequence, this rank's block of heads), HF's attention layout on both sides."""
    batch, heads, shard_len, dim = x.shape
    chunks = x.reshape(batch, num_ranks, heads // num_ranks, shard_len, dim).transpose(0, 1)
    received = exchange(chunks, group)  # [S (sequence shard), batch, heads/S, seq/S, dim]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // num_ranks, num_ranks * shard_len, dim)


def sequence_to_ranks(x: torch.Tensor, num_ranks: int, group: Any) -> torch.Tensor:
    """[batch, seq, heads/S, dim] (attention's output for this rank's heads) -> [batch, seq/S, heads,
    dim] (this rank's sequence shard, every head): the inverse of `heads_to_ranks`."""
    batch, seq_len, local_heads, dim = x.shape
    chunks = x.reshape(batch, num_ranks, seq_len // num_ranks, local_heads, dim).transpose(0, 1)
    received = exchange(chunks, group)  # [S (head block), batch, seq/S, heads/S, dim]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, seq_len // num_ranks, num_ranks * local_heads, dim)

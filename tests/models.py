"""Small deterministic models and data for the distributed tests, and the DDP reference loop."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn


class TiedMLP(nn.Module):
    """Embedding -> 2 hidden layers -> head tied to the embedding; a LayerNorm gives no-decay params."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(seed: int = 0, **kwargs) -> TiedMLP:
    torch.manual_seed(seed)
    return TiedMLP(**kwargs)


def two_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """The usual decay / no-decay split: matrices decay, biases and norms do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}]


def batch(rank: int, step: int, micro: int, micro_batch: int = 4, seq: int = 8, vocab: int = 32):
    """This rank's micro-batch (different on every rank, step and micro-step)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    idx = torch.randint(0, vocab, (micro_batch, seq), generator=g)
    return idx, torch.roll(idx, 1, dims=1)


def train_steps(engine, rank: int, steps: range, gas: int = 2) -> list[float]:
    """Train `engine` on `batch(rank, step, micro)` for `steps` x `gas` micro-batches; the losses."""
    losses = []
    for step in steps:
        for micro in range(gas):
            loss = engine(*batch(rank, step, micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


class Branchy(nn.Module):
    """What real models do to a data-parallel engine: a frozen layer, a layer used twice, and a
    branch (`maybe`) that runs only when the caller says so (different ranks may differ)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.shared = nn.Linear(16, 16)
        self.maybe = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_maybe: bool = True) -> torch.Tensor:
        h = self.frozen(self.embed(idx))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        if use_maybe:
            h = h + self.maybe(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class Block(nn.Module):
    """A pre-norm residual MLP block: what a transformer layer is to a ZeRO-3 engine."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h))))


class BlockLM(nn.Module):
    """Embedding -> blocks (block 0 runs twice; the last only when `use_last`) -> norm -> head tied
    to the embedding: a repeated module, tied weights used outside their module, and a branch."""

    def __init__(self, vocab: int = 32, dim: int = 16, num_blocks: int = 4, reuse_first: bool = True) -> None:
        super().__init__()
        self.reuse_first = reuse_first
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(dim)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None, use_last: bool = True) -> torch.Tensor:
        """The loss, or the logits when `targets` is None."""
        h = self.embed(idx)
        for block in self.blocks[:-1]:
            h = block(h)
        if self.reuse_first:
            h = self.blocks[0](h)
        if use_last:
            h = self.blocks[-1](h)
        logits = torch.nn.functional.linear(self.norm(h), self.embed.weight)
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_block_lm(seed: int = 0, **kwargs) -> BlockLM:
    torch.manual_seed(seed)
    return BlockLM(**kwargs)


def train_with_ddp(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: int, gas: int, clip: float,
                   forward_kwargs: Callable[[int, int], dict] = lambda step, micro: {},
                   find_unused: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsharded reference: torch DDP with no_sync between accumulation boundaries, torch's
    clipping and `optimizer`. Returns every micro-batch's loss and the final parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, find_unused_parameters=find_unused)
    losses = []
    for step in range(steps):
        for micro in range(gas):
            with ddp.no_sync() if micro < gas - 1 else contextlib.nullcontext():
                loss = ddp(*batch(rank, step, micro), **forward_kwargs(step, micro))
                (loss / gas).backward()
            losses.append(loss.item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

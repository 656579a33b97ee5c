"""A tiny mixture-of-experts language model in the style of DeepSeek-V2/V3's remote code.

Each MoE block is a `gate` (DeepSeek's MoEGate: a weight of one row per expert, softmax, top-k)
plus an `nn.ModuleList` of expert MLPs and a shared expert; experts that receive no token are not
called (DeepSeek's `moe_infer` skips them), so ranks with different data call different experts.
There are more experts per block (4) than layers (2), so the model's largest ModuleList is an expert
list: what makes a naive per-module stage 3 diverge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, NUM_EXPERTS, TOP_K, NUM_LAYERS = 32, 16, 24, 4, 2, 2


@dataclass(frozen=True)
class MoEShape:
    """Sizes of TinyMoELM (the tests' defaults; bench/moe_units.py builds a larger one)."""

    vocab: int = VOCAB
    dim: int = DIM
    hidden: int = HIDDEN
    num_experts: int = NUM_EXPERTS
    top_k: int = TOP_K
    num_layers: int = NUM_LAYERS


TINY = MoEShape()


class ExpertMLP(nn.Module):
    """A SwiGLU MLP (DeepSeek's DeepseekV2MLP)."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    """DeepSeek's router: one weight row per expert, softmax scores, top-k, renormalised."""

    def __init__(self, num_experts: int = NUM_EXPERTS, dim: int = DIM, top_k: int = TOP_K) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(num_experts, dim) * 0.5)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(h, self.weight).softmax(dim=-1)
        weight, index = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return index, weight / weight.sum(dim=-1, keepdim=True)


class DeepseekStyleMoE(nn.Module):
    """gate + experts (ModuleList) + optional shared expert; experts without tokens are skipped."""

    def __init__(self, shape: MoEShape = TINY, shared: bool = True) -> None:
        super().__init__()
        self.experts = nn.ModuleList([ExpertMLP(shape.dim, shape.hidden) for _ in range(shape.num_experts)])
        self.gate = MoEGate(shape.num_experts, shape.dim, shape.top_k)
        self.shared_experts = ExpertMLP(shape.dim, shape.hidden) if shared else None
        self.calls: list[list[int]] = []  # per forward: the experts called (tests read it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        index, weight = self.gate(h)
        out = torch.zeros_like(h)
        called = []
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(index == e, as_tuple=True)
            if token.numel() == 0:
                continue
            called.append(e)
            out = out.index_add(0, token, expert(h[token]) * weight[token, slot, None])
        self.calls.append(called)
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        return out.reshape(shape)


class MoELayer(nn.Module):
    """A decoder layer: a token mixer (a causal mean over the prefix, then a projection) and a MoE MLP."""

    def __init__(self, shape: MoEShape = TINY) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(shape.dim)
        self.mix = nn.Linear(shape.dim, shape.dim)
        self.post_attention_layernorm = nn.LayerNorm(shape.dim)
        self.mlp = DeepseekStyleMoE(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[None, :, None]
        x = x + self.mix(h.cumsum(dim=1) / steps)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyMoELM(nn.Module):
    """embed -> NUM_LAYERS MoE layers -> norm -> head; forward(ids, labels) returns the mean loss."""

    def __init__(self, seed: int = 0, shape: MoEShape = TINY) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.vocab = shape.vocab
        self.embed_tokens = nn.Embedding(shape.vocab, shape.dim)
        self.layers = nn.ModuleList([MoELayer(shape) for _ in range(shape.num_layers)])
        self.norm = nn.LayerNorm(shape.dim)
        self.lm_head = nn.Linear(shape.dim, shape.vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, self.vocab), labels.reshape(-1))

    def expert_calls(self) -> list[list[list[int]]]:
        """Per layer, per forward: the experts called."""
        return [layer.mlp.calls for layer in self.layers]


def moe_batch(rank: int, step: int, micro: int, tokens: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 2 sequences of `tokens` tokens; rank 0 draws from the low half of the vocabulary
    and rank 1 from the high half, so the ranks route to different experts."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    low = rank * VOCAB // 2
    ids = torch.randint(low, low + VOCAB // 2, (2, tokens), generator=g)
    return ids, torch.roll(ids, -1, dims=1)

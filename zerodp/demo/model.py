"""TinyGPT: a small GPT-2 style language model for `zerodp demo`, tests and benchmarks.

It is deliberately an ordinary model, so that it exercises what real models do to a ZeRO engine:
a tied input/output embedding (one parameter used by two modules), LayerNorm and bias parameters
that are tiny next to the matrices, and a stack of identical blocks in `model.blocks` that later
work checkpoints (activation recomputation) and partitions (stage 3) one block at a time.

    torch.manual_seed(0)
    model = TinyGPT(DEMO_DEFAULT)
    loss = model(idx, targets)          # idx, targets: (batch, seq_len) LongTensors

Everything is deterministic given `torch.manual_seed`: initialisation draws from the default
generator in a fixed order, and nothing else draws unless `dropout > 0` in training mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
"""Target value that the loss skips (`torch.nn.functional.cross_entropy`'s default)."""

INIT_STD = 0.02
"""GPT-2's standard deviation for every weight matrix and embedding."""


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a TinyGPT.

    Args:
        vocab_size: number of token ids; inputs must lie in [0, vocab_size).
        seq_len: longest input the position embedding covers.
        d_model: width of the residual stream; must be divisible by `n_head`.
        n_layer: number of transformer blocks.
        n_head: attention heads per block.
        dropout: dropout on attention weights and residual branches (default 0.0, i.e. none).
        tie_embeddings: share one weight between the token embedding and the output head
            (default True, as GPT-2 and most language models do).
    """

    vocab_size: int
    seq_len: int
    d_model: int
    n_layer: int
    n_head: int
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        problems = [
            f"{name}={getattr(self, name)} must be >= 1"
            for name in ("vocab_size", "seq_len", "d_model", "n_layer", "n_head")
            if getattr(self, name) < 1
        ]
        if self.n_head >= 1 and self.d_model % self.n_head != 0:
            problems.append(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        # Output projection back into the residual stream: initialised smaller (see TinyGPT).
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, seq, width) -> (batch, head, seq, head_dim), the layout SDPA expects.
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer: d_model -> 4*d_model -> GELU -> d_model."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        # Output projection back into the residual stream: initialised smaller (see TinyGPT).
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-2 style decoder-only language model.

    Token and learned position embeddings, `config.n_layer` blocks in `self.blocks`, a final
    LayerNorm and a bias-free output head whose weight *is* the token embedding's weight when
    `config.tie_embeddings` (so `model.parameters()` yields it once, and `state_dict()` names it
    twice: `tok_emb.weight` and `head.weight`).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.emb_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 init: N(0, 0.02) everywhere; the projections that write into the residual stream
        # are scaled by 1/sqrt(2 * n_layer) because each block adds two of them to the stream,
        # so the stream's variance stays independent of depth at initialisation.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `idx`, or the mean cross-entropy loss against `targets` when given.

        Args:
            idx: (batch, seq) token ids with seq <= config.seq_len.
            targets: optional (batch, seq) next-token ids; positions holding -100 (IGNORE_INDEX)
                are left out of the mean.

        Returns:
            (batch, seq, vocab_size) logits when `targets` is None, else a scalar loss.
        """
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(
                f"input has {seq} tokens but GPTConfig.seq_len={self.config.seq_len}; "
                f"truncate the input or build the model with a larger seq_len"
            )
        positions = torch.arange(seq, device=idx.device)
        x = self.emb_dropout(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
        )

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of parameter elements, each shared parameter counted once.

        Args:
            non_embedding: leave out the position embedding (default False), as nanoGPT and the
                PaLM FLOPs estimate do; the token embedding stays in when it is tied, since it is
                then also the output head's matmul.
        """
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.pos_emb.weight.numel()
        return total

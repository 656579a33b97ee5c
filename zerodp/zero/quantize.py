"""Block quantization for ZeRO++'s quantized collectives (qwZ weights, qgZ gradients): pure tensor functions.

[Note: block quantization]
A 1-D tensor of n elements is cut into blocks of `block_numel` consecutive elements (the last one
shorter when block_numel does not divide n). Each block b gets one fp32 scale s_b = absmax_b / 127
and its elements become int8 q = round(x / s_b), in [-127, 127] (symmetric: -128 is never used, so
negation is exact). Dequantized, x' = q * s_b. Rounding to the nearest integer bounds the error of
every element by half a step: |x - q * s_b| <= s_b / 2, plus the rounding of the fp32 products (a
relative 2^-24 each) and of the cast to the working dtype (half a unit in the last place of x': 2^-9
relative in bf16). A block of zeros gets scale 0 and dequantizes to exact zeros.

A non-finite element makes its block's scale inf or NaN, and every element of that block dequantizes
to NaN or inf (0 * inf is NaN): an fp16 overflow in a quantized gradient still reaches the overflow check.

What a quantized tensor sends: n int8 bytes plus 4 bytes per block (`quantized_bytes`). The block size
trades the scales' overhead (4 / block_numel bytes per element) against the error (a larger block has a
larger absmax, so a coarser step); bench/zeropp.py measures both and docs/multinode.md's "ZeRO++" section
has the figures that chose `BLOCK_NUMEL`.

The functions run on whatever device their input is on (the one the collective runs on): quantizing
never copies to the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_NUMEL = 256
"""Elements per quantization block of qwZ and qgZ (one fp32 scale each): chosen from bench/zeropp.py's
measurement (docs/multinode.md, "ZeRO++")."""

INT8_MAX = 127


def num_blocks(numel: int, block_numel: int) -> int:
    """Blocks of `block_numel` elements that cover `numel` elements (the last may be partial)."""
    if block_numel <= 0:
        raise ValueError(f"block_numel must be positive, got {block_numel}")
    return -(-numel // block_numel)


def quantized_bytes(numel: int, block_numel: int) -> int:
    """Bytes a quantized tensor of `numel` elements occupies: one int8 per element, one fp32 scale
    per block."""
    return numel + 4 * num_blocks(numel, block_numel)


def _blocked(x: torch.Tensor, block_numel: int) -> torch.Tensor:
    """The rows of `x` (rows, n) as fp32 (rows, blocks, block_numel), zero-padded at the end."""
    rows, n = x.shape
    pad = num_blocks(n, block_numel) * block_numel - n
    return F.pad(x.float(), (0, pad)).view(rows, -1, block_numel)


@torch.no_grad()
def quantize_rows(x: torch.Tensor, block_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of `x` (rows, n) on its own: int8 (rows, n) and fp32 scales (rows, blocks).
    See [Note: block quantization]."""
    if x.dim() != 2:
        raise AssertionError(f"quantize_rows takes (rows, n); got shape {tuple(x.shape)}")
    n = x.shape[1]
    blocks = _blocked(x, block_numel)
    scales = blocks.abs().amax(dim=2) / INT8_MAX
    # a zero block divides by 1 (its elements are 0); a NaN or inf scale stays, to poison the block
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = (blocks / divisor.unsqueeze(2)).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.view(x.shape[0], -1)[:, :n].contiguous(), scales


def quantize(x: torch.Tensor, block_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a tensor as one flat row: int8 of its numel and fp32 scales, one per block."""
    q, scales = quantize_rows(x.reshape(1, -1), block_numel)
    return q.view(-1), scales.view(-1)


@torch.no_grad()
def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, block_numel: int) -> torch.Tensor:
    """fp32 (rows, n) from int8 `q` (rows, n) and `scales` (rows, blocks)."""
    rows, n = q.shape
    blocks = _blocked(q, block_numel) * scales.unsqueeze(2)
    return blocks.view(rows, -1)[:, :n]


def dequantize(q: torch.Tensor, scales: torch.Tensor, block_numel: int) -> torch.Tensor:
    """fp32 values of a tensor quantized by `quantize` (flat)."""
    return dequantize_rows(q.reshape(1, -1), scales.reshape(1, -1), block_numel).view(-1)


def error_bound(scales: torch.Tensor, numel: int, block_numel: int) -> torch.Tensor:
    """Each element's rounding bound s_b / 2 (fp32, `numel` elements), the scale of its block
    repeated (see [Note: block quantization])."""
    return (scales.reshape(-1) / 2).repeat_interleave(block_numel)[:numel]

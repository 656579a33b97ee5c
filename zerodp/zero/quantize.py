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

[Note: bounded temporaries]
The formula runs in fp32, so (de)quantizing a whole tensor at once would make fp32 temporaries of its
size: dequantizing a gathered unit of bf16 weights, two or three copies of twice the unit's bytes, which
raised the step's peak by a third on a 25M-parameter GPT (docs/multinode.md, "ZeRO++"). So every
function works on pieces of about CHUNK_NUMEL elements, each whole blocks of its rows, and writes each
piece's result into the output before the next: the temporaries are O(CHUNK_NUMEL), not O(tensor).
Each element goes through the same fp32 operations as on the whole tensor (a block's scale depends
only on its own elements; q * s_b is one fp32 product; the cast rounds each element on its own), and
`dequantize_sum_into` sums the same column of every row with `sum(dim=0)` as on the whole tensor, so the
results are bitwise those of the whole-tensor formula (tests/test_quantize_chunks.py compares them).

The functions run on whatever device their input is on (the one the collective runs on): quantizing
never copies to the host.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

BLOCK_NUMEL = 256
"""Elements per quantization block of qwZ and qgZ (one fp32 scale each): chosen from bench/zeropp.py's
measurement (docs/multinode.md, "ZeRO++")."""

INT8_MAX = 127

CHUNK_NUMEL = 1 << 20
"""Elements (de)quantized at a time: each fp32 temporary holds about this many (4 MiB; at least one block
of each row summed), whatever the tensor's size ([Note: bounded temporaries])."""


def num_blocks(numel: int, block_numel: int) -> int:
    """Blocks of `block_numel` elements that cover `numel` elements (the last may be partial)."""
    if block_numel <= 0:
        raise ValueError(f"block_numel must be positive, got {block_numel}")
    return -(-numel // block_numel)


def quantized_bytes(numel: int, block_numel: int) -> int:
    """Bytes a quantized tensor of `numel` elements occupies: one int8 per element, one fp32 scale
    per block."""
    return numel + 4 * num_blocks(numel, block_numel)


def _pieces(num_rows: int, numel: int, block_numel: int, chunk_numel: int) -> Iterator[tuple[slice, slice, slice]]:
    """Cover a (num_rows, numel) tensor by pieces of about `chunk_numel` elements, each whole blocks of
    its rows (a row's last block may be partial): (rows, elements, blocks) slices. Whole rows at a
    time when a row's blocks fit in a piece, else one row's blocks a piece at a time; always front to
    back in the flat order, which (de)quantizing in place relies on (zero/quantized_comm.py)."""
    blocks = num_blocks(numel, block_numel)
    blocks_per_piece = max(1, chunk_numel // block_numel)
    if blocks <= blocks_per_piece:
        rows_per_piece = max(1, blocks_per_piece // max(blocks, 1))
        for r in range(0, num_rows, rows_per_piece):
            yield slice(r, r + rows_per_piece), slice(0, numel), slice(0, blocks)
        return
    for r in range(num_rows):
        for b in range(0, blocks, blocks_per_piece):
            end = min(b + blocks_per_piece, blocks)
            yield slice(r, r + 1), slice(b * block_numel, min(end * block_numel, numel)), slice(b, end)


def _blocked(x: torch.Tensor, block_numel: int) -> torch.Tensor:
    """The rows of `x` (rows, n) as fp32 (rows, blocks, block_numel), zero-padded at the end (an fp32
    `x` whose n is whole blocks is returned as a view, not copied)."""
    rows, n = x.shape
    pad = num_blocks(n, block_numel) * block_numel - n
    x = x.float()
    return (F.pad(x, (0, pad)) if pad else x).reshape(rows, -1, block_numel)


def _quantize_piece(x: torch.Tensor, block_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 (rows, n) and fp32 scales (rows, blocks) of one piece of `x` (rows, n): the formula of
    [Note: block quantization], on fp32 temporaries of the piece's size."""
    n = x.shape[1]
    blocks = _blocked(x, block_numel)
    scales = blocks.abs().amax(dim=2) / INT8_MAX
    # a zero block divides by 1 (its elements are 0); a NaN or inf scale stays, to poison the block
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = (blocks / divisor.unsqueeze(2)).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.view(x.shape[0], -1)[:, :n], scales


@torch.no_grad()
def quantize_rows(x: torch.Tensor, block_numel: int, chunk_numel: int = CHUNK_NUMEL,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of `x` (rows, n) on its own: int8 (rows, n) and fp32 scales (rows, blocks).
    See [Note: block quantization]; about `chunk_numel` elements at a time ([Note: bounded temporaries]).
    `out` (default: a new tensor): the int8 (rows, n) to write, which may be the first rows * n bytes of
    `x`'s own contiguous memory (each piece is read before it is written, and writes byte j < e * j)."""
    if x.dim() != 2:
        raise AssertionError(f"quantize_rows takes (rows, n); got shape {tuple(x.shape)}")
    rows, n = x.shape
    q = torch.empty((rows, n), dtype=torch.int8, device=x.device) if out is None else out
    scales = torch.empty((rows, num_blocks(n, block_numel)), dtype=torch.float32, device=x.device)
    for r, cols, blocks in _pieces(rows, n, block_numel, chunk_numel):
        q[r, cols], scales[r, blocks] = _quantize_piece(x[r, cols], block_numel)
    return q, scales


def quantize(x: torch.Tensor, block_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a tensor as one flat row: int8 of its numel and fp32 scales, one per block."""
    q, scales = quantize_rows(x.reshape(1, -1), block_numel)
    return q.view(-1), scales.view(-1)


def _dequantize_piece(q: torch.Tensor, scales: torch.Tensor, block_numel: int) -> torch.Tensor:
    """fp32 (rows, n) of one piece: q * s_b, one fp32 temporary of the piece (padded to whole blocks)."""
    rows, n = q.shape
    if q.dtype != torch.int8:  # _blocked copies an int8 piece, so the multiply below may be in place
        raise AssertionError(f"dequantizing takes int8 values; got {q.dtype}")
    return _blocked(q, block_numel).mul_(scales.unsqueeze(2)).reshape(rows, -1)[:, :n]


@torch.no_grad()
def dequantize_rows_into(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_numel: int,
                         chunk_numel: int = CHUNK_NUMEL) -> torch.Tensor:
    """Write the values of int8 `q` (rows, n) with fp32 `scales` (rows, blocks) into `out` (rows, n, any
    floating dtype): q * s_b in fp32, then cast to out's dtype (round to nearest), about `chunk_numel`
    elements at a time ([Note: bounded temporaries]). Returns `out`."""
    if out.shape != q.shape:
        raise AssertionError(f"dequantizing {tuple(q.shape)} values into a buffer of shape {tuple(out.shape)}")
    for r, cols, blocks in _pieces(q.shape[0], q.shape[1], block_numel, chunk_numel):
        out[r, cols] = _dequantize_piece(q[r, cols], scales[r, blocks], block_numel)
    return out


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, block_numel: int) -> torch.Tensor:
    """fp32 (rows, n) from int8 `q` (rows, n) and `scales` (rows, blocks)."""
    return dequantize_rows_into(torch.empty(q.shape, dtype=torch.float32, device=q.device), q, scales, block_numel)


@torch.no_grad()
def dequantize_sum_into(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_numel: int,
                        chunk_numel: int = CHUNK_NUMEL) -> torch.Tensor:
    """Write the fp32 sum over the rows of the values of int8 `q` (rows, n) with `scales` (rows, blocks)
    into `out` (n elements, any floating dtype), then cast: `dequantize_rows(q, scales).sum(dim=0)`,
    about `chunk_numel` elements of `q` at a time ([Note: bounded temporaries]). Returns `out`."""
    rows, n = q.shape
    if out.numel() != n:
        raise AssertionError(f"summing {rows} rows of {n} values into a buffer of {out.numel()}")
    step = max(1, chunk_numel // (rows * block_numel)) * block_numel  # whole blocks of every row
    for start in range(0, n, step):
        cols = slice(start, min(start + step, n))
        blocks = slice(start // block_numel, num_blocks(cols.stop, block_numel))
        out.view(-1)[cols] = _dequantize_piece(q[:, cols], scales[:, blocks], block_numel).sum(dim=0)
    return out


def dequantize(q: torch.Tensor, scales: torch.Tensor, block_numel: int) -> torch.Tensor:
    """fp32 values of a tensor quantized by `quantize` (flat)."""
    return dequantize_rows(q.reshape(1, -1), scales.reshape(1, -1), block_numel).view(-1)


def error_bound(scales: torch.Tensor, numel: int, block_numel: int) -> torch.Tensor:
    """Each element's rounding bound s_b / 2 (fp32, `numel` elements), the scale of its block
    repeated (see [Note: block quantization])."""
    return (scales.reshape(-1) / 2).repeat_interleave(block_numel)[:numel]

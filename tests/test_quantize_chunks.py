"""ZeRO++'s block (de)quantization a piece at a time (zerodp/zero/quantize.py's [Note: bounded temporaries]):
bitwise the whole-tensor formula, with fp32 temporaries bounded by the chunk, not by the tensor.

The reference below is the whole-tensor formula the chunked functions replaced, kept here verbatim as the
specification: a block's scale absmax / 127, q = round(x / s) clamped to +-127, x' = q * s in fp32, then the
cast to the destination's dtype; qgZ's owner sums the dequantized rows with `sum(dim=0)` in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.harness import run_ranks
from zerodp.zero.quantize import (CHUNK_NUMEL, dequantize_rows, dequantize_rows_into, dequantize_sum_into,
                                  num_blocks, quantize_rows)


def _ref_blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    rows, n = x.shape
    return F.pad(x.float(), (0, num_blocks(n, block) * block - n)).view(rows, -1, block)


def _ref_quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _ref_blocked(x, block)
    scales = blocks.abs().amax(dim=2) / 127
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = (blocks / divisor.unsqueeze(2)).round_().clamp_(-127, 127).to(torch.int8)
    return q.view(x.shape[0], -1)[:, :x.shape[1]].contiguous(), scales


def _ref_dequantize_rows(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    return (_ref_blocked(q, block) * scales.unsqueeze(2)).view(q.shape[0], -1)[:, :q.shape[1]]


def _data(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values whose magnitude varies along the row over five decades (so blocks get different scales), and
    64 zeros at the start of every row (a zero block, scale 0, at block 64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-3, 2, n).unsqueeze(0)
    x[:, :64] = 0
    return x.to(dtype)


SIZES = [(1, 1), (1, 255), (3, 257), (2, 1000), (5, 4097), (16, 777), (40, 513), (100, 300)]


@pytest.mark.parametrize("rows,n", SIZES)
@pytest.mark.parametrize("block,chunk", [(64, 200), (256, 1000), (256, 5 * 256), (64, 1 << 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_quantize_and_dequantize_are_bitwise_the_whole_tensor_formula(
        rows: int, n: int, block: int, chunk: int, dtype: torch.dtype) -> None:
    """Sizes not multiples of the block or the chunk; chunks smaller than a row, a block (200 < 256), or larger
    than the tensor; the dequantized values into fp32, bf16 and fp16 buffers and summed over the rows."""
    x = _data(rows, n, dtype, seed=rows * 1009 + n)
    q, scales = quantize_rows(x, block, chunk)
    ref_q, ref_scales = _ref_quantize_rows(x, block)
    assert torch.equal(q, ref_q) and torch.equal(scales, ref_scales)
    values = _ref_dequantize_rows(ref_q, ref_scales, block)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.full((rows, n), float("nan"), dtype=out_dtype)  # every element must be written
        assert dequantize_rows_into(out, q, scales, block, chunk) is out
        assert torch.equal(out, values.to(out_dtype)), out_dtype
        total = torch.full((n,), float("nan"), dtype=out_dtype)
        dequantize_sum_into(total, q, scales, block, chunk)
        assert torch.equal(total, values.sum(dim=0).to(out_dtype)), out_dtype


def test_default_chunk_cuts_a_row_longer_than_it_bitwise_too() -> None:
    """Rows of more than CHUNK_NUMEL elements (a large unit's piece), at the default chunk."""
    x = _data(2, CHUNK_NUMEL + 1000 + 37, torch.bfloat16, seed=1)
    q, scales = quantize_rows(x, 256)
    ref_q, ref_scales = _ref_quantize_rows(x, 256)
    assert torch.equal(q, ref_q) and torch.equal(scales, ref_scales)
    values = _ref_dequantize_rows(q, scales, 256)
    assert torch.equal(dequantize_rows(q, scales, 256), values)
    assert torch.equal(dequantize_rows_into(torch.empty_like(x), q, scales, 256), values.to(torch.bfloat16))


@pytest.mark.parametrize("rows,n", [(1, 1000), (3, 257), (16, 777), (2, 4097)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantizing_in_place_from_the_end_of_the_destination_s_own_memory_is_bitwise_too(
        rows: int, n: int, out_dtype: torch.dtype) -> None:
    """qwZ receives the int8 values in the last numel bytes of the unit's buffer and dequantizes them over it
    (zero/quantized_comm.py's [Note: quantized collectives]): no value is overwritten before it is read."""
    x = _data(rows, n, torch.float32, seed=n)
    q, scales = quantize_rows(x, 64, 300)
    full = torch.empty(rows * n, dtype=out_dtype)
    tail = full.view(torch.int8)[-rows * n:]
    tail.copy_(q.view(-1))
    dequantize_rows_into(full.view(rows, n), tail.view(rows, n), scales, 64, 300)  # 300: many pieces, cut blocks
    assert torch.equal(full.view(rows, n), _ref_dequantize_rows(q, scales, 64).to(out_dtype))


@pytest.mark.parametrize("rows,n", [(1, 1000), (3, 257), (16, 777)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_over_the_input_s_own_memory_is_bitwise_too(rows: int, n: int, dtype: torch.dtype) -> None:
    """qgZ quantizes the gradient buffer into its own first numel bytes (zero/quantized_comm.py's [Note:
    quantized collectives]): no element is overwritten before it is read."""
    x = _data(rows, n, dtype, seed=n)
    ref_q, ref_scales = _ref_quantize_rows(x, 64)
    q, scales = quantize_rows(x, 64, 300, out=x.view(-1).view(torch.int8)[:rows * n].view(rows, n))
    assert torch.equal(q, ref_q) and torch.equal(scales, ref_scales)


def test_a_non_finite_element_still_poisons_its_block_and_only_its_block() -> None:
    x = _data(3, 700, torch.float32, seed=2)
    x[1, 300] = float("inf")
    x[2, 650] = float("nan")
    q, scales = quantize_rows(x, 256, 300)
    ref_q, ref_scales = _ref_quantize_rows(x, 256)
    assert torch.allclose(scales, ref_scales, rtol=0, atol=0, equal_nan=True) and torch.equal(q, ref_q)
    out = dequantize_rows_into(torch.empty(3, 700, dtype=torch.bfloat16), q, scales, 256, 300)
    expected = _ref_dequantize_rows(ref_q, ref_scales, 256).to(torch.bfloat16)
    assert torch.allclose(out.float(), expected.float(), rtol=0, atol=0, equal_nan=True)
    assert not bool(out[1, 256:512].isfinite().any()) and not bool(out[2, 512:].isfinite().any())
    assert bool(out[1, :256].isfinite().all()) and bool(out[0].isfinite().all())


# --- the temporaries are O(chunk) ---------------------------------------------------------------------

class _LargestFloatTemporary(TorchDispatchMode):
    """The largest fp32 storage and the largest int8 storage any op creates while the mode is on (an op's
    output that is not a view of one of its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest_bytes = self.largest_int8_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                if t.dtype == torch.float32:
                    self.largest_bytes = max(self.largest_bytes, t.untyped_storage().nbytes())
                elif t.dtype == torch.int8:
                    self.largest_int8_bytes = max(self.largest_int8_bytes, t.untyped_storage().nbytes())
        return out


def _collectives_temporaries(rank: int, world: int, numel: int) -> dict:
    """qwZ's gather of a bf16 buffer of `numel` elements and qgZ's reduce of one: the largest fp32 temporary
    each makes while quantizing (at launch) and landing (`wait()`)."""
    from zerodp.zero.quantized_comm import QuantizedGather, QuantizedReduceScatter

    x = _data(1, numel, torch.bfloat16, seed=0).view(-1)  # the same on both ranks: the gather is checkable
    largest = {}
    full, reduced = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel // world, dtype=torch.bfloat16)
    piece = numel // world
    for name, make in (("gather", lambda: QuantizedGather(full, x[rank * piece:(rank + 1) * piece], None, 256)),
                       ("reduce", lambda: QuantizedReduceScatter(reduced, x.clone(), None, 256))):  # scratch
        with _LargestFloatTemporary() as launch:
            work = make()
        with _LargestFloatTemporary() as land:
            work.wait()
        largest[name] = (launch.largest_bytes, land.largest_bytes, launch.largest_int8_bytes)
    q, scales = _ref_quantize_rows(x.view(world, -1), 256)
    values = _ref_dequantize_rows(q, scales, 256)
    largest["gathered exactly"] = torch.equal(full, values.reshape(-1).to(full.dtype))
    # every rank sent the same x, so this rank's piece arrived `world` times
    largest["reduced exactly"] = torch.equal(reduced, values[rank].expand(world, -1).sum(dim=0).to(reduced.dtype))
    return largest


def test_qwz_and_qgz_hold_fp32_temporaries_of_a_chunk_not_of_the_buffer() -> None:
    """2 ranks, a bf16 buffer of 3 chunks and a bit: gathering it with qwZ and reducing it with qgZ creates no
    fp32 tensor larger than a chunk (the whole-buffer formula made fp32 copies of all of it: 4 bytes an
    element, twice the bf16 buffer), and no int8 buffer of the whole (the int8 values live in the bf16 buffers'
    own memory); the gathered and reduced values are bitwise the whole-tensor formula's."""
    numel = 2 * (3 * CHUNK_NUMEL // 2 + 4 * 256 + 6)  # each rank's piece 1.5 chunks and 4 blocks, + 6 elements
    for largest in run_ranks(_collectives_temporaries, 2, args=(numel,), timeout=120):
        assert largest.pop("gathered exactly") and largest.pop("reduced exactly")
        for name, (launch_bytes, land_bytes, _) in largest.items():
            assert 0 < land_bytes <= 4 * CHUNK_NUMEL, (name, land_bytes)
            assert launch_bytes <= 4 * CHUNK_NUMEL, (name, launch_bytes)
        # qwZ's int8 values arrive in the end of the unit's own buffer: the one int8 tensor made is this rank's
        # piece; qgZ's are quantized over the gradient buffer and arrive in it: int8 pieces of a chunk only
        assert largest["gather"][2] == numel // 2 and largest["reduce"][2] <= CHUNK_NUMEL

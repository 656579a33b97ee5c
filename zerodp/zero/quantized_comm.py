"""ZeRO++'s quantized collectives at stage 3: the all-gather of a unit's weights (qwZ) and the
reduce-scatter of its gradients (qgZ), each sending int8 blocks plus their fp32 scales
(zero/quantize.py's [Note: block quantization]) through zerodp.comm, whose ledger counts the bytes
actually sent.

[Note: quantized collectives]
- qwZ (`zero_quantized_weights`): the source shard (this rank's owned shard, or with hpZ its secondary
  shard) is quantized on the device the gather runs on, its int8 payload and its scales are all-gathered
  (two collectives), and `wait()` dequantizes every rank's piece into the unit's full buffer in the
  working dtype. The int8 payloads arrive in the full buffer's own memory, its last numel bytes, so a
  gather in flight holds no more than an unquantized one (with prefetching, several are in flight at
  once): dequantizing piece by piece from the front (zero/quantize.py's [Note: bounded temporaries])
  writes elements [a, b) over bytes [e*a, e*b) (e bytes an element), and reads each piece before it
  writes it, so the int8 value j, at byte (e-1)*numel + j >= e*b for every j >= b (b <= numel), is
  never overwritten before it is read. With offload_param the shard is first copied to that device (as the unquantized gather
  does), then quantized there, as DeepSpeed 0.19.8 does (`quantize(ds_tensor.to(device))`).
- hpZ with qwZ, as DeepSpeed 0.19.8 does it: every gather of the forward and backward passes is quantized,
  the primary one over all ranks and the later ones over the secondary (intra-node) group; the secondary
  copy itself is kept in the working dtype (the dequantized values of the primary gather) and quantized
  again for each secondary gather.
- qgZ (`zero_quantized_gradients`): the gradient buffer's world pieces (piece r is rank r's shard) are
  each quantized, sent with one all-to-all of payloads and one of scales, and the owner dequantizes the
  world pieces it receives and sums them in fp32 (deterministic: the same order on every run). Both
  int8 payloads live in the gradient buffer's own memory (its first numel bytes quantized over it, a
  piece read before it is written; the received ones in the next numel bytes), so a reduce in flight
  holds no more than an unquantized one. int8
  over one hop, not DeepSpeed's int4 over two (an all-to-all inside the node, a re-quantized one across
  nodes, CUDA kernels only): int4's step is 18x int8's (7 levels a side, not 127) and the second hop
  quantizes partial sums again; int8 keeps the gradient's error at the weights' level for 4x less
  traffic than fp32, on any backend (gloo and NCCL both run all_to_all_single). DeepSpeed too reads the
  key at stage 3 only.
- Gathers that must be exact are not quantized: `GatheredParameters`, the state dict and
  `save_16bit_model` (DeepSpeed quantizes only the fetches of the forward and backward passes), the
  persistent unit, and the broadcast at start-up.
"""

from __future__ import annotations

import torch

from zerodp import comm
from zerodp.zero.quantize import dequantize_rows_into, dequantize_sum_into, quantize, quantize_rows


class _Quantized:
    """A quantized collective in flight: int8 `payloads` and fp32 `scales` arriving (each rank's piece
    one row); `wait()` waits for both, then `_land` dequantizes them into the result, a piece at a time
    (zero/quantize.py's [Note: bounded temporaries]: no fp32 copy of the whole buffer)."""

    def __init__(self, num_ranks: int, block_numel: int) -> None:
        self.num_ranks, self.block_numel = num_ranks, block_numel
        self.works: list = []

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        self._land(self.payloads.view(self.num_ranks, -1), self.scales.view(self.num_ranks, -1))
        self.payloads = self.scales = None

    def _land(self, payloads: torch.Tensor, scales: torch.Tensor) -> None:
        raise NotImplementedError


class QuantizedGather(_Quantized):
    """qwZ: an all-gather of `source` (this rank's piece of `full`) as int8 blocks and scales over
    `group`, in flight; `wait()` dequantizes every rank's piece into `full`."""

    def __init__(self, full: torch.Tensor, source: torch.Tensor, group, block_numel: int) -> None:
        super().__init__(comm.get_world_size(group), block_numel)
        self.full = full
        payload, scales = quantize(source, block_numel)
        self.payloads = _int8_tail(full, self.num_ranks * payload.numel())
        self.scales = torch.empty(self.num_ranks * scales.numel(), dtype=scales.dtype, device=full.device)
        self.works = [comm.all_gather_into_tensor(self.payloads, payload, group=group, async_op=True),
                      comm.all_gather_into_tensor(self.scales, scales, group=group, async_op=True)]

    def _land(self, payloads: torch.Tensor, scales: torch.Tensor) -> None:
        # straight into the working dtype (fp32 products, rounded to nearest), rank r's piece row r
        dequantize_rows_into(self.full.view(self.num_ranks, -1), payloads, scales, self.block_numel)


def _int8_tail(full: torch.Tensor, numel: int) -> torch.Tensor:
    """The last `numel` bytes of `full`'s memory as int8: qwZ's receive buffer ([Note: quantized collectives])."""
    if full.dim() != 1 or not full.is_contiguous() or numel != full.numel():
        raise AssertionError(f"qwZ receives {numel} int8 values into the end of a flat buffer of the same numel; got "
                             f"shape {tuple(full.shape)}, strides {full.stride()}")
    return full.view(torch.int8)[-numel:]


class QuantizedReduceScatter(_Quantized):
    """qgZ: reduce-scatter `buffer` (world equal pieces) into `out` by an all-to-all of int8 pieces
    and scales over `group`, in flight; `wait()` sums the dequantized pieces in fp32 into `out`.
    `buffer` is scratch afterwards, as reduce_scatter_tensor's input: the int8 pieces sent and those
    received live in its memory ([Note: quantized collectives])."""

    def __init__(self, out: torch.Tensor, buffer: torch.Tensor, group, block_numel: int) -> None:
        super().__init__(comm.get_world_size(group), block_numel)
        self.out = out
        if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.element_size() < 2:
            raise AssertionError(f"qgZ reduces a flat buffer of 2 or more bytes an element; got shape "
                                 f"{tuple(buffer.shape)}, {buffer.dtype}")
        pieces, numel = buffer.view(self.num_ranks, -1), buffer.numel()
        memory = buffer.view(torch.int8)  # the buffer is scratch: quantized over, received into
        payloads, scales = quantize_rows(pieces, block_numel, out=memory[:numel].view(pieces.shape))
        self.payloads, self.scales = memory[numel:2 * numel].view(pieces.shape), torch.empty_like(scales)
        self.works = [comm.all_to_all_single(self.payloads, payloads, group=group, async_op=True),
                      comm.all_to_all_single(self.scales, scales, group=group, async_op=True)]

    def _land(self, payloads: torch.Tensor, scales: torch.Tensor) -> None:
        dequantize_sum_into(self.out, payloads, scales, self.block_numel)

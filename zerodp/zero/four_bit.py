"""4-bit weights (bitsandbytes' `Params4bit`, QLoRA's frozen base) under ZeRO: what their storage dtype must be.

[Note: the storage dtype of a 4-bit weight]
bitsandbytes packs two 4-bit codes per byte and keeps them in a tensor of `bnb_4bit_quant_storage` (uint8 by
default): the tensor's dtype is a container, its bytes are codes. zerodp casts the model's floating-point
parameters to the training dtype (the frozen ones too: flat.prepare_module), and stage 3 flattens every
parameter of a unit into one buffer of the training dtype; both convert values, so a container of another
dtype would come out holding different bytes, and the model would compute with wrong weights (measured on
the tiny Llama of tests/test_qlora.py, bf16 training: fp16 storage trains without an error on losses 0.12
away from the right ones; fp32 storage fails inside bitsandbytes with a reshape error). Storage in the
training dtype is what QLoRA under ZeRO-3 / FSDP needs anyway, so anything else is refused before the first
collective. uint8 storage is no float, so stages 0-2 leave it alone (it trains, as measured), and only
stage 3, which would flatten it, refuses it.
"""

from __future__ import annotations

import torch
from torch import nn

from zerodp.memory import is_quantized


def check_4bit_storage(module: nn.Module, dtype: torch.dtype, stage: int) -> None:
    """ValueError naming the first 4-bit weight of `module` whose storage dtype would be converted: a floating
    container other than the training `dtype`, or (stage 3) any container other than `dtype`; see
    [Note: the storage dtype of a 4-bit weight]."""
    for name, p in module.named_parameters():
        if not is_quantized(p) or p.dtype == dtype or (stage < 3 and not p.is_floating_point()):
            continue
        what = "stage 3 flattens it into a buffer of" if stage == 3 else "zerodp casts floating parameters to"
        raise ValueError(
            f"4-bit weight {name}: its storage dtype (bnb_4bit_quant_storage) is {p.dtype}, the training dtype is "
            f"{dtype}, and {what} the training dtype, which would change the packed 4-bit codes (wrong weights). "
            f"Load the model with BitsAndBytesConfig(..., bnb_4bit_quant_storage={dtype}) (QLoRA under ZeRO-3 needs "
            f"it), or train in the storage's dtype" + (", or use stage 0-2" if stage == 3 and not p.is_floating_point()
                                                        else ""))

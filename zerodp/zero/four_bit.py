"""4-bit weights (bitsandbytes' `Params4bit`, QLoRA's frozen base) under ZeRO: what their storage dtype must be,
and reentrant activation checkpointing of layers behind a frozen base (no adapter gradient).

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

[Note: reentrant checkpointing behind a frozen base]
torch's reentrant checkpoint (`use_reentrant=True`) runs the layer under no_grad and links its output to the
graph only through the layer's tensor inputs: if none of them requires grad, the output needs none and the
parameters inside get no gradient. In a LoRA / QLoRA model the embedding is frozen, so the first layer's input
needs no grad; when every layer is checkpointed the loss needs none either and backward fails with torch's
"element 0 of tensors does not require grad and does not have a grad_fn"; when only some are (transformers'
`every_n_layers`), training runs and those layers' adapters silently never change (measured on the tiny Llama
of tests/test_qlora_offload.py: layer 0's adapters got no gradient). Hugging Face's fix is a forward hook on the
input embeddings that makes their output require grad (`model.enable_input_require_grads()`, which
`peft.prepare_model_for_kbit_training` and transformers >= 5 call); the other is non-reentrant checkpointing.
So initialize refuses the combination it can be sure of: the first layer of a stack is checkpointed reentrantly
and holds trainable parameters, the input embeddings are frozen with no forward hook, and every trainable
parameter lies inside that stack. With a trainable parameter elsewhere (a multimodal projector may feed the
layers a tensor that needs grad) it only warns. Hugging Face's layers are found duck-typed: a module in an
`nn.ModuleList` with `gradient_checkpointing` set and a `_gradient_checkpointing_func` bound with
use_reentrant=True. A checkpoint the model calls itself is not seen.
"""

from __future__ import annotations

import torch
from torch import nn

from zerodp.log import warn_once
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


def check_reentrant_checkpointing(module: nn.Module) -> None:
    """ValueError (or, when unsure, a warning) when a layer of `module` is checkpointed reentrantly behind a frozen
    input embedding, so that its trainable parameters (LoRA adapters) would get no gradient; see
    [Note: reentrant checkpointing behind a frozen base]."""
    names = {id(m): n for n, m in module.named_modules()}
    for stack in module.modules():
        if not isinstance(stack, nn.ModuleList) or not len(stack) or not _checkpointed_reentrantly(stack[0]) \
                or not any(p.requires_grad for p in stack[0].parameters()):
            continue
        embeddings = _input_embeddings(module)
        if embeddings is None or embeddings._forward_hooks or any(p.requires_grad for p in embeddings.parameters()):
            return
        inside = {id(p) for p in stack.parameters()}
        outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
        message = (f"activation checkpointing of {names[id(stack[0])]} is reentrant (use_reentrant=True) and the "
                   f"input embeddings {names.get(id(embeddings), '')} are frozen, so the layer's inputs need no grad "
                   "and its trainable parameters (the adapters) get no gradient: torch fails with 'element 0 of "
                   "tensors does not require grad', or the adapters silently never change. Call "
                   "model.enable_input_require_grads() before initialize (peft.prepare_model_for_kbit_training "
                   "does), or enable checkpointing with gradient_checkpointing_kwargs={'use_reentrant': False}")
        if not outside:
            raise ValueError(message)
        warn_once(f"{message} (unless a trainable parameter outside the layers, such as {outside[0]}, makes their "
                  "inputs require grad)")
        return


def _checkpointed_reentrantly(layer: nn.Module) -> bool:
    """Whether Hugging Face's activation checkpointing is on for `layer` with use_reentrant=True."""
    func = getattr(layer, "_gradient_checkpointing_func", None)
    return getattr(layer, "gradient_checkpointing", False) is True and \
        getattr(func, "keywords", {}).get("use_reentrant") is True


def _input_embeddings(module: nn.Module) -> nn.Module | None:
    """The model's input embedding module (Hugging Face's `get_input_embeddings`), or None."""
    getter = getattr(module, "get_input_embeddings", None)
    try:
        embeddings = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):  # a model without one says so by raising
        return None
    return embeddings if isinstance(embeddings, nn.Module) else None

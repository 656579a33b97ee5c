"""QLoRA as the estimator sees it: a 4-bit (NF4) frozen base and LoRA adapters, on a model built on the meta device.

`apply_qlora(module, QLoRA(rank=R), dtype_bytes)` turns a meta model into the one ZeRO would hold after
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=<the model's dtype>)`
and PEFT's `get_peft_model(model, LoraConfig(r=R, target_modules=...))`: each quantized Linear's weight becomes a
frozen parameter of its packed bytes in the storage dtype (what ZeRO flattens and shards; the ledger's
`param4bit`), its quantization statistics the weight's `quant_state` (kept whole on every rank, as bitsandbytes
keeps them beside the weight; the ledger's `quant_state`), and every
targeted Linear gains `lora_A` / `lora_B`, the only parameters that train. The model-state arithmetic
(zerodp/plan/model_states.py) then counts it like any other model.

[Note: the bytes of one NF4 weight]
bitsandbytes packs two 4-bit codes per byte (ceil(n/2) bytes, held in a tensor of the storage dtype) and keeps
per block of 64 elements an absmax: fp32 (4 bytes) or, with double quantization
(`bnb_4bit_use_double_quant`), a uint8 plus one fp32 absmax per 256 blocks, a 256-entry fp32 map and an fp32
offset; and a 16-entry fp32 NF4 map per weight. Measured with bitsandbytes 0.50.2 (`quantize_4bit` of a
300 x 1000 bf16 weight, `QuantState.as_dict()`): 150,000 packed bytes; absmax 18,752 bytes (4,688 fp32), or
4,688 + 76 + 1,024 + 4 with double quantization; quant_map 64. Per element, the maps aside: 0.5625 bytes, or ~0.5159 with
double quantization. The output layer (lm_head) stays in the model's dtype, as transformers leaves it.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from zerodp.plan.workload import Workload

QUANTIZATIONS = ("none", "nf4")
"""What `zerodp estimate --quantization` takes: none, or NF4 4-bit weights (bitsandbytes, QLoRA)."""
NF4_BLOCK = 64  # elements per absmax (bitsandbytes' 4-bit default blocksize)
NESTED_BLOCK = 256  # absmax values per fp32 absmax under double quantization
NF4_MAP_BYTES = 16 * 4  # the NF4 code table (fp32), one per weight
NESTED_MAP_BYTES = 256 * 4 + 4  # double quantization's 8-bit map (fp32) and its offset
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class QLoRA:
    """A QLoRA setup: adapter `rank`, the Linear layers adapted (`targets`: PEFT's "all-linear", every
    quantized Linear, or module-name suffixes such as ("q_proj", "v_proj")), double quantization of the
    absmax statistics (bitsandbytes' default: off)."""

    rank: int
    targets: tuple[str, ...] = (ALL_LINEAR,)
    double_quant: bool = False

    def adapts(self, name: str) -> bool:
        """Whether the quantized Linear called `name` gets adapters."""
        return self.targets == (ALL_LINEAR,) or any(name == t or name.endswith("." + t) for t in self.targets)


@dataclass(frozen=True)
class ConfigQuantization:
    """What a Hugging Face config's `quantization_config` says: the quantization (`nf4`, or a name zerodp does
    not estimate such as `fp4` or `int8`), double quantization, and the 4-bit storage dtype's name."""

    quantization: str
    double_quant: bool = False
    storage: str = "uint8"


STORAGE_OF = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""The `bnb_4bit_quant_storage` that trains in each --dtype (zerodp/zero/four_bit.py refuses the others)."""


def config_quantization(module: "torch.nn.Module") -> ConfigQuantization | None:
    """The `quantization_config` of `module`'s Hugging Face config (None when it has none), as
    `BitsAndBytesConfig.to_dict()` writes it into config.json."""
    found = getattr(getattr(module, "config", None), "quantization_config", None)
    if found is None:
        return None
    raw = found if isinstance(found, dict) else found.to_dict() if hasattr(found, "to_dict") else vars(found)
    method = str(getattr(raw.get("quant_method"), "value", raw.get("quant_method", "bitsandbytes")))
    if method != "bitsandbytes":
        return ConfigQuantization(method)
    if raw.get("load_in_8bit"):
        return ConfigQuantization("int8 (load_in_8bit)")
    if not raw.get("load_in_4bit"):
        return None  # a bitsandbytes config that quantizes nothing
    storage = str(raw.get("bnb_4bit_quant_storage") or "uint8").removeprefix("torch.")
    return ConfigQuantization(str(raw.get("bnb_4bit_quant_type", "fp4")), bool(raw.get("bnb_4bit_use_double_quant")),
                              storage)


def nf4_packed_bytes(numel: int) -> int:
    """Bytes of `numel` 4-bit codes, two to a byte."""
    return (numel + 1) // 2


def nf4_state_bytes(numel: int, double_quant: bool = False) -> int:
    """Bytes of one NF4 weight's quantization statistics and maps (see [Note: the bytes of one NF4 weight])."""
    blocks = -(-numel // NF4_BLOCK)
    if not double_quant:
        return 4 * blocks + NF4_MAP_BYTES
    return blocks + 4 * -(-blocks // NESTED_BLOCK) + NESTED_MAP_BYTES + NF4_MAP_BYTES


def lora_numel(in_features: int, out_features: int, rank: int) -> int:
    """Trainable elements LoRA adds to one Linear: A (rank x in) and B (out x rank)."""
    return rank * (in_features + out_features)


@dataclass(frozen=True)
class QLoRASummary:
    """What `apply_qlora` did: weights quantized, their elements, adapters added and their elements."""

    quantized: int
    quantized_numel: int
    adapted: int
    trainable_numel: int


def apply_qlora(module: "torch.nn.Module", qlora: QLoRA, dtype_bytes: int,
                storage: "torch.dtype | None" = None) -> QLoRASummary:
    """Make `module` (built on the meta device) the model ZeRO holds under QLoRA (see the module's docstring):
    every parameter frozen, every Linear but the output layer quantized to NF4 stored in a `dtype_bytes`
    container (of dtype `storage`, default the weight's: a simulated step needs the training dtype, which
    zerodp requires), adapters of `qlora.rank` on the targeted ones. ValueError when no Linear is quantized or a
    target matches none."""
    import torch
    from torch import nn

    if qlora.rank < 1:
        raise ValueError(f"--lora-rank {qlora.rank}: expected a positive adapter rank such as 8 or 64")
    for p in module.parameters():
        p.requires_grad_(False)
    output = _output_layer(module)
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear) and m is not output]
    if not linears:
        raise ValueError("--quantization nf4: the model has no Linear layer to quantize (bitsandbytes quantizes "
                         "nn.Linear weights)")
    missing = [t for t in qlora.targets if t != ALL_LINEAR and not any(QLoRA(1, (t,)).adapts(n) for n, _ in linears)]
    if missing:
        raise ValueError(f"--lora-targets: no quantized Linear is called {', '.join(missing)} (names such as "
                         f"{', '.join(sorted({n.rsplit('.', 1)[-1] for n, _ in linears})[:8])}, or {ALL_LINEAR})")
    quantized_numel = trainable = adapted = 0
    for name, linear in linears:
        numel = linear.weight.numel()
        quantized_numel += numel
        container = -(-nf4_packed_bytes(numel) // dtype_bytes)
        device = linear.weight.device  # meta for the estimate, fake for a simulated step (zerodp plan)
        linear.weight = nn.Parameter(torch.empty(container, 1, device=device, dtype=storage or linear.weight.dtype),
                                     requires_grad=False)
        linear.weight.quant_state = MetaQuantState(torch.empty(nf4_state_bytes(numel, qlora.double_quant),
                                                               device=device, dtype=torch.uint8))
        linear.forward = types.MethodType(_qlora_forward, linear)
        if qlora.adapts(name):
            linear.lora_A = nn.Linear(linear.in_features, qlora.rank, bias=False, device=device)
            linear.lora_B = nn.Linear(qlora.rank, linear.out_features, bias=False, device=device)
            trainable += lora_numel(linear.in_features, linear.out_features, qlora.rank)
            adapted += 1
    return QLoRASummary(len(linears), quantized_numel, adapted, trainable)


def _qlora_forward(self: "torch.nn.Linear", x: "torch.Tensor") -> "torch.Tensor":
    """A quantized Linear's forward in shapes and bytes, as bitsandbytes' Linear4bit and PEFT's LoRA run it on a
    GPU: the weight dequantized into a transient of the input's dtype, the matmul, plus lora_B(lora_A(x))."""
    import torch
    import torch.nn.functional as F

    weight = torch.empty(self.out_features, self.in_features, dtype=x.dtype, device=x.device)
    out = F.linear(x, weight, self.bias)
    if hasattr(self, "lora_A"):
        out = out + self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))).to(out.dtype)
    return out


def qlora_workload(work: "Workload", qlora: QLoRA, dtype: str) -> "Workload":
    """`work` whose every build is the model QLoRA trains (`apply_qlora`): what `zerodp plan --quantization nf4`
    simulates, so its candidates are costed with the 4-bit base, its quantization state and adapter-only
    training state, and stage 3 gathers the packed codes; stored in the training `dtype` ("bf16", ...)."""
    import torch

    storage = getattr(torch, STORAGE_OF[dtype])

    def build() -> "torch.nn.Module":
        module = work.build()
        apply_qlora(module, qlora, storage.itemsize, storage)
        return module

    return dataclasses.replace(work, build=build, spec=f"{work.spec} (QLoRA nf4, LoRA rank {qlora.rank})")


class MetaQuantState:
    """A 4-bit weight's quantization state on the meta device: its bytes as one uint8 tensor, an attribute of
    the weight as bitsandbytes' `QuantState` is (zerodp/memory.py's `quant_state_tensors` reads either)."""

    def __init__(self, statistics: "torch.Tensor") -> None:
        self.statistics = statistics


def _output_layer(module: "torch.nn.Module") -> "torch.nn.Module | None":
    """The output projection transformers leaves unquantized (its `get_output_embeddings()`, else `lm_head`)."""
    getter = getattr(module, "get_output_embeddings", None)
    found = getter() if callable(getter) else None
    return found if found is not None else getattr(module, "lm_head", None)

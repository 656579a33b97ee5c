"""The models `zerodp estimate`, `zerodp plan` and the simulation take: `workload(spec)` names one.

A Workload builds its model on whatever device the caller's `torch.device` context sets (meta or fake
tensors: shapes only) and makes one micro-batch for it, so the estimator can simulate its training step
(zerodp/plan/simulate.py) without reading a weight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from pathlib import Path

    import torch


MAX_CONFIG_BYTES = 1 << 20
"""The largest config.json read (real ones are a few kB): a device or a huge file is refused, not read."""
MAX_LAYERS = 10_000
"""The most blocks a model to estimate may have: the largest published models have about 130, and a
config naming 1e8 would build its modules on the meta device for hours before a figure came out."""
MAX_WIDTH = 10**7
"""The largest hidden, intermediate, head or vocabulary size accepted (real ones stay under ~3e5)."""
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "num_encoder_layers")
_WIDTH_KEYS = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
               "n_embd", "n_head", "d_model", "n_inner", "d_ff", "seq_len", "max_position_embeddings", "n_positions",
               "num_local_experts", "num_experts", "moe_intermediate_size")


def check_sizes(source: str, sizes: dict) -> None:
    """ValueError naming the first model size in `sizes` (a config's fields; nested dicts such as a
    multimodal model's text_config are read too) that is not a whole number from 1 up to its bound, before
    anything is built from it."""
    for key, value in sizes.items():
        if isinstance(value, dict):
            check_sizes(f"{source} {key}", value)
            continue
        bound = MAX_LAYERS if key in _LAYER_KEYS else MAX_WIDTH if key in _WIDTH_KEYS else None
        if bound is None or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            raise ValueError(f"MODEL {source}: {key} {value!r} is not a whole number from 1 to {bound:,}"
                             + (" (the largest published models have about 130 layers)" if bound == MAX_LAYERS else ""))


@dataclass(frozen=True)
class Workload:
    """A model to estimate: `build()` makes it (on whatever device the caller's `torch.device`
    context sets, meta or fake: shapes only), `inputs(model, micro_batch, seq_len, device)` one
    micro-batch as (args, kwargs) whose forward returns the loss or an output with `.loss` (None: this
    model's input is unknown, so only its model states are estimated), `max_seq_len` the longest
    input it takes (None: unknown)."""

    spec: str
    build: Callable[[], "torch.nn.Module"]
    inputs: Callable[["torch.nn.Module", int, int, "torch.device"], tuple[tuple, dict]] | None = None
    max_seq_len: int | None = None
    input_method: str | None = None  # the method a built module needs for `inputs` to feed it

    def meta(self) -> "torch.nn.Module":
        """The model on the meta device: no weights are allocated or read."""
        import torch

        with torch.device("meta"):
            return self.build()

    def feeds(self, module: "torch.nn.Module") -> bool:
        """Whether `inputs` can feed this built module (else only its model states are estimated)."""
        return self.inputs is not None and (self.input_method is None or hasattr(module, self.input_method))


def workload(spec: str) -> Workload:
    """The workload `spec` names: "demo" (the demo's GPT), "gpt:d_model=1024,n_layer=24,..." (the
    demo's GPT at other sizes: GPTConfig's fields, the rest as the demo's), a Hugging Face config
    file or model directory (config.json; transformers needed; a causal LM is fed token ids and
    labels), or "module:function" returning an nn.Module (fed by its `estimate_inputs(micro_batch,
    seq_len)` method when it has one, returning (args, kwargs)). ValueError naming the spec otherwise."""
    import importlib
    from pathlib import Path

    if spec == "demo" or spec.startswith("gpt:"):
        return _gpt_workload(spec)
    path = Path(spec)
    if path.is_dir() or path.suffix == ".json":
        return _hf_workload(path)
    module_name, _, function = spec.partition(":")
    if not function:
        raise ValueError(f"MODEL {spec!r}: expected demo, gpt:KEY=VALUE,..., a Hugging Face config (file or "
                         "directory) or module:function")
    try:
        factory = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"MODEL {spec!r}: {err}") from None

    def build() -> "torch.nn.Module":
        import torch

        made = factory()
        if not isinstance(made, torch.nn.Module):
            raise ValueError(f"MODEL {spec!r}: {function}() returned a {type(made).__name__}, not an nn.Module")
        return made

    def inputs(module: "torch.nn.Module", micro_batch: int, seq_len: int, device: "torch.device") -> tuple[tuple, dict]:
        import torch

        with torch.device(device):
            args, kwargs = module.estimate_inputs(micro_batch, seq_len)
        return tuple(args), dict(kwargs)

    return Workload(spec, build, inputs, input_method="estimate_inputs")


def _gpt_workload(spec: str) -> Workload:
    import dataclasses

    import torch

    from zerodp.demo import DEMO_DEFAULT, TinyGPT

    fields = {f.name: f.type for f in dataclasses.fields(DEMO_DEFAULT)}
    sizes = {}
    for item in filter(None, spec.partition(":")[2].split(",")):
        key, _, value = item.partition("=")
        if key not in fields or not value.strip().lstrip("-").replace(".", "", 1).isdigit():
            raise ValueError(f"MODEL {spec!r}: {item!r} is not KEY=NUMBER with KEY one of {', '.join(fields)}")
        sizes[key] = float(value) if "." in value else int(value)
    check_sizes(repr(spec), {k: v for k, v in sizes.items() if k != "dropout"})
    config = dataclasses.replace(DEMO_DEFAULT, **sizes)

    def inputs(_: "torch.nn.Module", micro_batch: int, seq_len: int, device: "torch.device") -> tuple[tuple, dict]:
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device)
        return (ids, ids), {}

    return Workload(spec, lambda: TinyGPT(config), inputs, config.seq_len)


def _hf_workload(path: "Path") -> Workload:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"MODEL {path}: a Hugging Face config needs transformers (pip install transformers)") from None
    if not path.exists() or (path.is_dir() and not (path / "config.json").is_file()):
        raise ValueError(f"MODEL {path}: no config.json there")
    import torch

    config = _hf_config(transformers, path)
    causal = type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel

    def build() -> "torch.nn.Module":
        try:
            return auto.from_config(config)
        except ValueError as err:
            raise ValueError(f"MODEL {path}: transformers builds no model from its config "
                             f"(model_type {config.model_type!r}): {err}") from None

    def inputs(_: "torch.nn.Module", micro_batch: int, seq_len: int, device: "torch.device") -> tuple[tuple, dict]:
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device)
        return (), {"input_ids": ids, "labels": ids}

    longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return Workload(str(path), build, inputs if causal else None, longest)


def _hf_config(transformers: Any, path: "Path") -> Any:
    """transformers' config of `path`, its sizes checked first; ValueError naming the file for what it cannot read."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():  # a FIFO would block the read, a device never end it
        raise ValueError(f"MODEL {file}: not a regular file")
    try:
        with open(file, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"MODEL {file}: over {MAX_CONFIG_BYTES:,} bytes, not a model config")
        raw = json.loads(text.decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"MODEL {file}: not a readable JSON config ({type(err).__name__}: {err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"MODEL {file}: a Hugging Face config is a JSON object, not a {type(raw).__name__}")
    check_sizes(str(file), raw)
    try:
        return transformers.AutoConfig.from_pretrained(str(path))
    except Exception as err:  # noqa: BLE001 - transformers' own errors vary by model type and release
        raise ValueError(f"MODEL {file}: transformers cannot read it ({type(err).__name__}: "
                         f"{str(err).strip().splitlines()[0][:300] if str(err).strip() else ''})") from None


def meta_model(spec: str) -> "torch.nn.Module":
    """Build `spec` (see `workload`) on the meta device: no weights are allocated or read."""
    return workload(spec).meta()


"""The models `zerodp estimate`, `zerodp plan` and the simulation take: `workload(spec)` names one.

A Workload builds its model on whatever device the caller's `torch.device` context sets (meta or fake
tensors: shapes only) and makes one micro-batch for it, so the estimator can simulate its training step
(zerodp/plan/simulate.py) without reading a weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pathlib import Path

    import torch


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

    config = transformers.AutoConfig.from_pretrained(str(path))
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


def meta_model(spec: str) -> "torch.nn.Module":
    """Build `spec` (see `workload`) on the meta device: no weights are allocated or read."""
    return workload(spec).meta()


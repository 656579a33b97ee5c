"""The base of every config section and the value types the sections share.

`Section` (strict pydantic, only known keys, deprecated names upgraded), `Int` (an int that takes `5e8`),
`DType` (DeepSpeed's dtype spellings), `Device` (the offload devices), and the small validators and field
helpers schema.py's sections are built from.

[Note: strict types]
Every section is strict: a number is not accepted as a bool, "8" is not accepted as 8 (a Hugging
Face integration pitfall, LlamaFactory #1116), and a bool is not accepted as a number. Integer keys
accept a float with no fractional part (`5e8`), because DeepSpeed's own docs write sizes that way.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional

from pydantic import AliasChoices, BaseModel, BeforeValidator, ConfigDict, model_validator

from zerodp.config.deprecated import upgrade_for_model


def _whole_float_to_int(value: Any) -> Any:
    """5e8 -> 500000000; anything else is left for the strict int check to accept or reject."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def infinity_is_never(value: Any) -> Any:
    """steps_per_print: Infinity (accelerate writes float("inf")) means never, as None does."""
    return None if isinstance(value, float) and value == float("inf") else value


def lower(value: Any) -> Any:
    """DeepSpeed lower-cases these names before comparing them; so do we."""
    return value.lower() if isinstance(value, str) else value


def _lower_case_device(value: Any) -> Any:
    """DeepSpeed's offload device is an enum of lower-case names: "CPU" is refused there, so here."""
    if isinstance(value, str) and value != value.lower() and value.lower() in ("none", "cpu", "nvme"):
        raise ValueError(f"device names are lower case, as in DeepSpeed: did you mean \"{value.lower()}\"?")
    return value


_DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}


def _canonical_dtype(value: Any) -> Any:
    """Accept DeepSpeed's dtype spellings ("float32", "torch.bfloat16", ...) as fp32/fp16/bf16."""
    if isinstance(value, str):
        return _DTYPE_NAMES.get(value.lower(), value)
    return value


def even(value: int) -> int:
    if value % 2:
        raise ValueError("must be even (DeepSpeed's stage 1/2 all-gather splits it in halves)")
    return value


def auto_or_names(value: Any) -> Any:
    if value is None or value == "auto":
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise ValueError('expected "auto", null, or a list of module names')


Int = Annotated[int, BeforeValidator(_whole_float_to_int)]
DType = Annotated[Optional[Literal["fp32", "fp16", "bf16"]], BeforeValidator(_canonical_dtype)]
Device = Annotated[Literal["none", "cpu", "nvme"], BeforeValidator(_lower_case_device)]


class Section(BaseModel):
    """Base of every config section: types are strict, and pydantic sees only known keys.

    `renamed_keys` maps an old key name to its current name (applied, with a warning, by
    `load_config` before validation); `removed_keys` maps a key DeepSpeed removed to
    (the feature it configured, what to do). `deepspeed_ignores_unknown` says whether DeepSpeed
    0.19.8 reads the section with dict.get (an unknown key is ignored there) rather than with a
    pydantic model that forbids extra keys; load_config's policy for unknown keys follows it
    (see [Note: unknown keys] in zerodp/config/unknown.py).
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    renamed_keys: ClassVar[dict[str, str]] = {}
    removed_keys: ClassVar[dict[str, tuple[str, str]]] = {}
    deepspeed_ignores_unknown: ClassVar[bool] = False
    own_section: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _deprecated_names(cls, data: Any) -> Any:
        """A section built directly (not by load_config) takes its deprecated names too."""
        return upgrade_for_model(cls.renamed_keys, data)


def short_name(field: str) -> Any:
    """A read-only property exposing `field` under DeepSpeed's short attribute name."""
    return property(lambda self: getattr(self, field), doc=f"DeepSpeed's attribute name for `{field}`.")


def alias(name: str, short: str) -> AliasChoices:
    """Accept both DeepSpeed spellings of a key (e.g. stage3_prefetch_bucket_size / prefetch_bucket_size)."""
    return AliasChoices(name, short)

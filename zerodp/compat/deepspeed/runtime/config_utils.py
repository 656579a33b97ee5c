"""`deepspeed.runtime.config_utils`: the base class DeepSpeed-style config models derive from, and the
dict helpers code written against DeepSpeed's config reads with.

`DeepSpeedConfigModel` is a pydantic model with DeepSpeed's conventions, so that a config class a
project wrote on top of DeepSpeed's keeps validating the same way: unknown keys are errors, fields
are settable by name or alias, assignments are validated, enums are stored as their values, an
"auto" value is dropped (the field keeps its default; `strict=True` keeps it), and a field declared

    old: int = Field(0, json_schema_extra={"deprecated": True, "new_param": "new",
                                           "new_param_fn": lambda v: v, "set_new_param": True,
                                           "deprecated_msg": "..."})

logs one warning naming `new` when given, and moves its value (through `new_param_fn`) into `new`
(a dotted path reaches a sub-model). Giving the old and the new field together raises
`DeprecatedFieldConflict`, a ValueError that is also an AssertionError (DeepSpeed's type for it).
"""

from __future__ import annotations

import collections
import json
import functools
from typing import Any

from pydantic import BaseModel, ConfigDict

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.log import warn_once


class DeprecatedFieldConflict(ValueError, AssertionError):
    """A deprecated config field was given together with the field that replaces it."""


class DeepSpeedConfigModel(BaseModel):
    """Base of DeepSpeed-style config models (see the module docstring).

    Args:
        strict: keep "auto" values (validated as any other value) instead of dropping them.
        **data: the fields.
    """

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:  # the HF integration leaves "auto" in keys it fills only in some setups
            data = {key: value for key, value in data.items() if not (isinstance(value, str) and value == "auto")}
        super().__init__(**data)
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated") and name in self.model_fields_set:
                self._move_deprecated(name, extra)

    def _move_deprecated(self, name: str, extra: dict[str, Any]) -> None:
        """Warn about the deprecated field `name` and move its value to `extra["new_param"]`."""
        new = str(extra.get("new_param", ""))
        message = f"Config parameter {name} is deprecated" + (f"; use {new} instead" if new else "")
        warn_once(message + (f". {extra['deprecated_msg']}" if extra.get("deprecated_msg") else ""))
        if not new or not extra.get("set_new_param", True):
            return
        *parents, leaf = new.split(".")
        owner = functools.reduce(getattr, parents, self)
        if leaf in owner.model_fields_set:
            raise DeprecatedFieldConflict(f"config parameter '{name}' is deprecated and replaced by '{new}'; "
                                          f"both were given: keep only '{new}'")
        value = extra.get("new_param_fn", lambda v: v)(getattr(self, name))
        setattr(owner, leaf, value)


def get_config_default(config: type[BaseModel], field_name: str) -> Any:
    """The default of `field_name` in the model class `config` (ValueError for an unknown or a
    required field)."""
    field = config.model_fields.get(field_name)
    if field is None:
        raise ValueError(f"'{field_name}' is not a field of {config.__name__}")
    if field.is_required():
        raise ValueError(f"'{field_name}' is a required field of {config.__name__}: it has no default")
    return field.get_default(call_default_factory=True)


class pp_int(int):  # noqa: N801 (DeepSpeed's name)
    """An int that prints with thousands separators, or as `custom_print_str` (for generated docs)."""

    def __new__(cls, val: Any, custom_print_str: str | None = None) -> "pp_int":
        instance = super().__new__(cls, val)
        instance.custom_print_str = custom_print_str
        return instance

    def __repr__(self) -> str:
        return self.custom_print_str or f"{int(self):,}"


class DeepSpeedConfigObject:
    """A plain attribute bag whose repr is its attributes as JSON (DeepSpeed's older config objects)."""

    def repr(self) -> dict[str, Any]:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, default=str)


def get_scalar_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """`param_dict[param_name]`, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


get_list_param = get_scalar_param
get_dict_param = get_scalar_param


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A `json.load(object_pairs_hook=...)` that refuses a key given twice in one object (ValueError
    naming the keys)."""
    counts = collections.Counter(key for key, _ in ordered_pairs)
    repeated = [key for key, count in counts.items() if count > 1]
    if repeated:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {repeated}")
    return dict(ordered_pairs)


__all__ = ["DeepSpeedConfigModel", "DeepSpeedConfigObject", "DeprecatedFieldConflict",
           "dict_raise_error_on_duplicate_keys", "get_config_default", "get_dict_param", "get_list_param",
           "get_scalar_param", "pp_int"]
__getattr__ = missing_attributes(__name__)

"""Hugging Face models made sequence-parallel without editing them: the attention function a model
calls by name (`config._attn_implementation`, looked up in transformers' ALL_ATTENTION_FUNCTIONS at
every forward) is replaced under the same name by a `UlyssesAttention` around it. Every other code
path keyed on the name (flash attention's padding-free branches, sdpa's mask building) still runs as
before; only the call itself goes through the all-to-alls. transformers is imported here only.
"""

from __future__ import annotations

from typing import Any

from zerodp.sequence.attention import UlyssesAttention
from zerodp.zero.topology import SequenceParallel

REFUSED = {
    "eager": "it needs the [seq, seq] attention mask, which the model builds for its shard only; use 'sdpa' or a "
             "flash attention",
    "paged|eager": "it needs the [seq, seq] attention mask, which the model builds for its shard only; use 'sdpa' "
                   "or a flash attention",
    "flex_attention": "its BlockMask is built for the shard's length and zerodp does not rebuild it; use 'sdpa' or "
                      "a flash attention",
}


def model_config(model_or_name: Any) -> Any:
    """The text config of a model, a PEFT wrapper (anything with `.config`), a config, or a hub name /
    local path (read with AutoConfig)."""
    config = getattr(model_or_name, "config", None)
    if config is None and hasattr(model_or_name, "num_attention_heads"):
        config = model_or_name
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_or_name)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def register_attention(model_or_name: Any, core_attn_implementation: str, topology: SequenceParallel,
                       disable_in_eval: bool = False) -> UlyssesAttention:
    """Replace `core_attn_implementation` in transformers' ALL_ATTENTION_FUNCTIONS by its Ulysses
    version for the model's head counts (registering again wraps the original, not the wrapper).

    Raises ValueError for an attention implementation Ulysses cannot run, one the loaded model does
    not use, or head counts `topology.sp_size` does not split (kv_replication's message)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if core_attn_implementation in REFUSED:
        raise ValueError(f"core_attn_implementation={core_attn_implementation!r} cannot run sequence-parallel: "
                         f"{REFUSED[core_attn_implementation]}")
    loaded = getattr(getattr(model_or_name, "config", None), "_attn_implementation", None)
    if loaded is not None and loaded != core_attn_implementation:
        raise ValueError(f"core_attn_implementation={core_attn_implementation!r} but the model was loaded with "
                         f"attn_implementation={loaded!r}: the model calls the function of its own name, so the "
                         "two must agree (load the model with the one you register)")
    if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"core_attn_implementation={core_attn_implementation!r} is not one of transformers' attention "
                         f"functions: {sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}")
    core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
    core = core.core if isinstance(core, UlyssesAttention) else core
    config = model_config(model_or_name)
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    attention = UlyssesAttention(core, num_heads, num_kv_heads, topology, disable_in_eval,
                                 masks_documents="sdpa" in core_attn_implementation)
    ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = attention
    return attention


def unregister_attention(core_attn_implementation: str) -> None:
    """Put back the function `register_attention` wrapped (nothing when it is not wrapped)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
    if isinstance(current, UlyssesAttention):
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = current.core

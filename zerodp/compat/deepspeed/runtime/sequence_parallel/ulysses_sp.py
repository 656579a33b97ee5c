"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: DeepSpeed's Ulysses (ALST) API with its signatures, on
zerodp.sequence (the attention, the batch sharding and the groups live there; this module maps names).

Differences a DeepSpeed user may meet: the sequence length is read from every batch (a fixed
`seq_length` is accepted and changes nothing), and a batch without `position_ids` gets 0..seq-1 per
row instead of an error."""

from __future__ import annotations

from typing import Any

from zerodp import comm
from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.runtime.sequence_parallel import parallel_state_sp
from zerodp.log import warn_once
from zerodp.sequence import (SequenceShardLoader, SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, UlyssesAttention,
                             groups, register_attention, sequence_tiled_compute)
from zerodp.zero.topology import SequenceParallel


def _topology(process_group: Any, sp_size: int | None = None, sp_rank: int | None = None) -> SequenceParallel:
    """A SequenceParallel for a group a DeepSpeed caller hands over (the data-parallel side from the world)."""
    size = comm.get_world_size(process_group) if sp_size is None else sp_size
    rank = comm.get_rank(process_group) if sp_rank is None else sp_rank
    return SequenceParallel(size, rank, process_group, comm.get_world_size() // size, comm.get_rank() // size, None)


class UlyssesSPAttentionHF(UlyssesAttention):
    """DeepSpeed's Ulysses attention for HF models: `attn` (an ALL_ATTENTION_FUNCTIONS entry) on the whole
    sequence for heads/S heads. The shape arguments are DeepSpeed's; zerodp reads shapes from each call."""

    def __init__(self, attn: Any, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__(attn, attn_head_count, kv_head_count, _topology(process_group), disable_in_eval,
                         masks_documents=getattr(attn, "__name__", "") == "sdpa_attention_forward")

    def forward(self, module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any,
                **kwargs: Any) -> Any:
        return self(module, query, key, value, attention_mask, *args, **kwargs)

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """Make transformers' `core_attn_implementation` sequence-parallel over groups of
        `sequence_parallel_size` ranks and return the groups provider to pass as
        `deepspeed.initialize(mpu=...)`; None (nothing done) when the size is 1."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            warn_once("register_with_transformers: max_length is deprecated (as in DeepSpeed); use seq_length")
        if not seq_length_is_variable and (seq_length if seq_length is not None else max_length) is None:
            raise ValueError("register_with_transformers: set seq_length_is_variable=True or give seq_length")
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        register_attention(model_name_or_path, core_attn_implementation, groups.current(), disable_in_eval)
        return parallel_state_sp


class UlyssesSPDataLoaderAdapter(SequenceShardLoader):
    """DeepSpeed's adapter: each rank's batches from `dl` are shared by its sequence-parallel group and
    cut along the sequence (`shift_labels` pre-shifted, `position_ids` cut with the tokens); the
    loader yields sp_world_size micro-batches per batch of `dl`. Other attributes are `dl`'s."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        super().__init__(dl, _topology(sp_group, sp_world_size, sp_rank), device)
        self.dl = dl

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "dl"):  # not yet set: __init__ is running
            raise AttributeError(name)
        return getattr(self.loader, name)


__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter",
           "sequence_tiled_compute"]
__getattr__ = missing_attributes(__name__)

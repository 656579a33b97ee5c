"""Ulysses attention: any attention function of Hugging Face's signature, run on the whole sequence for
this rank's share of the heads (see [Note: the Ulysses all-to-all], zerodp/sequence/all_to_all.py).

    attention = UlyssesAttention(core, num_heads=32, num_kv_heads=8, topology=groups.current())
    out, weights = attention(module, query, key, value, attention_mask, **kwargs)

query/key/value come in HF's layout [batch, heads, seq/S, head_dim] (this rank's sequence shard); the
output leaves as [batch, seq/S, heads, head_dim], what HF's attention functions return.

[Note: a key/value cache under Ulysses]
transformers' models fill a key/value cache in every forward where `use_cache` is on, which their
configs default to, training included (Hugging Face's `gradient_checkpointing_enable()` and
`zerodp.checkpointing.apply` turn it off in training unless the caller asks for it; a block checkpointed
otherwise keeps it). A checkpointed block's recompute runs the attention again with the same cache,
which appends the layer's keys and values a second time: they arrive here with 2 x seq/S positions,
the forward's and the recompute's (equal values). Unsplit, transformers' sdpa cuts a key longer than
the query back to its first positions, which are right by accident. Through the all-to-all the S
ranks' doubled shards interleave (rank 0's twice, then rank 1's twice, ...), so that cut attended to rank 0's tokens twice: wrong gradients (up to 1.3e-2 off on a tiny
Llama at S = 2), and the recompute exchanged twice the key/value bytes (Llama-3.1-8B at S = 8: 3.2x one
forward's all-to-all bytes per layer where forward, recompute and backward make 3x). So inside
backward (a recompute) the attention takes the last seq/S positions, the ones this call computed (a
cache appends at the end); anywhere else a key longer than the query is a cache of other tokens
(generation, a StaticCache), which a sequence shard cannot attend to: ValueError.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch

from zerodp import comm
from zerodp.sequence.all_to_all import heads_to_ranks, sequence_to_ranks
from zerodp.zero.topology import SequenceParallel

AttentionFunction = Callable[..., tuple[torch.Tensor, Any]]


def kv_replication(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times each key/value head is repeated before the all-to-all (1: none), or ValueError.

    Query heads are cut into `sp_size` blocks, so `num_heads` must divide by it. Key/value heads
    (grouped-query attention) are cut too when `sp_size` divides them; when there are fewer of them
    than ranks, each is repeated `sp_size / num_kv_heads` times so that every rank receives the one
    its query heads read (as DeepSpeed does)."""
    if num_heads % sp_size:
        raise ValueError(f"num_attention_heads ({num_heads}) does not divide by sequence_parallel_size ({sp_size}): "
                         "Ulysses gives each rank of a sequence-parallel group an equal share of the heads; use a "
                         f"sequence_parallel_size that divides {num_heads}")
    if num_kv_heads % sp_size == 0:
        return 1
    if sp_size % num_kv_heads == 0:
        return sp_size // num_kv_heads
    raise ValueError(f"num_key_value_heads ({num_kv_heads}) and sequence_parallel_size ({sp_size}): neither divides the "
                     "other, so the key/value heads cannot be cut or repeated evenly across the ranks; use a "
                     f"sequence_parallel_size that divides {num_kv_heads} or is a multiple of it")


def _own_tokens(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value of the query's own tokens, [batch, kv heads, seq/S, head_dim], or ValueError
    for a key/value cache under sequence parallelism ([Note: a key/value cache under Ulysses])."""
    length = query.shape[2]
    if key.shape[2] == value.shape[2] == length:
        return key, value
    if key.shape[2] == value.shape[2] > length and torch._C._current_graph_task_id() != -1:  # a recompute
        return key[:, :, -length:], value[:, :, -length:]
    raise ValueError(f"Ulysses attention got key {tuple(key.shape)} and value {tuple(value.shape)} for query "
                     f"{tuple(query.shape)} ([batch, heads, seq, head_dim]): a key/value cache holds tokens of other "
                     "calls, which a rank's sequence shard cannot attend to; train sequence-parallel without one "
                     "(use_cache=False in the model's forward, or model.config.use_cache = False)")


@contextlib.contextmanager
def _kv_groups(module: Any, groups: int) -> Iterator[None]:
    """Set `module.num_key_value_groups` (HF's query heads per key/value head, which its attention
    functions read) for the heads this rank holds, while the core attention runs."""
    had = hasattr(module, "num_key_value_groups")
    before = getattr(module, "num_key_value_groups", None)
    if had:
        module.num_key_value_groups = groups
    try:
        yield
    finally:
        if had:
            module.num_key_value_groups = before


class UlyssesAttention:
    """An HF attention function made sequence-parallel: all-to-all in, the core function on the whole
    sequence for heads/S heads, all-to-all out.

    The model's attention mask is dropped: after the exchange the sequence is whole, and the core
    function's causal flag (sdpa's `is_causal`, flash attention's causal kernel) masks it; a mask built by
    the model for its shard has the shard's length (DeepSpeed drops it too). So a padding mask is not
    applied: pad at the end of the sequence, where causal attention never lets a pad reach a real token.
    Packed documents (position ids that restart inside a row) stay apart: flash attention finds them in
    the whole sequence's position ids; for a core that needs a mask (`masks_documents`: sdpa) this builds
    the one transformers builds unsplit, causal within each document ([Note: packed documents under Ulysses])."""

    def __init__(self, core: AttentionFunction, num_heads: int, num_kv_heads: int, topology: SequenceParallel,
                 disable_in_eval: bool = False, masks_documents: bool = False) -> None:
        self.core = core  # the function this one wraps (HF's sdpa, flash attention, ...)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.topology = topology
        self.kv_repeats = kv_replication(num_heads, num_kv_heads, topology.sp_size)
        self.disable_in_eval = disable_in_eval  # eval forwards run unsplit (their batches are not sharded)
        self.masks_documents = masks_documents
        self._positions: tuple[weakref.ref, torch.Tensor, torch.Tensor | None] | None = None  # shard, whole, mask

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        size, group = self.topology.sp_size, self.topology.sp_group
        if size == 1 or (self.disable_in_eval and not getattr(module, "training", True)):
            return self.core(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_heads(query, key)
        key, value = _own_tokens(query, key, value)
        if self.kv_repeats > 1:
            key = key.repeat_interleave(self.kv_repeats, dim=1)
            value = value.repeat_interleave(self.kv_repeats, dim=1)
        query, key, value = (heads_to_ranks(t, size, group) for t in (query, key, value))
        self._check_window(kwargs.get("sliding_window"), query.shape[2])
        mask = None
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"], mask = self._whole_positions(kwargs["position_ids"])
        with _kv_groups(module, query.shape[1] // key.shape[1]):
            out, weights = self.core(module, query, key, value, mask, *args, **kwargs)
        return sequence_to_ranks(out, size, group), weights

    def _check_heads(self, query: torch.Tensor, key: torch.Tensor) -> None:
        if query.shape[1] != self.num_heads or key.shape[1] != self.num_kv_heads:
            raise ValueError(f"Ulysses attention was registered for {self.num_heads} query and {self.num_kv_heads} "
                             f"key/value heads, but got query {tuple(query.shape)} and key {tuple(key.shape)} "
                             "([batch, heads, seq, head_dim]); register it with this model's config")

    def _check_window(self, window: int | None, length: int) -> None:
        """A core that needs a mask gets none for a sliding window (the model's, built for its shard,
        is dropped), so a sequence longer than the window is refused rather than attended whole."""
        if self.masks_documents and window is not None and length > window:
            raise ValueError(f"sliding-window attention (sliding_window={window}) on {length} tokens: Ulysses "
                             "drops the model's mask, and sdpa would attend to the whole causal sequence; load the "
                             "model with a flash attention (it takes the window itself) or train sequences of at "
                             f"most {window} tokens")

    def _whole_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The position ids of the whole sequence (flash attention finds packed documents in them) and,
        for a core that needs one, the mask of its packed documents (None: none packed), made once per
        forward: every layer gets the same tensors, kept as long as the shard's position ids live (the
        recompute of a checkpointed block finds them), not after."""
        if self._positions is not None and self._positions[0]() is positions:
            return self._positions[1], self._positions[2]
        size = self.topology.sp_size
        shard = positions.contiguous()
        out = torch.empty((size, *shard.shape), dtype=shard.dtype, device=shard.device)
        comm.all_gather_into_tensor(out, shard, group=self.topology.sp_group)
        whole = out.movedim(0, -2).reshape(*shard.shape[:-1], size * shard.shape[-1])
        mask = document_mask(whole) if self.masks_documents else None
        self._positions = (weakref.ref(positions), whole, mask)
        weakref.finalize(positions, self._forget, self._positions)
        return whole, mask

    def _forget(self, entry: tuple) -> None:
        if self._positions is entry:
            self._positions = None


# [Note: packed documents under Ulysses]
# Packing puts several documents in one row, each with positions from 0 (LLaMA-Factory's neat_packing,
# TRL's padding_free, DeepSpeed's UlyssesSPDataLoaderAdapter keeps them). Unsplit, transformers finds them
# in the position ids and attends within each document only: flash attention by cutting the row at every
# restart (varlen), sdpa through a [seq, seq] mask it builds. Under Ulysses the model sees a shard, and
# the mask is dropped, so a wrapped sdpa would attend across documents (DeepSpeed's does). The wrapper
# builds transformers' mask from the whole sequence's positions instead: a row that is one run of
# consecutive positions gets none (and sdpa's causal flag), so only a packed batch pays for the mask:
# seq x seq booleans per row (what transformers allocates unsplit; flash attention suits long packed
# rows). transformers looks for packed documents only in a forward without a key/value cache.
# Finding out costs one look at the gathered positions per forward (a device sync).


def document_mask(positions: torch.Tensor) -> torch.Tensor | None:
    """[rows, 1, seq, seq] booleans, True where a token may attend (an earlier or the same token of its
    own document), for position ids [rows, seq] in which a position that does not follow its predecessor
    starts a document; None when none does ([Note: packed documents under Ulysses])."""
    starts = positions.diff(dim=-1) != 1
    if not bool(starts.any()):
        return None
    documents = torch.nn.functional.pad(starts.long().cumsum(-1), (1, 0))
    length = positions.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    return ((documents[..., :, None] == documents[..., None, :]) & causal).unsqueeze(-3)

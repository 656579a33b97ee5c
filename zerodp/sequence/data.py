"""Batches cut along the sequence for the ranks of one sequence-parallel group.

`shard_batch` cuts one batch that every rank of the group holds (what the engine's loader gives them:
the same samples, [Note: sequence-parallel groups] in zerodp/zero/topology.py). `SequenceShardLoader`
is DeepSpeed's UlyssesSPDataLoaderAdapter: each rank of the group reads its own batch from an ordinary
data-parallel loader; the group shares them, and each batch becomes S micro-batches that every rank
of the group processes together, one sequence shard each.

Labels are shifted before the cut: the last token of shard i predicts the first of shard i+1, which
no rank would see after it (`shift_labels`, which HF's causal-LM loss takes as is). Position ids are
cut with the tokens so rotary embeddings see global positions; a batch without them gets
0..seq-1 per row, what the unsplit model would use.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from zerodp import comm
from zerodp.zero.topology import SequenceParallel

IGNORE_INDEX = -100  # HF's label for "no loss here"


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """labels[..., 1:] with IGNORE_INDEX appended: position t holds the token t predicts."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def _prepare(batch: dict[str, Any]) -> dict[str, Any]:
    """A copy with `shift_labels` instead of `labels` and `position_ids` present."""
    if "input_ids" not in batch:
        raise ValueError(f"a sequence-parallel batch needs 'input_ids' (got keys {sorted(batch)})")
    out = dict(batch)
    if "labels" in out:
        out["shift_labels"] = shift_labels(out.pop("labels"))
    if out.get("position_ids") is None:
        batch_size, seq_len = out["input_ids"].shape[:2]
        out["position_ids"] = torch.arange(seq_len, device=out["input_ids"].device).expand(batch_size, seq_len)
    return out


def _pad_value(key: str, pad_token_id: int) -> int:
    return {"input_ids": pad_token_id, "shift_labels": IGNORE_INDEX, "labels": IGNORE_INDEX}.get(key, 0)


def _padded(batch: dict[str, Any], seq_len: int, sp_size: int, pad_token_id: int) -> dict[str, Any]:
    """Every [batch, seq, ...] tensor padded at the end to a multiple of `sp_size`: pads carry no label,
    continue the positions, and (causal attention) never reach a real token."""
    extra = -seq_len % sp_size
    out = {}
    for key, value in batch.items():
        if not (torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == seq_len):
            out[key] = value
        elif key == "position_ids":
            out[key] = torch.cat([value, value[:, -1:] + torch.arange(1, extra + 1, device=value.device)], dim=1)
        else:
            pad = value.new_full((value.shape[0], extra, *value.shape[2:]), _pad_value(key, pad_token_id))
            out[key] = torch.cat([value, pad], dim=1)
    return out


def shard_batch(batch: dict[str, Any], sp_rank: int, sp_size: int, pad_token_id: int | None = None) -> dict[str, Any]:
    """This rank's shard of a batch of {name: [batch, seq, ...] tensor} that every rank of its
    sequence-parallel group holds: `labels` become pre-shifted `shift_labels`, `position_ids` are
    added when absent, and every tensor with the sequence length is cut to its `sp_rank`-th of
    `sp_size` pieces along dim 1 (others are kept whole).

    A sequence length `sp_size` does not divide is refused, or, with `pad_token_id`, padded at the end
    (input_ids with it, labels with -100, positions continued, other tensors with 0)."""
    out = _prepare(batch)
    seq_len = out["input_ids"].shape[1]
    if seq_len % sp_size:
        if pad_token_id is None:
            raise ValueError(f"sequence length {seq_len} does not divide by sequence_parallel_size {sp_size}: pad the "
                             f"batch to a multiple of {sp_size} (shard_batch(..., pad_token_id=...) pads at the end)")
        out = _padded(out, seq_len, sp_size, pad_token_id)
        seq_len = out["input_ids"].shape[1]
    piece = seq_len // sp_size
    return {key: value[:, sp_rank * piece:(sp_rank + 1) * piece].contiguous()
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == seq_len else value
            for key, value in out.items()}


class SequenceShardLoader:
    """Wrap a data-parallel loader whose ranks read different batches: each step of the wrapped loader
    gives the S ranks of a group S batches; this yields them one after another, every rank of the
    group holding its sequence shard of the same batch (DeepSpeed's UlyssesSPDataLoaderAdapter).
    Batches are dicts of [batch, seq, ...] tensors with the same batch size on every rank; values that
    are not tensors are this rank's own, in every micro-batch."""

    def __init__(self, loader: Any, topology: SequenceParallel, device: Any = None,
                 pad_token_id: int | None = None) -> None:
        self.loader, self.topology, self.device, self.pad_token_id = loader, topology, device, pad_token_id

    def __len__(self) -> int:
        return len(self.loader) * self.topology.sp_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            for sample in self._share(batch):
                yield shard_batch(sample, self.topology.sp_rank, self.topology.sp_size, self.pad_token_id)

    def _share(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's batch of this group, in rank order (a collective over the group)."""
        size, group = self.topology.sp_size, self.topology.sp_group
        batch = {k: v.to(self.device) if torch.is_tensor(v) and self.device is not None else v for k, v in batch.items()}
        seq_len = batch["input_ids"].shape[1]
        lengths = comm.all_gather_rows(torch.tensor([seq_len], device=batch["input_ids"].device), group=group)
        lengths = [int(n) for n in lengths[:, 0].tolist()]
        shared: list[dict[str, Any]] = [{} for _ in range(size)]
        for key, value in batch.items():
            if not (torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == seq_len):
                for one in shared:
                    one[key] = value
                continue
            longest = max(lengths)
            padded = torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, longest - seq_len))
            out = torch.empty((size, *padded.shape), dtype=value.dtype, device=value.device)
            comm.all_gather_into_tensor(out, padded.contiguous(), group=group)
            for rank, one in enumerate(shared):
                one[key] = out[rank][:, :lengths[rank]]
        return shared

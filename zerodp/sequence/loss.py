"""The loss of one sequence from its shards.

[Note: the sequence-parallel loss]
Each rank of a sequence-parallel group computes the mean loss over the tokens of its shard that have
a label. The loss of the sequence is the mean over all of them: sum_r (mean_r x n_r) / sum_r n_r. Its
value must be the same on every rank (it is logged, and fp16's overflow check compares it), but its
gradient must not be counted S times: the engine sums gradients over the ranks of a group ([Note:
sequence-parallel groups], zerodp/zero/topology.py), and every rank's backward already reaches the
other shards through the attention's all-to-alls. So each rank backpropagates only its own term,
mean_r x n_r / N, and the other terms enter as constants (Hugging Face's Trainer builds the same
loss for DeepSpeed's Ulysses). A shard with no labelled token (a prompt masked with -100) has a NaN
mean and counts zero.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp import comm
from zerodp.sequence.data import IGNORE_INDEX


def sequence_parallel_loss(loss: torch.Tensor, shift_labels: torch.Tensor, group: Any) -> torch.Tensor:
    """The mean loss of the whole sequence from this rank's `loss` (the mean over its shard's
    labelled tokens) and its `shift_labels`; the same value on every rank of `group`, the gradient of
    this rank's share only (see [Note: the sequence-parallel loss]). A collective over `group`."""
    labelled = (shift_labels != IGNORE_INDEX).sum()
    own = torch.where(labelled > 0, loss.float(), torch.zeros((), device=loss.device)) * labelled
    totals = torch.stack((own.detach(), labelled.float()))
    comm.all_reduce(totals, group=group)
    return (own + (totals[0] - own.detach())) / totals[1].clamp(min=1)

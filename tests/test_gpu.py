"""Checks that need CUDA; skipped on CPU-only machines (CI here has no GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.test_checkpointing import B, D, L, Stack, _data
from zerodp import checkpointing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cpu_checkpointing_keeps_checkpoint_inputs_in_host_memory() -> None:
    model = Stack().cuda()
    checkpointing.apply(model)
    checkpointing.configure(checkpoint_in_cpu=True)
    try:
        params = checkpointing.storage_keys(model.parameters())
        with checkpointing.count_saved_activations(params) as saved:
            loss = model(_data().cuda())
        loss.backward()
    finally:
        checkpointing.configure(checkpoint_in_cpu=False)
    # the L block inputs moved to the host; what stays on the device is outside the blocks
    assert saved.bytes_by_tier["cpu"] == L * 4 * B * D
    assert saved.bytes_by_tier["cuda"] == 4 * B * D + 4 * B

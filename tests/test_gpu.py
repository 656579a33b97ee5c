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


def _one_rank_nccl(fn):
    """Run `fn()` in this process as a 1-rank NCCL job (the CUDA code paths: device tensors,
    pinned host buffers, non-blocking copies)."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        return fn()
    finally:
        dist.destroy_process_group()


def _train_block_lm(zero: dict) -> tuple[list[float], dict]:
    import zerodp
    from tests.models import batch, make_block_lm

    model = make_block_lm()
    engine, *_ = zerodp.initialize(model=model, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2),
                                   config={"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                                           "zero_optimization": zero})
    losses = []
    for step in range(3):
        loss = engine(*[t.cuda() for t in batch(0, step, 0)])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    pinned = all(t.is_pinned() for g in engine.optimizer.param_groups for t in g["params"] if t.device.type == "cpu")
    return losses, (engine.memory_report(), pinned)


def test_stage3_with_cpu_offload_on_cuda_matches_no_offload_and_pins_host_memory() -> None:
    zero3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    offload = {**zero3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    (plain, _), (moved, (report, pinned)) = _one_rank_nccl(lambda: (_train_block_lm(zero3), _train_block_lm(offload)))
    assert plain == moved
    assert set(report["held"]["optim_state"]) == {"cpu"} and pinned  # 1 rank: params stay whole on the device


GPT_110M = "gpt:vocab_size=32000,seq_len=256,d_model=768,n_layer=12,n_head=12"


def _cuda_peak(config: dict) -> tuple[int, int]:
    """(torch.cuda.max_memory_allocated over two steps after initialize, the bytes allocated then)."""
    import zerodp
    from zerodp.plan.workload import workload

    work = workload(GPT_110M)
    engine, *_ = zerodp.initialize(model=work.build(), config=config)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    at_start = torch.cuda.memory_allocated()
    for _ in range(2):
        args, kwargs = work.inputs(engine.module, 2, 256, engine.device)
        engine.backward(engine(*args, **kwargs))
        engine.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), at_start


@pytest.mark.parametrize("stage,offload", [(0, "none"), (2, "none"), (3, "none"), (3, "cpu")])
def test_the_simulated_peak_is_the_cuda_allocator_s(stage: int, offload: str) -> None:
    """`zerodp estimate`'s device peak (a rank simulated on meta, attention as flash kernels) against
    torch.cuda.max_memory_allocated of the real run, 1 rank, bf16, 2 x 256 tokens. The allocator rounds
    each block up to 512 bytes and holds cuBLAS's workspace: within 3% is the claim to check."""
    from zerodp.plan.model_states import StrategySpec as Strategy, strategy_config
    from zerodp.plan.workload import workload
    from zerodp.plan.simulate import simulate_training

    s = Strategy(stage, offload, offload if stage == 3 else "none")
    config = strategy_config(s, micro_batch=2)
    work = workload(GPT_110M)
    predicted = simulate_training(work.build, config, lambda m, device: work.inputs(m, 2, 256, device), 1)
    measured, _ = _one_rank_nccl(lambda: _cuda_peak(config))
    print(f"stage {stage} offload {offload}: predicted {predicted.peak['device'].bytes:,} "
          f"measured {measured:,} ({100 * (predicted.peak['device'].bytes - measured) / measured:+.2f}%)")
    assert abs(predicted.peak["device"].bytes - measured) <= 0.03 * measured


class _Matmuls(torch.nn.Module):
    """Eight 4096 x 4096 layers: a forward the host queues in well under a millisecond and the
    device takes tens of milliseconds to run."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def _device_timed_steps() -> list[tuple[dict, float]]:
    import time

    import zerodp

    engine, *_ = zerodp.initialize(model=_Matmuls(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2}})
    x = torch.randn(8192, 4096, device=engine.device)
    steps = []
    for _ in range(3):
        start = time.perf_counter()
        loss = engine(x)
        queued = time.perf_counter() - start  # the host's time in forward: launching, not running
        engine.backward(loss)
        engine.step()
        steps.append((engine.step_report(), queued))
    return steps[1:]


def test_the_step_report_times_the_device_with_cuda_events() -> None:
    """On CUDA the breakdown's spans are events on the stream: the forward's kernels count as
    forward compute however soon the host returned from queueing them ([Note: the step breakdown])."""
    for report, queued in _one_rank_nccl(_device_timed_steps):
        print(f"forward {report['forward'] * 1e3:.1f} ms on the device, {queued * 1e3:.1f} ms on the host; "
              f"step {report['seconds'] * 1e3:.1f} ms: {report['verdict']}")
        assert report["clock"] == "cuda-events"
        assert report["forward"] > 3 * queued and report["verdict"] == "compute-bound", report
        assert report["seconds"] >= report["forward"] + report["backward"]

"""Backward passes engine.backward did not start (see [Note: backward passes the engine did not start]).

- the user's own `loss.backward()` then `engine.step()` (DeepSpeed 0.19 supports it at every stage),
- a GAN: the generator's loss runs through the discriminator, which another engine trains, and the
  script clears the discriminator's gradients with `netD.zero_grad()` (DeepSpeed's GAN example).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_ranks
from tests.models import batch, make_model


def _config(stage: int, gas: int = 2, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, **extra}


def _train(rank: int, world: int, stage: int, direct: bool) -> tuple[list[float], dict, int]:
    import zerodp

    engine, *_ = zerodp.initialize(model=make_model(), config=_config(stage))
    losses = []
    for step in range(3):
        for micro in range(2):
            loss = engine(*batch(rank, step, micro))
            loss.backward() if direct else engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    with zerodp.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return losses, params, engine.global_steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_backward_then_step_trains_as_engine_backward_does(stage: int) -> None:
    # before: one step trained, then the next backward raised "gradient of ... was produced twice"
    for (losses, params, steps), (ref_losses, ref_params, ref_steps) in zip(run_ranks(_train, 2, args=(stage, True)),
                                                                           run_ranks(_train, 2, args=(stage, False))):
        assert (losses, steps) == (ref_losses, ref_steps) == (ref_losses, 3)
        assert all(torch.equal(params[n], ref_params[n]) for n in ref_params)


def _fp16(rank: int, world: int, how: str) -> list[float]:
    import zerodp

    engine, *_ = zerodp.initialize(model=make_model(), config=_config(1, gas=1, fp16={"enabled": True}))
    losses = []
    for step in range(2):
        loss = engine(*batch(rank, step, 0))
        {"engine": engine.backward, "scale": lambda x: engine.scale(x).backward(), "plain": lambda x: x.backward()}[how](loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_an_fp16_engine_needs_the_loss_scale_on_a_direct_backward() -> None:
    assert run_ranks(_fp16, 2, args=("scale",)) == run_ranks(_fp16, 2, args=("engine",))
    with pytest.raises(AssertionError, match=r"loss.backward\(\) was called on an fp16 engine without the loss scale"):
        run_ranks(_fp16, 2, args=("plain",))


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)


def _gan_data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 4, generator=g) + 1.0, torch.randn(4, 2, generator=g)


def _bce(logits: torch.Tensor, label: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, label))


def _gan(rank: int, world: int, stage: int | None, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    """DeepSpeed's GAN example loop. stage None: the plain torch reference (gradients averaged by hand)."""
    torch.manual_seed(0)
    netD, netG = Discriminator(), nn.Sequential(nn.Linear(2, 4), nn.Tanh())
    optD, optG = (torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True) for m in (netD, netG))
    if stage is not None:
        import zerodp

        config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
        engine_d, *_ = zerodp.initialize(model=netD, optimizer=optD, config=config)
        engine_g, *_ = zerodp.initialize(model=netG, optimizer=optG, config=config)
    losses = []
    for step in range(steps):
        real, noise = _gan_data(rank, step)
        netD.zero_grad()
        err_real = _bce(netD(real), 1.0)
        engine_d.backward(err_real) if stage is not None else err_real.backward()
        fake = netG(noise)
        err_fake = _bce(netD(fake.detach()), 0.0)
        engine_d.backward(err_fake) if stage is not None else err_fake.backward()
        engine_d.step() if stage is not None else _averaged_step(netD, optD)
        netG.zero_grad()
        err_g = _bce(netD(fake), 1.0)  # runs through the discriminator: its hooks fire in G's backward
        engine_g.backward(err_g) if stage is not None else err_g.backward()
        engine_g.step() if stage is not None else _averaged_step(netG, optG)
        losses += [err_real.item(), err_fake.item(), err_g.item()]
    if stage is not None:
        with zerodp.zero.GatheredParameters(list(netD.parameters()) + list(netG.parameters())):
            return losses, [p.detach().clone() for p in [*netD.parameters(), *netG.parameters()]]
    return losses, [p.detach().clone() for p in [*netD.parameters(), *netG.parameters()]]


def _averaged_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed as dist

    for p in model.parameters():
        p.grad.div_(dist.get_world_size())
        dist.all_reduce(p.grad)
    optimizer.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_gan_trains_with_one_engine_s_loss_through_the_other_engine_s_model(stage: int) -> None:
    # before: the generator's backward raised "gradient of 'fc1.weight' was produced twice" in the
    # discriminator's hooks (stages 0-2), or paired the wrong collectives (stage 3)
    reference = run_ranks(_gan, 2, args=(None,))
    for (losses, params), (ref_losses, ref_params) in zip(run_ranks(_gan, 2, args=(stage,)), reference):
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-6)
        for p, ref in zip(params, ref_params):
            torch.testing.assert_close(p, ref, rtol=0, atol=1e-6)


def test_deepspeed_s_gan_example_runs_unchanged_under_zerodp_deepspeed(tmp_path) -> None:
    """The same loop as a launched DeepSpeed script (`import deepspeed`, `--local_rank`), stage 3."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    env.pop("ZERODP_AS_DEEPSPEED", None)  # the launcher sets it
    out = subprocess.run([sys.executable, "-c", "from zerodp.cli import main; raise SystemExit(main())", "deepspeed",
                          "--num_gpus", "2", str(repo / "tests" / "scripts" / "ds_gan.py"), "--stage", "3",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300, cwd=repo,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    launched = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    reference = run_ranks(_gan, 2, args=(None,))
    for result, (ref_losses, _) in zip(launched, reference, strict=True):
        torch.testing.assert_close(result["losses"], ref_losses, rtol=0, atol=1e-6)

"""DeepSpeed's tensor-fragment API (zerodp.zero.fragments) against an unpartitioned reference.

Each rank trains the engine on its own batches and, beside it, a plain model and torch AdamW on
every rank's batches with the gradients averaged as the engine averages them (rank 0's half plus
rank 1's half), so at 2 ranks, one micro-batch a step, no clipping and foreach AdamW every getter
is bitwise the reference's tensor (tests/test_parity.py's [Note: where bitwise parity is possible]).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import RankFailed, run_ranks
from tests.models import batch, make_model, two_groups

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _engine(stage: int, offload: str | None, precision: str = "fp32"):
    import zerodp

    model = make_model()
    zero = {"stage": stage, **({"offload_optimizer": {"device": offload}} if offload else {})}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": zero,
              **({"bf16": {"enabled": True}} if precision == "bf16" else {})}
    engine, *_ = zerodp.initialize(model=model, model_parameters=two_groups(model), config=config,
                                   optimizer=lambda groups: torch.optim.AdamW(groups, **ADAMW))
    return engine


def _reference_grads(ref: torch.nn.Module, step: int, world: int) -> None:
    """The engine's reduced gradient: each rank's gradient halved, rank 0's plus rank 1's."""
    params = list(ref.parameters())
    total = None
    for r in range(world):
        grads = torch.autograd.grad(ref(*batch(r, step, 0)), params)
        halves = [g * (1.0 / world) for g in grads]
        total = halves if total is None else [a + b for a, b in zip(total, halves)]
    for p, g in zip(params, total):
        p.grad = g


def _read(engine, fragments, named: dict, reference: dict, ref_opt) -> dict:
    """Every getter for every parameter: (full equals the reference bitwise, this rank's local piece)."""
    out = {}
    for name, p in named.items():
        ref = reference[name]
        state = ref_opt.state.get(ref, {})
        pairs = {"param": (fragments.safe_get_full_fp32_param(p), ref.detach(), fragments.safe_get_local_fp32_param(p)),
                 "grad": (fragments.safe_get_full_grad(p), ref.grad, fragments.safe_get_local_grad(p))}
        for key in STATE_KEYS:
            pairs[key] = (fragments.safe_get_full_optimizer_state(p, key), state.get(key),
                          fragments.safe_get_local_optimizer_state(p, key))
        for what, (full, expected, local) in pairs.items():
            same = (full is None and expected is None) or (
                full is not None and expected is not None and full.shape == expected.shape
                and full.dtype == torch.float32 and torch.equal(full, expected))
            out[f"{name}/{what}"] = (same, None if full is None else full.reshape(-1), local)
    return out


def _run(rank: int, world: int, stage: int, offload: str | None) -> list[dict]:
    from zerodp.zero import fragments

    engine = _engine(stage, offload)
    ref = make_model()
    ref_opt = torch.optim.AdamW(two_groups(ref), **ADAMW)
    named, reference = dict(engine.module.named_parameters()), dict(ref.named_parameters())
    reads = [_read(engine, fragments, named, reference, ref_opt)]  # before any backward: no grad, no state
    for step in range(3):
        engine.backward(engine(*batch(rank, step, 0)))
        _reference_grads(ref, step, world)
        reads.append(_read(engine, fragments, named, reference, ref_opt))  # at the boundary, before the step
        if step == 1:  # edit the weights and Adam's state, the same way in both
            _edit(fragments, named, reference, ref_opt)
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
        for p in ref.parameters():
            p.grad = None
        reads.append(_read(engine, fragments, named, reference, ref_opt))  # after the step
    return reads


@torch.no_grad()
def _edit(fragments, named: dict, reference: dict, ref_opt) -> None:
    g = torch.Generator().manual_seed(7)  # the same values on every rank
    for name, p in named.items():
        value = torch.randn(reference[name].shape, generator=g)
        fragments.safe_set_full_fp32_param(p, value)
        reference[name].copy_(value)
        if name == "fc1.weight":  # Adam's first moment of one parameter, with the local setter
            exp_avg = torch.rand(reference[name].shape, generator=g)
            fragments.safe_set_full_optimizer_state(p, exp_avg, "exp_avg")
            ref_opt.state[reference[name]]["exp_avg"].copy_(exp_avg)
            assert torch.equal(fragments.safe_get_full_optimizer_state(p, "exp_avg"), exp_avg)
        assert torch.equal(fragments.safe_get_full_fp32_param(p), value)


@pytest.mark.parametrize("stage,offload", [(0, None), (1, None), (2, None), (3, None), (3, "cpu")])
def test_every_getter_is_bitwise_the_unpartitioned_tensor(stage: int, offload: str | None) -> None:
    ranks = run_ranks(_run, 2, args=(stage, offload), timeout=120)
    for moment, reads in enumerate(zip(*ranks)):
        for key in reads[0]:
            assert all(r[key][0] for r in reads), (moment, key, stage, offload)
            full = reads[0][key][1]
            locals_ = [r[key][2] for r in reads]
            if full is None:
                assert locals_ == [None, None], (moment, key)
            elif stage == 0:  # nothing partitioned: each rank's piece is the whole parameter
                assert all(torch.equal(local, full) for local in locals_), (moment, key)
            else:  # rank 0's piece then rank 1's (empty where a rank holds none): the owned ranges, in order
                assert all(t is not None for t in locals_), (moment, key)  # DeepSpeed's test_zero_tensor_fragment
                assert torch.equal(torch.cat(locals_), full), (moment, key)
    # before any backward there is no gradient and no state; at the boundary the gradient exists
    assert ranks[0][0]["fc1.weight/grad"][1] is None and ranks[0][1]["fc1.weight/grad"][1] is not None
    assert ranks[0][0]["fc1.weight/exp_avg"][1] is None and ranks[0][2]["fc1.weight/exp_avg"][1] is not None


def _before_the_reduction(rank: int, world: int, stage: int, precision: str) -> list:
    """safe_get_full_grad inside no_sync and between micro-batches, against this rank's own gradients
    summed (DeepSpeed's test_no_sync_ctxt: two no_sync blocks with zero_grad between read the same)."""
    from zerodp.zero import fragments

    engine = _engine(stage, None, precision)
    named = dict(engine.module.named_parameters())
    ref = make_model()
    ref.to(next(iter(named.values())).dtype)
    reads = []
    for block in range(2):
        engine.zero_grad()
        own = {name: None for name in named}
        with engine.no_sync():
            for micro in range(2):
                engine.backward(engine(*batch(rank, micro, 0)))
                grads = torch.autograd.grad(ref(*batch(rank, micro, 0)), list(ref.parameters()))
                own = {n: g if own[n] is None else own[n] + g for n, g in zip(named, grads)}
                reads.append([(fragments.safe_get_full_grad(p), own[n]) for n, p in named.items()])
    return reads


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "fp32"), (1, "bf16")])
def test_before_the_reduction_the_full_grad_is_this_ranks_own_accumulated_gradient(stage: int,
                                                                                    precision: str) -> None:
    for reads in run_ranks(_before_the_reduction, 2, args=(stage, precision), timeout=120):
        for moment, pairs in enumerate(reads):
            for got, own in pairs:
                assert got is not None and got.shape == own.shape, moment
                if precision == "fp32":  # the same sums in the same order: bitwise
                    assert torch.equal(got, own), moment
                else:  # bf16 sums of bf16 gradients, in a different order than autograd.grad
                    torch.testing.assert_close(got.float(), own.float(), rtol=2e-2, atol=1e-3)
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(reads[0], reads[2]))  # zero_grad started over


def _stage2_between_micro_batches(rank: int, world: int) -> list:
    from zerodp.zero import fragments
    import zerodp

    model = make_model()
    engine, *_ = zerodp.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.backward(engine(*batch(rank, 0, 0)))
    return [fragments.safe_get_full_grad(p) for p in engine.module.parameters()]


def test_at_stage_2_between_micro_batches_there_is_no_gradient_to_read() -> None:
    """Stage 2 reduces every backward into owned shards: no whole local gradient exists to return."""
    for grads in run_ranks(_stage2_between_micro_batches, 2, timeout=120):
        assert grads and all(g is None for g in grads)


def _local_setters(rank: int, world: int, stage: int) -> tuple:
    from zerodp.zero import GatheredParameters, fragments

    engine = _engine(stage, None, "bf16")
    p = engine.module.fc1.weight
    master = fragments.safe_get_full_fp32_param(p)
    initial = make_model().fc1.weight.detach().to(torch.bfloat16).float()  # the working copy the masters start from
    value = torch.full(master.shape, 1.0 + 2.0 ** -12)  # not a bf16 number: the master keeps it, bf16 rounds to 1
    local = fragments.safe_get_local_fp32_param(p)
    if local is not None:
        fragments.safe_set_local_fp32_param(p, value.reshape(-1)[: local.numel()] if rank == 0 else
                                            value.reshape(-1)[-local.numel():])
    else:
        fragments.safe_set_local_fp32_param(p, None)
    after = fragments.safe_get_full_fp32_param(p)
    with GatheredParameters([p]):
        working = p.detach().clone()
    return master.dtype, torch.equal(master, initial), torch.equal(after, value), working.dtype, \
        torch.equal(working, value.to(torch.bfloat16))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_fp32_masters_and_the_working_copy_follows_a_set(stage: int) -> None:
    for master_dtype, master_is_initial, set_round_trips, working_dtype, working_updated in run_ranks(
            _local_setters, 2, args=(stage,), timeout=120):
        assert master_dtype == torch.float32 and master_is_initial
        assert set_round_trips
        assert working_dtype == torch.bfloat16 and working_updated


def _errors(rank: int, world: int) -> list[str]:
    from zerodp.zero import fragments

    engine = _engine(2, None)
    p = engine.module.fc1.weight
    errors = []
    for call in (lambda: fragments.safe_set_full_fp32_param(p, torch.zeros(3)),
                 lambda: fragments.safe_set_full_optimizer_state(p, torch.zeros(p.shape), "exp_avg"),
                 lambda: fragments.safe_set_full_grad(p, torch.zeros(p.shape)),
                 lambda: fragments.safe_set_full_fp32_param(torch.nn.Parameter(torch.zeros(2)), torch.zeros(2))):
        try:
            call()
        except (ValueError, RuntimeError) as error:
            errors.append(str(error))
    engine.backward(engine(*batch(rank, 0, 0)))
    engine.step()
    try:
        fragments.safe_get_full_optimizer_state(p, "momentum_buffer")
    except ValueError as error:
        errors.append(str(error))
    return errors


def test_setters_name_what_is_wrong() -> None:
    errors = run_ranks(_errors, 2, timeout=120)[0]
    assert len(errors) == 5, errors
    assert "value has shape (3,), the parameter (64, 16)" in errors[0]
    assert "the optimizer has no state yet" in errors[1]
    assert "no reduced gradient to replace" in errors[2]
    assert "not trained by any live zerodp engine" in errors[3]
    assert "keeps no element-wise state 'momentum_buffer'; it keeps ['exp_avg', 'exp_avg_sq']" in errors[4]


def test_nvme_optimizer_offload_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(RankFailed, match="offload_optimizer.device=nvme"):
        run_ranks(_nvme, 1, args=(str(tmp_path),), timeout=120)


def _nvme(rank: int, world: int, path: str) -> None:
    import zerodp
    from zerodp.zero import fragments

    model = make_model()
    config = {"train_micro_batch_size_per_gpu": 4,
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": path}}}
    engine, *_ = zerodp.initialize(model=model, config=config,
                                   optimizer=lambda groups: torch.optim.AdamW(groups, **ADAMW))
    fragments.safe_get_full_fp32_param(engine.module.fc1.weight)

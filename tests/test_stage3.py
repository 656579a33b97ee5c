"""ZeRO stage 3 against torch DDP, and what real models do to it.

The model (tests/models.py's BlockLM) has 4 blocks (units), runs block 0 twice, ties its output
head to the embedding and uses it outside the embedding's forward, and skips its last block on
some micro-batches, so the recorded prefetch order changes between passes. Where bitwise parity
is possible and where the sum order makes it impossible is test_parity.py's [Note: where bitwise
parity is possible]: stage 3 reduces every micro-batch like stage 2.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness import RankFailed, run_ranks
from tests.models import batch, make_block_lm, train_with_ddp, two_groups

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
BINDING, LOOSE = 0.5, 100.0
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True}


def _use_last(step: int, micro: int) -> bool:
    """The last block is skipped on the second micro-batch of each step: every step uses it (Adam
    would decay a module unused for a whole step, unlike DDP), yet the order changes every pass."""
    return micro != 1


def _config(gas: int = 1, clip: float = LOOSE, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
            "zero_optimization": {**ZERO3, **zero}}


def _ddp(rank: int, steps: int, gas: int, clip: float, optimizer, model_kwargs: dict, use_last=_use_last):
    model = make_block_lm(**model_kwargs)
    return train_with_ddp(model, optimizer(two_groups(model)), rank, steps, gas, clip,
                          lambda step, micro: {"use_last": use_last(step, micro)}, find_unused=True)


def _zerodp(rank: int, steps: int, gas: int, config: dict, optimizer, model_kwargs: dict, use_last=_use_last,
            between=None):
    import zerodp

    model = make_block_lm(**model_kwargs)
    engine, _, _, _ = zerodp.initialize(model=model, model_parameters=two_groups(model), config=config,
                                        optimizer=optimizer)
    losses = []
    for step in range(steps):
        for micro in range(gas):
            if between is not None:
                between(engine, rank, step)
            loss = engine(*batch(rank, step, micro), use_last=use_last(step, micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses, {n: t.float() for n, t in engine.module.state_dict().items()}, engine


def _adamw(groups):
    return torch.optim.AdamW(groups, **ADAMW)


def _sgd(groups):
    return torch.optim.SGD([{**g, "weight_decay": 0.0} for g in groups], lr=0.1)


def _parity(rank: int, world: int, gas: int, clip: float, extra: dict | None = None, optimizer=_adamw,
            model_kwargs: dict | None = None, use_last=_use_last):
    model_kwargs = model_kwargs or {}
    ref_losses, ref_params = _ddp(rank, 6, gas, clip, optimizer, model_kwargs, use_last)
    config = {**_config(gas, clip), **(extra or {})}
    losses, params, _ = _zerodp(rank, 6, gas, config, optimizer, model_kwargs, use_last)
    gaps = {n: (params[n] - ref).abs().max().item() for n, ref in ref_params.items()} if rank == 0 else {}
    return losses, ref_losses, gaps


@pytest.mark.parametrize("world,gas", [(1, 1), (1, 3), (2, 1)])
def test_fp32_bitwise_equal_to_ddp(world: int, gas: int) -> None:
    """Repeated block, tied head used outside its module, a block skipped on some micro-batches."""
    for rank, (losses, ref_losses, gaps) in enumerate(run_ranks(_parity, world, args=(gas, LOOSE))):
        assert losses == ref_losses
        if rank == 0:
            assert set(gaps) == {n for n, _ in make_block_lm().named_parameters()}
            assert max(gaps.values()) == 0.0, gaps


@pytest.mark.parametrize("world,gas,clip", [(2, 3, BINDING), (4, 1, LOOSE), (4, 3, BINDING)])
def test_fp32_within_ulps_of_ddp_where_sum_order_differs(world: int, gas: int, clip: float) -> None:
    """Measured: loss gaps <= 1.9e-6 (losses ~4, a few ulps); parameters <= 2.6e-6 at 2 ranks."""
    for losses, ref_losses, gaps in run_ranks(_parity, world, args=(gas, clip)):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 2e-5
        assert all(g < 1e-4 for g in gaps.values())


def _skip_on_step_1(step: int, micro: int) -> bool:
    return step % 3 != 1


def test_a_block_skipped_for_whole_steps_matches_ddp_with_sgd() -> None:
    """A module unused for a whole step gets no gradient in DDP (the optimizer skips it) and a zero
    gradient shard here: identical for SGD; Adam would still decay it (as in DeepSpeed)."""
    for losses, ref_losses, gaps in run_ranks(_parity, 2, args=(1, LOOSE, None, _sgd, None, _skip_on_step_1)):
        assert losses == ref_losses
        assert all(g == 0.0 for g in gaps.values())


@pytest.mark.parametrize("extra,loss_rtol,param_atol", [
    ({"bf16": {"enabled": True}}, 2e-2, 5e-2),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, 2e-2, 5e-2),
    ({"fp16": {"enabled": True, "initial_scale_power": 8}}, 2e-3, 5e-2),
])
def test_mixed_precision_close_to_fp32_ddp(extra: dict, loss_rtol: float, param_atol: float) -> None:
    """Measured gaps (loss relative / params): bf16 6.1e-3 / 2.4e-2, fp16 9.4e-4 / 2.0e-2; stage 0
    and 2 measure the same on this model (the largest gap is in the block skipped half the time)."""
    for losses, ref_losses, gaps in run_ranks(_parity, 2, args=(2, BINDING, extra)):
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < loss_rtol
        assert all(g < param_atol for g in gaps.values())


# --- robustness -----------------------------------------------------------------------------------


def _frozen(rank: int, world: int):
    """LoRA-style: every fc1 and the embedding frozen; only the rest trains."""
    import zerodp
    from torch.nn.parallel import DistributedDataParallel as DDP

    def freeze(model):
        for name, p in model.named_parameters():
            p.requires_grad_(not (".fc1." in name or name.startswith("embed")))
        return model

    ref = freeze(make_block_lm())
    ddp = DDP(ref)
    opt = _adamw([p for p in ref.parameters() if p.requires_grad])
    model = freeze(make_block_lm())
    engine, *_ = zerodp.initialize(model=model, config=_config(), optimizer=_adamw)
    for step in range(4):
        ref_loss = ddp(*batch(rank, step, 0))
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        loss = engine(*batch(rank, step, 0))
        engine.backward(loss)
        engine.step()
        assert loss.item() == ref_loss.item()
    params = engine.module.state_dict()
    reduced = engine.comm_report()["last_step"]["ops"]["reduce_scatter[float32]"]["numel"]
    trainable = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    return ({n: torch.equal(params[n], p) for n, p in ref.named_parameters()} if rank == 0 else None), reduced, trainable


def test_frozen_parameters_lora_style_bitwise_and_not_reduced() -> None:
    for rank, (equal, reduced, trainable) in enumerate(run_ranks(_frozen, 2)):
        assert trainable <= reduced < trainable + 2 * 6  # only trainable flats are reduce-scattered (+ padding)
        if rank == 0:
            assert all(equal.values()), equal


def _eval_and_generate(engine, rank: int, step: int) -> None:
    """Between micro-batches: an eval forward under no_grad, a greedy generation loop, and a
    submodule of a block called on its own (its unit is gathered around the call)."""
    engine.eval()
    with torch.no_grad():
        idx, targets = batch(rank, 50 + step, 0)
        engine(idx, targets)
        for _ in range(3):
            nxt = engine(idx[:, -4:], None)[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
        engine.module.blocks[1].fc1(torch.ones(2, 16))
    engine.train()


def _with_between(rank: int, world: int, between):
    plain, _, _ = _zerodp(rank, 4, 2, _config(2), _adamw, {})
    mixed, _, engine = _zerodp(rank, 4, 2, _config(2), _adamw, {}, between=between)
    return plain == mixed


def test_eval_no_grad_and_generation_between_steps_change_nothing() -> None:
    assert all(run_ranks(_with_between, 2, args=(_eval_and_generate,)))


def _checkpointed(rank: int, world: int, style: str):
    import zerodp

    def run(apply):
        model = make_block_lm()
        apply(model)
        engine, *_ = zerodp.initialize(model=model, config=_config(2), optimizer=_adamw)
        losses = []
        for step in range(3):
            for micro in range(2):
                loss = engine(*batch(rank, step, micro), use_last=_use_last(step, micro))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        return losses, engine.module.state_dict(), engine.memory_report()["activations"]

    def hf_style(model):  # what transformers' gradient_checkpointing_enable does: recompute via __call__
        for block in model.blocks:
            call = block.__call__
            block.forward = lambda h, call=call, block=block: torch.utils.checkpoint.checkpoint(
                type(block).forward, block, h, use_reentrant=False)
        return model

    apply = {"blocks": lambda m: zerodp.checkpointing.apply(m, policy="blocks"), "hf": hf_style}[style]
    plain = run(lambda m: None)
    checkpointed = run(apply)
    same_params = rank != 0 or all(torch.equal(plain[1][n], checkpointed[1][n]) for n in plain[1])
    return plain[0] == checkpointed[0], same_params, plain[2], checkpointed[2]


@pytest.mark.parametrize("style", ["blocks", "hf"])
def test_activation_checkpointing_regathers_for_recomputation(style: str) -> None:
    for same_losses, same_params, plain_saved, ckpt_saved in run_ranks(_checkpointed, 2, args=(style,)):
        assert same_losses and same_params
        assert ckpt_saved["device"] < plain_saved["device"]


def _divergent(rank: int, world: int):
    import zerodp

    model = make_block_lm(reuse_first=False)
    engine, *_ = zerodp.initialize(model=model, config=_config(), optimizer=_adamw)
    loss = engine(*batch(rank, 0, 0), use_last=rank == 0)  # rank 1 skips the last block
    engine.backward(loss)


def test_ranks_running_different_modules_raise_naming_them() -> None:
    with pytest.raises(RankFailed, match=r"ranks are about to gather different modules \(rank 0: blocks.3, "
                                         r"rank 1: blocks.2\)"):
        run_ranks(_divergent, 2, timeout=100)


def _divergent_under_a_marked_root(rank: int, world: int):
    import zerodp

    model = make_block_lm(reuse_first=False)
    zerodp.zero.set_z3_leaf_modules(model, [type(model)])
    engine, *_ = zerodp.initialize(model=model, config=_config(), optimizer=_adamw)
    for step in range(2):
        engine.backward(engine(*batch(rank, step, 0), use_last=rank == 0))  # rank 1 skips the last block
        engine.step()
    return [u.name for u in engine.strategy.units if u.trainable]


def test_marking_the_model_itself_makes_it_one_unit_so_ranks_may_run_different_modules() -> None:
    """DeepSpeed's set_z3_leaf_modules(model, [type(model)]): the whole model is gathered at once."""
    assert run_ranks(_divergent_under_a_marked_root, 2, timeout=100) == [["<root>"], ["<root>"]]


def test_module_granularity_is_parameters_per_layer() -> None:
    """BlockLM(vocab 320, dim 16): a block = norm 32 + fc1 544 + fc2 528 over its 3 layers + itself = 276;
    the model = embed 5,120 + blocks 4,416 + norm 32 over embed, 4 x 4 block layers, norm and itself
    = 503; containers and layers: never."""
    from zerodp.zero.granularity import mark_leaf_modules_by_granularity, module_granularity

    model = make_block_lm(vocab=320)
    granularity = {n: module_granularity(model)[m] for n, m in model.named_modules()}
    assert granularity["blocks.2"] == 276 and granularity[""] == 503
    assert granularity["blocks"] == granularity["blocks.2.fc1"] == float("inf")
    assert mark_leaf_modules_by_granularity(make_block_lm(vocab=320), 275) == []
    assert mark_leaf_modules_by_granularity(make_block_lm(vocab=320), 300) == [f"blocks.{i}" for i in range(4)]
    assert mark_leaf_modules_by_granularity(make_block_lm(vocab=320), 503) == [""]  # outermost first


def _granularity(rank: int, world: int, threshold: int):
    import zerodp

    config = _config(stage3_module_granularity_threshold=threshold, stage3_param_persistence_threshold=0)
    engine, *_ = zerodp.initialize(model=make_block_lm(vocab=320, reuse_first=False), config=config, optimizer=_adamw)
    losses = []
    for step in range(3):
        losses.append(engine(*batch(rank, step, 0)))
        engine.backward(losses[-1])
        engine.step()
    return [loss.item() for loss in losses], [u.name for u in engine.strategy.units if u.trainable]


def test_stage3_module_granularity_threshold_changes_the_units_not_the_losses() -> None:
    """DeepSpeed's test_finegrained_optimization: the same losses at every threshold."""
    runs = {threshold: run_ranks(_granularity, 2, args=(threshold,), timeout=100) for threshold in (0, 300, 10**7)}
    assert [units for _, units in runs[0]] == [["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]] * 2
    assert runs[300] == runs[0]  # the blocks were the units already
    assert [units for _, units in runs[10**7]] == [["<root>"]] * 2
    assert [losses for losses, _ in runs[10**7]] == [losses for losses, _ in runs[0]]


# --- ledgers ------------------------------------------------------------------------------------------


def _always(step: int, micro: int) -> bool:
    return True


def _ledgers(rank: int, world: int, precision: dict, zero: dict):
    from zerodp.zero.layout import group_layout

    _, _, engine = _zerodp(rank, 2, 1, {**_config(**zero), **precision}, _adamw, {"reuse_first": False},
                           use_last=_always)
    units = engine.strategy.units
    layouts = {u.name: group_layout([p.ds_numel for p in u.trainable.params], world) for u in units if u.trainable}
    return engine.memory_report(), engine.comm_report()["last_step"], {n: (l.numel, l.padded_numel) for n, l in layouts.items()}


def _unit_numels(world: int) -> dict[str, tuple[int, int]]:
    """By hand from BlockLM(vocab 32, dim 16): root = embedding 512 + final norm 32; a block =
    norm 32 + fc1 16*32+32 + fc2 32*16+16 = 1104. Padded to a multiple of the world size."""
    numels = {"<root>": 544, **{f"blocks.{i}": 1104 for i in range(4)}}
    return {n: (k, -(-k // world) * world) for n, k in numels.items()}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_state_bytes_are_16_psi_over_n_plus_padding(world: int) -> None:
    """bf16: per rank 2 (param shard) + 4 (master) + 2 (grad shard) bytes per padded shard element,
    8 per real element of Adam state, 4 per optimizer tensor (its `step`): summed over ranks,
    16Ψ + 8·padding + 4·tensors, exactly."""
    results = run_ranks(_ledgers, world, args=({"bf16": {"enabled": True}}, {}))
    numels = _unit_numels(world)
    psi = sum(n for n, _ in numels.values())
    padded = sum(p for _, p in numels.values())
    assert {n: v for n, v in results[0][2].items()} == numels
    total = 0
    for memory, _, _ in results:
        held = memory["held"]
        assert held["param16"]["device"] == 2 * padded // world
        assert held["param32_master"]["device"] == 4 * padded // world
        assert held["grad"]["device"] == 2 * padded // world
        total += memory["model_states"]
    tensors = sum(memory["held"]["optim_state"]["device"] for memory, _, _ in results) - 8 * psi
    assert tensors % 4 == 0 and 0 < tensors // 4 <= 2 * len(numels) * world  # one `step` per optimizer tensor
    assert total == 16 * psi + 8 * (padded - psi) + tensors


def test_communication_per_step_is_3_psi_for_units_and_2_psi_for_the_root() -> None:
    """Blocks: all-gather in forward, again in backward, reduce-scatter: 3x their padded numel.
    The root unit (embedding, final norm) stays gathered from forward to backward: 2x. Plus the
    2-element norm/overflow all-reduce and gloo's 8-byte unit checks before each gather."""
    numels = _unit_numels(2)
    root, blocks = numels["<root>"][1], sum(p for n, (_, p) in numels.items() if n != "<root>")
    for _, comm, _ in run_ranks(_ledgers, 2, args=({}, {})):
        ops = comm["ops"]
        assert ops["all_gather[float32]"]["numel"] == root + 2 * blocks
        assert ops["reduce_scatter[float32]"]["numel"] == root + blocks
        assert ops["all_reduce[float32]"]["numel"] == 2 * 2
        assert ops["all_gather[int64]"]["calls"] == ops["all_gather[float32]"]["calls"] == 1 + 2 * 4


@pytest.mark.parametrize("prefetch,max_live,expected_peak_units",
                         [(0, 10**9, 1), (1104, 10**9, 2), (10**6, 544 + 2 * 1104, 2), (10**6, 10**9, 4)])
def test_gathered_parameters_stay_within_the_prefetch_and_live_bounds(prefetch, max_live, expected_peak_units) -> None:
    """Peak gathered bytes (fp32) = the root unit + at most `expected_peak_units` blocks: no
    prefetch gathers one block at a time, a prefetch bucket of one block holds two,
    max_live_parameters of the root and two blocks caps a huge prefetch bucket at two, and with
    neither bound every block is gathered ahead (DeepSpeed's defaults on a model this small)."""
    zero = {"stage3_prefetch_bucket_size": prefetch, "stage3_max_live_parameters": max_live}
    root, block = _unit_numels(2)["<root>"][1], _unit_numels(2)["blocks.0"][1]
    for memory, _, _ in run_ranks(_ledgers, 2, args=({}, zero)):
        assert memory["transient_peak"]["gathered_params"] == 4 * (root + expected_peak_units * block)


# --- full weights ---------------------------------------------------------------------------------------


def _full_weights(rank: int, world: int, gather: bool, tmp: str):
    import zerodp

    model = make_block_lm()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = zerodp.initialize(model=model, config=_config(stage3_gather_16bit_weights_on_model_save=gather),
                                   optimizer=_adamw)
    shapes = [tuple(p.shape) for p in model.parameters()]
    state = engine.module.state_dict()
    engine.save_16bit_model(tmp, "model.safetensors")
    return shapes, {n: torch.equal(state[n], reference[n]) for n in reference} if rank == 0 else state


def test_state_dict_and_save_16bit_model_give_full_weights_on_rank_0(tmp_path) -> None:
    from zerodp.checkpoint.convert import read_safetensors

    (shapes, equal), (_, other) = run_ranks(_full_weights, 2, args=(True, str(tmp_path)))
    assert set(shapes) == {(0,)}  # partitioned: the module holds no full parameter
    assert all(equal.values()) and len(equal) == 27
    assert other == {}  # consolidated on rank 0 only, as DeepSpeed
    saved = read_safetensors(tmp_path / "model.safetensors")
    reference = make_block_lm().state_dict()
    assert set(saved) == set(reference) and all(torch.equal(saved[n], reference[n]) for n in saved)


def test_save_16bit_model_without_the_gather_key_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(RankFailed, match=r"save_16bit_model\(\) of a ZeRO stage-3 model: .*"
                                         "stage3_gather_16bit_weights_on_model_save"):
        run_ranks(_full_weights, 2, args=(False, str(tmp_path)))


def _state_dict_on_rank_0_only(rank: int, world: int) -> dict:
    import zerodp

    engine, *_ = zerodp.initialize(model=make_block_lm(), config=_config(stage3_gather_16bit_weights_on_model_save=False),
                                   optimizer=_adamw)
    state = engine.module.state_dict() if rank == 0 else {}  # DeepSpeed-Chat's save_hf_format, at stage 3
    engine.backward(engine(*batch(rank, 0, 0)))  # the ranks' next collectives still pair
    engine.step()
    return {n: tuple(t.shape) for n, t in state.items()}


def test_state_dict_on_one_rank_without_the_gather_key_returns_deepspeed_s_placeholders() -> None:
    # before: it raised on rank 0 alone, and rank 1 then failed on its lost peer
    shapes, _ = run_ranks(_state_dict_on_rank_0_only, 2)
    reference = make_block_lm().state_dict()
    assert set(shapes) == set(reference)
    assert {shapes[n] for n, p in make_block_lm().named_parameters()} == {(0,)}  # partitioned: empty, as DeepSpeed


# --- zero.Init and GatheredParameters --------------------------------------------------------------------------


def _init(rank: int, world: int, offload: str | None = None, swap_dir: str = ""):
    import zerodp
    from tests.models import BlockLM

    param = {"device": offload, **({"nvme_path": swap_dir, "max_in_cpu": 0} if offload == "nvme" else {})}
    config = _config(**({"offload_param": param} if offload else {}))
    torch.manual_seed(1234 + rank)  # different random state per rank: Init keeps rank 0's values
    if rank == 0:
        torch.manual_seed(0)
    with zerodp.zero.Init(config=config) as init:
        model = BlockLM()
    shards = [p._zerodp_init_shard for p in model.parameters()]
    store = getattr(model.embed.weight, "_zerodp_init_slot", None) and model.embed.weight._zerodp_init_slot.store
    # where the shards are until initialize(): host memory, or a swap file (nothing in memory)
    placed = ({s.device.type for s in shards}, sum(s.untyped_storage().nbytes() for s in shards),
              store.allocated_bytes if store is not None else 0)
    init_files = store.run_directory if store is not None else None
    del shards, store
    full_bytes = 4 * sum(p.ds_numel for p in model.parameters())
    largest_layer = 4 * (32 * 16 + 32)  # fc1's weight and bias, the largest module's own params
    with zerodp.zero.GatheredParameters(model.embed.weight, modifier_rank=0):
        with torch.no_grad():
            if rank == 0:
                model.embed.weight[3] = 7.0
    engine, *_ = zerodp.initialize(model=model, config=config, optimizer=_adamw)
    with zerodp.zero.GatheredParameters(model.blocks[1].fc2.weight, modifier_rank=world - 1):
        with torch.no_grad():
            if rank == world - 1:
                model.blocks[1].fc2.weight.fill_(0.5)
    with zerodp.zero.GatheredParameters([model.embed.weight, model.blocks[1].fc2.weight]):
        seen = model.embed.weight[3].clone(), model.blocks[1].fc2.weight.clone()
    gone = init_files is None or not init_files.exists()  # initialize() read every shard: the file went
    if offload is None:
        return init.peak_bytes, full_bytes, largest_layer, seen, _three_steps(engine, rank)
    return init.peak_bytes, full_bytes, largest_layer, seen, _three_steps(engine, rank), placed, gone


def _init_reference(rank: int, world: int):
    import zerodp

    model = make_block_lm()
    with torch.no_grad():
        model.embed.weight[3] = 7.0
        model.blocks[1].fc2.weight.fill_(0.5)
    engine, *_ = zerodp.initialize(model=model, config=_config(), optimizer=_adamw)
    return _three_steps(engine, rank)


def _three_steps(engine, rank: int) -> list[float]:
    losses = []
    for step in range(3):
        loss = engine(*batch(rank, step, 0))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("world", [2, 4])
def test_init_partitions_during_construction_and_gathered_edits_reach_every_shard(world: int) -> None:
    reference = run_ranks(_init_reference, world)
    for rank, (peak, full_bytes, largest, (embed_row, fc2), losses) in enumerate(run_ranks(_init, world)):
        assert peak <= math.ceil(full_bytes / world) + 4 * 27 * world + largest  # 1/N + padding + one layer
        assert torch.equal(embed_row, torch.full((16,), 7.0)) and torch.equal(fc2, torch.full((16, 32), 0.5))
        assert losses == reference[rank]  # built under Init = built whole, bitwise


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_init_keeps_the_shards_in_host_memory_or_a_swap_file_until_initialize(tmp_path, offload: str) -> None:
    # the config's offload_param (DeepSpeed's remote_device): with nvme a model larger than host memory can
    # be built; the shards are written as each module is built, read back one unit at a time by initialize()
    reference = run_ranks(_init_reference, 2)
    for rank, result in enumerate(run_ranks(_init, 2, args=(offload, str(tmp_path)))):
        peak, full_bytes, largest, (embed_row, fc2), losses, (devices, in_memory, swapped), gone = result
        assert devices == {"cpu"} and losses == reference[rank]  # bitwise the model built whole
        assert torch.equal(embed_row, torch.full((16,), 7.0)) and torch.equal(fc2, torch.full((16, 32), 0.5))
        if offload == "nvme":
            assert in_memory == 0 and swapped >= full_bytes // 2 and peak <= largest  # only one layer in full
            assert gone  # the zero.Init swap file is removed once initialize() has read it
        else:
            assert in_memory >= full_bytes // 2 and swapped == 0


# --- parameters used outside their module --------------------------------------------------------------------


class _PeeksIntoABlock(torch.nn.Module):
    """Uses a block's weight in the model's own forward, outside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = make_block_lm(reuse_first=False)

    def forward(self, idx, targets):
        return self.lm(idx, targets) + self.lm.blocks[1].fc1.weight.square().mean()


def _external(rank: int, world: int, register: bool):
    import zerodp

    torch.manual_seed(0)
    model = _PeeksIntoABlock()
    if register:
        zerodp.zero.register_external_parameter(model, model.lm.blocks[1].fc1.weight)
    engine, *_ = zerodp.initialize(model=model, config=_config(), optimizer=_adamw)
    loss = engine(*batch(rank, 0, 0))
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.mark.parametrize("message,hinted", [
    ("mat1 and mat2 shapes cannot be multiplied (4x16 and 0x16)", True),
    ("The size of tensor a (16) must match the size of tensor b (0) at non-singleton dimension 1", True),
    ("Function MmBackward0 returned an invalid gradient at index 1 - got [0] but expected shape compatible with "
     "[16, 32]", True),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:61233", False),
    ("ZeRO stage 3: ranks ran different modules in this forward/backward, so their parameter gathers paired up "
     "wrongly", False),
    ("expected scalar type Float but found BFloat16", False),
])
def test_the_released_parameter_hint_is_added_only_to_errors_about_a_released_shape(message: str, hinted: bool) -> None:
    from zerodp.zero.stage3 import Stage3

    assert (Stage3.error_hint(None, RuntimeError(message)) is not None) == hinted  # type: ignore[arg-type]


def test_a_parameter_used_outside_its_module_names_the_fix_and_works_once_registered() -> None:
    with pytest.raises(RankFailed, match="register_external_parameter"):
        run_ranks(_external, 2, args=(False,))
    losses = run_ranks(_external, 2, args=(True,))
    assert all(math.isfinite(x) for x in losses)


def _units(rank: int, world: int, zero: dict, leaf_classes):
    import zerodp
    from tests.models import Block

    model = make_block_lm()
    if leaf_classes:
        zerodp.zero.set_z3_leaf_modules(model, [Block])
    engine, *_ = zerodp.initialize(model=model, config=_config(**zero), optimizer=_adamw)
    return [(u.name, u.numel) for u in engine.strategy.units]


@pytest.mark.parametrize("zero,leaf_classes,expected", [
    ({}, False, ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]),
    ({"leaf_module": {"classes": ["Linear"]}}, False,
     ["<root>"] + [f"blocks.{i}.{fc}" for i in range(4) for fc in ("fc1", "fc2")]),
    ({"leaf_module": {"name_suffixes": ["fc2"]}}, False, ["<root>"] + [f"blocks.{i}.fc2" for i in range(4)]),
    ({"leaf_module": {"name_suffixes": ["fc2"]}}, True, ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]),
    ({"stage3_param_persistence_threshold": 32}, False,
     ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "<persistent>"]),
])
def test_how_units_are_chosen(zero: dict, leaf_classes: bool, expected: list[str]) -> None:
    """Default: the largest ModuleList's children; leaf_module (config) or set_z3_leaf_modules
    choose instead (the outermost marked module wins); small parameters form one persistent unit."""
    units = run_ranks(_units, 1, args=(zero, leaf_classes))[0]
    assert [name for name, _ in units] == expected
    assert sum(numel for _, numel in units) == 544 + 4 * 1104


def _init_gpt(rank: int, world: int, under_init: bool):
    import zerodp
    from zerodp.demo import GPTConfig, TinyGPT

    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=2)
    config = _config()
    torch.manual_seed(0)
    if under_init:
        with zerodp.zero.Init(config=config):
            model = TinyGPT(cfg)
    else:
        model = TinyGPT(cfg)
    engine, *_ = zerodp.initialize(model=model, config=config, optimizer=_adamw)
    return engine.module.state_dict()


def test_init_keeps_a_models_own_weight_initialisation() -> None:
    """TinyGPT's _init_weights calls torch.nn.init on submodules that Init already partitioned:
    Init gathers them around each call, so the weights equal a model built whole, bitwise."""
    whole, _ = run_ranks(_init_gpt, 2, args=(False,))
    partitioned, _ = run_ranks(_init_gpt, 2, args=(True,))
    assert whole.keys() == partitioned.keys()
    assert all(torch.equal(whole[n], partitioned[n]) for n in whole)


class _TwoFrozenBlocks(torch.nn.Module):
    """Two frozen blocks of the same size that `swap` runs in the other order, and one trainable
    scale: the ranks' collectives still pair up one to one, so only the order check can tell."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.blocks.requires_grad_(False)
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, swap: bool) -> torch.Tensor:
        for block in (reversed(self.blocks) if swap else self.blocks):
            x = torch.tanh(block(x))
        return (self.scale * x).square().mean()


def _different_order_without_per_gather_checks(rank: int, world: int):
    import zerodp

    zerodp.comm.backend = lambda: "nccl"  # as on NCCL by default: no 8-byte check before each gather
    engine, *_ = zerodp.initialize(model=_TwoFrozenBlocks(), config=_config(), optimizer=_adamw)
    loss = engine(torch.ones(2, 8), swap=rank == 1)
    engine.backward(loss)


def test_without_per_gather_checks_the_order_hash_names_each_ranks_modules() -> None:
    """Same-size units run in another order on one rank pair their gathers wrongly without any
    error from the collectives; the hash compared after backward raises on every rank, naming each
    rank's order, before the optimizer steps on garbage. (Divergences that change the sequence of
    collectives hang until the collective timeout instead: docs/stage3.md.)"""
    with pytest.raises(RankFailed, match=r"ranks ran different modules(.|\n)*rank 0: <root> -> blocks.0 -> blocks.1"
                                         r"(.|\n)*rank 1: <root> -> blocks.1 -> blocks.0"):
        run_ranks(_different_order_without_per_gather_checks, 2, timeout=100)


def _generation_inside_gathered_parameters(rank: int, world: int):
    import zerodp
    from zerodp import comm

    engine, *_ = zerodp.initialize(model=make_block_lm(), config=_config(), optimizer=_adamw)

    def all_gathers() -> int:
        return sum(r.calls for (op, _), r in comm.ledger.current.items() if op.startswith("all_gather"))

    def generate() -> tuple[torch.Tensor, int]:
        idx, start = batch(rank, 7, 0)[0], all_gathers()
        for _ in range(6):
            idx = torch.cat([idx, engine(idx[:, -4:], None)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx, all_gathers() - start

    engine.eval()
    with torch.no_grad():
        plain, plain_gathers = generate()
        with zerodp.zero.GatheredParameters(engine.module.parameters()):
            held, held_gathers = generate()
            try:
                engine.step()
                refused = None
            except RuntimeError as err:
                refused = str(err)
    released = all(u.held_full_bytes() == 0 for u in engine.strategy.units)
    return plain_gathers, held_gathers, torch.equal(plain, held), refused, released, len(engine.strategy.units)


def test_units_stay_gathered_inside_gathered_parameters_so_generation_gathers_nothing() -> None:
    for plain, held, same, refused, released, units in run_ranks(_generation_inside_gathered_parameters, 2):
        assert plain >= 6 * units and held == 0  # every forward gathers every unit (a reused block twice), or nothing
        assert same and released
        assert "inside zerodp.zero.GatheredParameters" in refused


def _generation_budget(rank: int, world: int, budget: int | None):
    import zerodp
    from zerodp import comm

    engine, *_ = zerodp.initialize(model=make_block_lm(), config=_config(), optimizer=_adamw)

    def unit_gathers() -> int:  # the units' own all-gathers (not the 16-byte rank checks)
        return sum(r.calls for (op, dtype), r in comm.ledger.current.items() if op.startswith("all_gather")
                   and dtype != "int64")

    def generate() -> tuple[torch.Tensor, int]:
        idx, start = batch(rank, 7, 0)[0], unit_gathers()
        for _ in range(6):
            idx = torch.cat([idx, engine(idx[:, -4:], None)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx, unit_gathers() - start

    engine.eval()
    with torch.no_grad():
        plain, plain_gathers = generate()
        with engine.generation(max_live_parameters=budget):
            kept, kept_gathers = generate()
            kept_numel = sum(u.numel for u in engine.strategy._kept)
            try:
                engine.step()  # an update would reach the shards, not the kept full copies
                refused = not kept_numel
            except RuntimeError:
                refused = True
    released = all(u.held_full_bytes() == 0 and not u.holds for u in engine.strategy.units)
    return plain_gathers, kept_gathers, kept_numel, torch.equal(plain, kept), released and refused


@pytest.mark.parametrize("budget, gathers, kept_numel", [
    (None, 5, 544 + 4 * 1104),  # everything kept: one gather per unit per generate (block 0 runs twice a forward)
    (2 * 1104, 5 + 5 * 3, 2 * 1104),  # blocks 0 and 1 kept (they finish first); blocks 2, 3 and the root regather
    (0, 6 * 6, 0),  # nothing kept: every forward gathers every call of a unit, as without the block
])
def test_engine_generation_keeps_units_gathered_within_a_budget(budget, gathers, kept_numel) -> None:
    for plain, kept, numel, same, released in run_ranks(_generation_budget, 2, args=(budget,)):
        assert plain == 6 * 6 and kept == gathers and numel == kept_numel
        assert same and released  # the same tokens; every unit back to its shard at exit


def _paired_passes(rank: int, world: int, per_gather_checks: bool) -> str | None:
    import zerodp

    if not per_gather_checks:
        zerodp.comm.backend = lambda: "nccl"  # as on NCCL by default: one check per forward instead
    engine, *_ = zerodp.initialize(model=make_block_lm(), config=_config(), optimizer=_adamw)
    try:
        with torch.set_grad_enabled(rank == 0):  # rank 0 trains while rank 1 generates
            engine(*batch(rank, 0, 0))
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("per_gather_checks", [True, False])
def test_a_training_forward_paired_with_a_generation_forward_fails_at_that_forward(per_gather_checks: bool) -> None:
    # their gathers would pair up one to one; the divergence would only show at the backward
    for error in run_ranks(_paired_passes, 2, args=(per_gather_checks,), timeout=100):
        assert error is not None and "ranks are running different kinds of passes" in error, error
        assert "a training forward (grad enabled)" in error and "a forward without grad" in error
        assert "synced_gpus=True" in error


def _generate_different_lengths(rank: int, world: int) -> tuple:
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.distributed.fsdp import is_fsdp_managed_module

    import zerodp

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0))
    plain = copy.deepcopy(model)
    prompts = torch.tensor([[5, 9, 3, 7], [11, 2, 8, 4]])
    with torch.no_grad():  # rank 0's first greedy token ends its generation: rank 1 goes on
        eos = int(plain(prompts[:1]).logits[0, -1].argmax())
    engine, *_ = zerodp.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    kwargs = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0}
    with torch.no_grad():  # no synced_gpus= given: transformers must see a sharded model
        out = engine.module.generate(prompts[rank : rank + 1], **kwargs)
        expected = plain.generate(prompts[rank : rank + 1], **kwargs)
    return is_fsdp_managed_module(engine.module), out.shape[1], torch.equal(out, expected)


def test_ranks_that_generate_different_lengths_keep_pairing_their_gathers() -> None:
    pytest.importorskip("transformers")
    (managed, length0, same0), (_, length1, same1) = run_ranks(_generate_different_lengths, 2, timeout=100)
    assert managed and same0 and same1
    assert length0 == 5 and length1 > length0  # rank 0 stopped after one token, rank 1 did not


def _generate_in_a_block(engine, rank: int, step: int) -> None:
    import zerodp

    with torch.no_grad(), zerodp.zero.GatheredParameters(engine.module.parameters()):
        _eval_and_generate(engine, rank, step)


def test_generating_inside_gathered_parameters_between_steps_changes_nothing() -> None:
    assert all(run_ranks(_with_between, 2, args=(_generate_in_a_block,)))

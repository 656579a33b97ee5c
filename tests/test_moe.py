"""Mixture of experts at stage 3: every rank gathers every expert of a block, whatever its routing.

See zero/moe.py's [Note: MoE blocks are gathered whole]. The DeepSeek-style model of
tests/moe_models.py routes each rank's tokens to different experts (checked, not assumed); with
per-expert units (the detection off) the ranks' gathers diverge and the error names the class to
mark; with the detection on, stages 0-3 match DDP.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.harness import RankFailed, run_ranks
from tests.moe_models import NUM_EXPERTS, TinyMoELM, moe_batch

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
STEPS = 5
TIMEOUT_S = 120.0  # a hang on old code must fail the test, not the suite


def _config(stage: int, gas: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 100.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


def _ddp(rank: int, gas: int) -> tuple[list[float], dict[str, torch.Tensor], list]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = TinyMoELM()
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for step in range(STEPS):
        for micro in range(gas):
            with ddp.no_sync() if micro < gas - 1 else contextlib.nullcontext():
                loss = ddp(*moe_batch(rank, step, micro))
                (loss / gas).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, model.expert_calls()


def _checkpoint_layers_reentrant(model: TinyMoELM) -> None:
    """torch's reentrant checkpointing (transformers' default) around each layer: its forward runs without grad."""
    for layer in model.layers:
        forward = layer.forward
        layer.forward = lambda x, forward=forward: torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=True)


def _zerodp(rank: int, gas: int, stage: int, zero: dict) -> tuple[list[float], dict[str, torch.Tensor], list, list]:
    import zerodp

    model = TinyMoELM()
    if zero.pop("layers_not_a_list", False):  # no list of blocks: the expert lists are the longest lists
        model.layers = torch.nn.Sequential(*model.layers)
    if zero.pop("reentrant", False):
        _checkpoint_layers_reentrant(model)
    engine, *_ = zerodp.initialize(model=model, config=_config(stage, gas, **zero),
                                   optimizer=lambda groups: torch.optim.AdamW(groups, **ADAMW))
    units = [u.name for u in getattr(engine.strategy, "units", [])]
    losses = []
    for step in range(STEPS):
        for micro in range(gas):
            loss = engine(*moe_batch(rank, step, micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, model.expert_calls(), units


def _parity(rank: int, world: int, gas: int, stage: int, zero: dict):
    return _ddp(rank, gas), _zerodp(rank, gas, stage, zero)


def _zerodp_alone(rank: int, world: int, gas: int, stage: int, zero: dict):
    return _zerodp(rank, gas, stage, zero)


def _routes_differ(calls_per_rank: list[list]) -> bool:
    """Some forward of some layer where an expert got tokens on one rank and none on the other,
    and every forward where each expert got tokens on some rank (so no parameter of the model is
    unused on every rank, where DDP leaves the gradient None and ZeRO keeps a zero)."""
    differ = False
    for layer in range(len(calls_per_rank[0])):
        for forward in zip(*(calls[layer] for calls in calls_per_rank)):
            sets = [set(c) for c in forward]
            if set.union(*sets) != set(range(NUM_EXPERTS)):
                return False
            differ |= len({frozenset(s) for s in sets}) > 1
    return differ


LAYER_UNITS = ["<root>", "layers.0", "layers.1"]  # each layer with its MoE block: no expert is a unit of its own
MARKED = {"leaf_module": {"classes": ["DeepseekStyleMoE"]}}  # the detection off, the blocks marked by the user


@pytest.mark.parametrize("stage,gas,zero,units", [
    (0, 1, {}, []), (1, 1, {}, []), (2, 1, {}, []), (3, 1, {}, LAYER_UNITS), (3, 2, {}, LAYER_UNITS),
    (3, 1, MARKED, ["<root>", "layers.0.mlp", "layers.1.mlp"]), (3, 1, {"reentrant": True}, LAYER_UNITS),
])
def test_a_deepseek_style_moe_trains_like_ddp_with_different_routing_per_rank(stage: int, gas: int, zero: dict,
                                                                             units: list[str]) -> None:
    """fp32, 2 ranks, 5 steps: bitwise equal to DDP where the sums run in DDP's order (gas 1), within
    2e-5 in the loss and 1e-4 in the parameters where stage 3 reduces every micro-batch (gas 2:
    (a1 + b1) + (a2 + b2) against DDP's (a1 + a2) + (b1 + b2)). Also with the MoE blocks named in
    `leaf_module` instead of recognised (the line the divergence error proposes), and with each layer
    under reentrant checkpointing (its forward runs without grad, and again in backward)."""
    results = run_ranks(_parity, 2, args=(gas, stage, zero), timeout=TIMEOUT_S)
    assert _routes_differ([mine[2] for _, mine in results])
    for (ref_losses, ref_params, _), (losses, params, _, unit_names) in results:
        assert unit_names == units
        if gas == 1:
            assert losses == ref_losses
            assert all(torch.equal(params[n], ref) for n, ref in ref_params.items())
        else:
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 2e-5
            assert max((params[n] - ref).abs().max().item() for n, ref in ref_params.items()) < 1e-4


def test_with_the_detection_off_the_gathers_diverge_and_the_error_names_the_class_to_mark() -> None:
    """`leaf_module.classes: []` (DeepSpeed's way to drop its default MoE classes) turns the
    detection off. In a model whose layers are not a ModuleList (an nn.Sequential here), the
    experts of layer 0 (the longest ModuleList) become units, the ranks call different ones, and
    the pairing check raises on every rank with the line to add. (Where the layers are a
    ModuleList, they are the units, detection or not: tests/test_checkpointing.py.)"""
    zero = {"leaf_module": {"classes": []}, "layers_not_a_list": True}
    with pytest.raises(RankFailed) as failed:
        run_ranks(_zerodp_alone, 2, args=(1, 3, zero), timeout=TIMEOUT_S)
    message = str(failed.value)
    assert "ranks are about to gather different modules" in message
    assert "deepspeed.utils.set_z3_leaf_modules(model, [DeepseekStyleMoE])" in message
    assert '"leaf_module": {"classes": ["DeepseekStyleMoE"]}' in message


def _hf_moe(kind: str):
    """A tiny transformers-5 MoE causal LM (fused experts: one module holds all of them)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, num_experts_per_tok=1, max_position_embeddings=64)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(num_local_experts=4, **common)
        model = transformers.MixtralForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model


def _hf_batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(rank * 32, rank * 32 + 32, (1, 3), generator=g)  # each rank its own half of the vocabulary


def _routed(model) -> list[set[int]]:
    """A forward hook per router recording the experts it picked (the integer output)."""
    picked: list[set[int]] = []

    def record(module, args, output) -> None:
        picked.append({int(i) for t in output if isinstance(t, torch.Tensor) and not t.is_floating_point()
                       for i in t.flatten()})
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(record)
    return picked


def _hf_parity(rank: int, world: int) -> dict:
    """Both models in one run (transformers is imported once per rank)."""
    import zerodp
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for kind in ("qwen3_moe", "mixtral"):
        ref = _hf_moe(kind)
        ddp, opt = DDP(ref), torch.optim.AdamW(ref.parameters(), **ADAMW)
        model = _hf_moe(kind)
        picked = _routed(model)
        engine, *_ = zerodp.initialize(model=model, config=_config(3, 1),
                                       optimizer=lambda groups: torch.optim.AdamW(groups, **ADAMW))
        ref_losses, losses = [], []
        for step in range(3):
            ids = _hf_batch(rank, step)
            loss = ddp(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[kind] = ref_losses, losses, picked, [u.name for u in engine.strategy.units]
    return results


def test_transformers_moe_models_train_at_stage_3_with_different_routing_per_rank() -> None:
    """Control: transformers 5 keeps a block's experts in one fused module (Qwen3-MoE, Mixtral), which
    is one module anyway; the units are the decoder layers and the losses equal DDP's within 1e-6."""
    pytest.importorskip("transformers")
    results = run_ranks(_hf_parity, 2, timeout=TIMEOUT_S)
    for kind in ("qwen3_moe", "mixtral"):
        routed = [r[kind][2] for r in results]
        assert any(a != b for a, b in zip(*routed)), routed  # some router picked other experts on each rank
        for ref_losses, losses, _, units in (r[kind] for r in results):
            assert units == ["<root>", "model.layers.0", "model.layers.1"]
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-6, (kind, losses, ref_losses)


# --- detection and the z3 leaf-module helpers (pure: no ranks) ---------------------------------------


def test_moe_blocks_are_recognised_by_structure_not_by_name() -> None:
    from zerodp.zero.moe import find_moe_blocks, is_moe_block
    from tests.moe_models import DeepseekStyleMoE, ExpertMLP

    model = TinyMoELM()
    assert [n for n, _ in find_moe_blocks(model)] == ["layers.0.mlp", "layers.1.mlp"]

    class Renamed(torch.nn.Module):  # a router that is a plain Linear with one output per expert, other names
        def __init__(self, router_outputs: int) -> None:
            super().__init__()
            self.w_router = torch.nn.Linear(16, router_outputs)
            self.ffns = torch.nn.ModuleList([ExpertMLP() for _ in range(3)])

    assert is_moe_block(Renamed(3)) and not is_moe_block(Renamed(5))
    unequal = DeepseekStyleMoE()
    unequal.experts[1] = ExpertMLP(hidden=8)  # experts must be structurally identical
    assert not is_moe_block(unequal)
    stack = torch.nn.Sequential(torch.nn.Linear(16, 2), torch.nn.ModuleList([torch.nn.Linear(16, 16)] * 2))
    assert find_moe_blocks(stack) == []  # a list of single matrices is not a list of MLPs
    head = torch.nn.Sequential(torch.nn.Linear(8, 2), torch.nn.ModuleList([ExpertMLP() for _ in range(2)]))
    assert find_moe_blocks(head) == []  # a head that does not read what the list reads is not a router


def test_the_divergence_hint_names_the_class_that_holds_the_experts() -> None:
    from zerodp.zero.moe import leaf_hint

    model = TinyMoELM()
    hint = leaf_hint(model, ["layers.0.mlp.experts.2.down_proj", "layers.1", "<root>"])
    assert "`deepspeed.utils.set_z3_leaf_modules(model, [DeepseekStyleMoE])`" in hint
    assert leaf_hint(model, ["layers.1", "layers.0"]) == ""  # the model's own layers: no MoE block to mark


def test_z3_leaf_helpers_have_deepspeeds_semantics() -> None:
    """`deepspeed.utils`'s six helpers (what `import deepspeed` gives with ZERODP_AS_DEEPSPEED=1) are
    zerodp.zero's, with DeepSpeed 0.19's signatures and return values."""
    import zerodp
    from zerodp.compat import deepspeed as ds
    from tests.moe_models import DeepseekStyleMoE, ExpertMLP

    ds_utils = ds.utils
    for name in ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
                 "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"):
        assert getattr(ds_utils, name) is getattr(zerodp.zero, name)

    model = TinyMoELM()
    blocks = ds_utils.set_z3_leaf_modules(model, [DeepseekStyleMoE])
    assert blocks == [layer.mlp for layer in model.layers]
    assert ds_utils.get_z3_leaf_modules(model) == blocks and ds_utils.z3_leaf_module(blocks[0])
    # by name (the class's short or qualified name), as DeepSpeed accepts
    assert len(ds_utils.set_z3_leaf_modules(model, ["tests.moe_models.ExpertMLP"])) == 2 * 5
    assert ds_utils.unset_z3_leaf_modules(model, ["ExpertMLP"]) == [m for m in model.modules()
                                                                    if isinstance(m, ExpertMLP)]
    assert ds_utils.get_z3_leaf_modules(model) == blocks
    with pytest.raises(ValueError, match="no module of classes"):
        ds_utils.set_z3_leaf_modules(model, [torch.nn.Conv2d])
    assert ds_utils.set_z3_leaf_modules(model, [torch.nn.Conv2d], raise_if_not_found=False) == []
    matched, missing = ds_utils.set_z3_leaf_modules_by_name(model, ["layers.0.mlp.gate", "nope"],
                                                            raise_if_not_found=False)
    assert matched == [model.layers[0].mlp.gate] and missing == ["nope"]
    with pytest.raises(ValueError, match=r"no modules named \['nope'\]"):
        ds_utils.set_z3_leaf_modules_by_name(model, ["nope"])
    matched, missing = ds_utils.set_z3_leaf_modules_by_suffix(model, ["mlp.gate", "zzz"], flag=False,
                                                              raise_if_not_found=False)
    assert matched == [layer.mlp.gate for layer in model.layers] and missing == ["zzz"]
    assert not ds_utils.z3_leaf_module(model.layers[0].mlp.gate)
    with pytest.raises(ValueError, match="end with"):
        ds_utils.set_z3_leaf_modules_by_suffix(model, ["zzz"])


def _weights_without_calls(rank: int, world: int) -> None:
    """Each MoE block calls expert 0 but reads expert 1's weight without calling expert 1."""
    import zerodp

    def forward(block, x: torch.Tensor) -> torch.Tensor:
        return block.experts[0](x) + torch.nn.functional.linear(x, block.experts[1].up_proj.weight)[..., :x.shape[-1]]

    model = TinyMoELM()
    for layer in model.layers:
        layer.mlp.forward = forward.__get__(layer.mlp)
    engine, *_ = zerodp.initialize(model=model, config=_config(3, 1), optimizer=lambda g: torch.optim.SGD(g, lr=0.1))
    loss = engine(*moe_batch(rank, 0, 0))
    engine.backward(loss)


def test_an_expert_used_without_being_called_is_named() -> None:
    """Experts not called count as final at the start of backward ([Note: experts a rank did not
    call]); a gradient that reaches one anyway is an error naming the parameter, not a silent zero."""
    with pytest.raises(RankFailed, match=r"'layers.\d.mlp.experts.1.up_proj.weight' received a gradient although no "
                                         r"forward called its expert module"):
        run_ranks(_weights_without_calls, 2, timeout=TIMEOUT_S)


def test_trl_dpo_with_a_moe_policy_at_stage_3(tmp_path) -> None:
    """TRL's DPOTrainer (its reference model included) with a tiny Qwen3-MoE policy, 2 ranks, stage 3, bf16,
    through the DeepSpeed drop-in (tests/scripts/trl_dpo.py ... moe): the policy starts equal to its reference
    (zero rewards; the loss is log 2 plus the router's auxiliary loss, which TRL adds for MoE models, 1e-3 here)
    and learns."""
    pytest.importorskip("trl")
    import math

    from tests.test_hf_integration import SCRIPTS, _launch, zerodp_run

    result = _launch([*zerodp_run(), str(SCRIPTS / "trl_dpo.py"), "3", str(tmp_path), "moe"], tmp_path)
    logs = result["logs"]
    assert len(logs) == 4 and logs[0]["rewards/chosen"] == 0 == logs[0]["rewards/margins"]
    assert abs(logs[0]["loss"] - math.log(2)) < 1e-2
    assert logs[-1]["loss"] < logs[0]["loss"], logs
    assert result["ref_model"] == "zerodp.engine"


def test_trl_dpo_with_a_per_expert_module_policy_at_stage_3(tmp_path) -> None:
    """DPO at stage 3 stresses ZeRO-3 more than GRPO: every step runs two stage-3 engines, the policy
    (forward, gradient checkpointing's recomputation, backward) and TRL's forward-only reference,
    each routing each rank's own samples, while GRPO generates with every parameter gathered and
    (TRL's default beta=0) has no reference model. The policy is tests/moe_hf.py's DeepSeek-style
    model (a ModuleList of expert modules, loaded through the Auto classes like remote code), no
    user code names a module: zerodp makes each MoE block one unit. The ranks call different experts
    (checked from each rank's record); the run starts at log 2 (policy = reference) and learns. With
    the detection off (`"leaf_module": {"classes": []}`) the same run stops at the first forward with
    the divergence error naming DeepseekStyleMoE. Stage 0's losses, and the Qwen3-MoE control, are
    compared in bench/moe_dpo.py (bf16: losses and margins of stage 3 within 1.6e-4 of stage 0's,
    3.9e-4 for Qwen3-MoE; bench/README.md)."""
    pytest.importorskip("trl")
    import json
    import math

    from tests.test_hf_integration import SCRIPTS, _launch, zerodp_run

    result = _launch([*zerodp_run(), str(SCRIPTS / "trl_dpo.py"), "3", str(tmp_path), "experts"], tmp_path)
    logs = result["logs"]
    assert len(logs) == 4 and abs(logs[0]["loss"] - math.log(2)) < 1e-6, logs
    assert logs[0]["rewards/chosen"] == 0 == logs[0]["rewards/margins"]
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.05 and logs[-1]["rewards/margins"] > 0.1, logs
    assert result["ref_model"] == "zerodp.engine"
    calls = [json.loads((tmp_path / f"expert_calls_{rank}.json").read_text()) for rank in (0, 1)]
    for layer_0, layer_1 in zip(*calls):  # per layer: the forwards of rank 0 and of rank 1
        assert len(layer_0) == len(layer_1) > 0
        assert any(sorted(a) != sorted(b) for a, b in zip(layer_0, layer_1)), (layer_0, layer_1)

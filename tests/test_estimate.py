"""`zerodp estimate`: model states per rank, predicted before anything runs, equal to the ledger.

The estimator's figures must be the memory ledger's for the same run, byte for byte, category by
category and tier by tier (zerodp/plan/model_states.py's [Note: the model-state arithmetic]); and its
formulas reproduce the ZeRO paper's Figure 1 and, where the accounting differs, DeepSpeed's own
estimator's figures.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.harness import run_ranks

NUMEL = 1001  # odd: padded at every world size > 1


class _OneTensor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, NUMEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).square().mean()


def _ledgers(rank: int, world: int, dtype: str, nvme_dir: str, max_in_cpu: int) -> list:
    import zerodp
    from zerodp.plan.model_states import every_strategy

    precision = {"bf16": {"bf16": {"enabled": True}}, "fp32": {}}[dtype]
    out = []
    for s in every_strategy(dtype):
        zero: dict = {"stage": s.stage, "stage3_param_persistence_threshold": 0}
        for key, device in (("offload_optimizer", s.offload_optimizer), ("offload_param", s.offload_param)):
            if device != "none":
                zero[key] = {"device": device, **({"nvme_path": f"{nvme_dir}/{key}"} if device == "nvme" else {})}
        if s.offload_param == "nvme":
            zero["offload_param"]["max_in_cpu"] = max_in_cpu
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": zero, **precision}
        engine, *_ = zerodp.initialize(model=_OneTensor(), config=config)
        engine.backward(engine(torch.ones(NUMEL)))
        engine.step()  # Adam's state exists from the first step on
        out.append((s, engine.memory_report()["held"]))
    return out


@pytest.mark.parametrize("world,dtype,max_in_cpu", [(2, "bf16", 100), (4, "fp32", 100), (1, "bf16", 10**9)])
def test_every_strategy_s_estimate_is_the_ledger_of_its_run(tmp_path, world: int, dtype: str, max_in_cpu: int) -> None:
    """max_in_cpu: parameter shards offloaded to nvme go there (100 elements) or stay in host memory."""
    from zerodp.plan.model_states import model_states

    for key in ("offload_optimizer", "offload_param"):
        (tmp_path / key).mkdir()
    for rank, runs in enumerate(run_ranks(_ledgers, world, args=(dtype, str(tmp_path), max_in_cpu))):
        for strategy, held in runs:
            predicted = model_states(NUMEL, world, strategy, rank=rank, param_max_in_cpu=max_in_cpu).held
            measured = {(category, tier): b for category, tiers in held.items() for tier, b in tiers.items()}
            assert predicted == measured, (rank, strategy)


def test_the_zero_paper_s_figure_1() -> None:
    """7.5B parameters, Adam, mixed precision, 64 ranks: 120 / 31.4 / 16.6 / 1.9 GB per rank."""
    from zerodp.plan.model_states import StrategySpec as Strategy, model_states

    gb = [model_states(7_500_000_000, 64, Strategy(stage)).bytes() / 1e9 for stage in range(4)]
    assert [round(g, 1) for g in gb] == [120.0, 31.4, 16.6, 1.9]


def test_deepspeed_s_estimator_figures_and_why_they_differ() -> None:
    """DeepSpeed (8 nodes x 8 GPUs, 7.5B): ZeRO-2 15.93 GB (GiB), 13.97 with CPU offload; ZeRO-3 2.71
    with a 200M largest layer. zerodp's figures count model states only: DeepSpeed adds the step's
    fp32 gradient copy (4Ψ/N) and, at stage 3, 4 bytes per element of the largest layer."""
    from zerodp.plan.model_states import StrategySpec as Strategy, deepspeed_estimate, model_states

    gib, psi = 2**30, 7_500_000_000
    assert round(deepspeed_estimate(psi, 64, Strategy(2)) / gib, 2) == 15.93
    assert round(deepspeed_estimate(psi, 64, Strategy(2, "cpu")) / gib, 2) == 13.97
    assert round(deepspeed_estimate(psi, 64, Strategy(3), largest_layer=200_000_000) / gib, 2) == 2.71
    ours = model_states(psi, 64, Strategy(2)).bytes(tier="device")
    assert deepspeed_estimate(psi, 64, Strategy(2)) - ours == 4 * psi // 64 - 4  # zerodp counts Adam's 4-byte step


def test_the_command_prints_every_strategy_and_json_holds_the_named_fields(capsys) -> None:
    from zerodp.cli import main

    assert main(["estimate", "--params", "7.5e9", "--world-size", "64"]) == 0
    table = capsys.readouterr().out
    assert "stage 3, offload optimizer -> nvme, params -> nvme" in table and "DeepSpeed" in table
    assert main(["estimate", "--params", "7.5e9", "--world-size", "64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 16
    for row in rows:
        assert {"stage", "offload_optimizer", "offload_param", "activation_checkpointing", "dtype", "world_size",
                "model_states_bytes", "peak_bytes", "host_bytes"} <= row.keys()
    by = {(r["stage"], r["offload_optimizer"], r["offload_param"]): r for r in rows}
    assert by[(0, "none", "none")]["model_states_bytes"] == 16 * 7_500_000_000 + 4  # + Adam's step
    assert by[(3, "cpu", "cpu")]["model_states_bytes"] == 0 and by[(3, "cpu", "cpu")]["host_bytes"] > 0
    assert all(r["peak_bytes"] is None for r in rows)  # from a parameter count: no activations to add
    for spelled in ("1.3B", "1.3e9", "1300M", "1300000000"):  # exact, not a float's 1299999999
        assert main(["estimate", "--params", spelled]) == 0
        assert "1,300,000,000 trainable parameters" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["estimate", "--params", "lots"], "--params 'lots': expected a number of parameters such as 7.5e9 or 7B"),
    (["estimate", "--params", "1e9", "--world-size", "0"], "--world-size 0: expected a positive number of ranks"),
    (["estimate"], "give MODEL (demo, gpt:..., a Hugging Face config, module:function) or --params N"),
    (["estimate", "demo", "--params", "7B"], "give either MODEL or --params, not both"),
    (["estimate", "no_such_thing"], "MODEL 'no_such_thing': expected demo, gpt:KEY=VALUE,..., a Hugging Face config"),
    (["estimate", "os:getcwd"], "MODEL 'os:getcwd': getcwd() returned a str, not an nn.Module"),
])
def test_bad_arguments_are_named(capsys, argv: list[str], message: str) -> None:
    from zerodp.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def _demo_ledgers(rank: int, world: int, nvme_dir: str, persistence: int) -> list:
    import zerodp
    from zerodp.demo import DEMO_DEFAULT, TinyGPT
    from zerodp.plan.model_states import every_strategy

    out = []
    for s in every_strategy("bf16"):
        zero: dict = {"stage": s.stage, "stage3_param_persistence_threshold": persistence}
        for key, device in (("offload_optimizer", s.offload_optimizer), ("offload_param", s.offload_param)):
            if device != "none":
                zero[key] = {"device": device, **({"nvme_path": f"{nvme_dir}/{key}"} if device == "nvme" else {})}
        if s.offload_param == "nvme":  # the first units' shards stay in host memory, the rest go to nvme
            zero["offload_param"]["max_in_cpu"] = 100_000
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": zero, "bf16": {"enabled": True}}
        torch.manual_seed(0)
        engine, *_ = zerodp.initialize(model=TinyGPT(DEMO_DEFAULT), config=config)
        idx = torch.randint(0, DEMO_DEFAULT.vocab_size, (1, DEMO_DEFAULT.seq_len))
        engine.backward(engine(idx, idx))
        engine.step()
        out.append((s, engine.memory_report()["held"]))
    return out


@pytest.mark.parametrize("persistence", [100_000, 0])
def test_a_model_built_on_the_meta_device_is_estimated_as_its_ledger(tmp_path, persistence: int) -> None:
    """The demo GPT (embeddings, 4 blocks, a tied head), every strategy at 2 ranks: the estimate from a
    meta-device copy equals each rank's ledger. At DeepSpeed's default persistence threshold every one
    of its parameters (at most 65,536 elements) stays whole at stage 3; at 0 the blocks are units."""
    from zerodp.demo import DEMO_DEFAULT, TinyGPT
    from zerodp.plan.model_states import buffer_bytes, flat_states, module_flats

    with torch.device("meta"):
        model = TinyGPT(DEMO_DEFAULT)
    for key in ("offload_optimizer", "offload_param"):
        (tmp_path / key).mkdir()
    for rank, runs in enumerate(run_ranks(_demo_ledgers, 2, args=(str(tmp_path), persistence))):
        for strategy, held in runs:
            flats = module_flats(model, strategy.stage, 2, persistence, offload_param=strategy.offload_param)
            predicted = flat_states(flats, 2, strategy, rank=rank, param_max_in_cpu=100_000,
                                    buffer_bytes=buffer_bytes(model)).held
            measured = {(category, tier): b for category, tiers in held.items() for tier, b in tiers.items()}
            assert predicted == measured, (rank, strategy)


def one_tensor() -> torch.nn.Module:
    """For `zerodp estimate tests.test_estimate:one_tensor`."""
    return _OneTensor()


def test_models_from_the_demo_a_hugging_face_config_and_a_function(tmp_path, capsys) -> None:
    """Built on the meta device, no weights read; each estimate is that of the model's own flats."""
    import transformers

    from zerodp.cli import main
    from zerodp.plan.model_states import StrategySpec as Strategy, model_states

    assert main(["estimate", "tests.test_estimate:one_tensor", "--world-size", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for row in rows:  # one tensor: one flat group, as from the count, below stage 3
        s = Strategy(row["stage"], row["offload_optimizer"], row["offload_param"])
        if s.stage < 3:
            assert row["model_states_bytes"] == model_states(NUMEL, 4, s).bytes("device"), s
        elif s == Strategy(3):  # under the persistence threshold (1e5): kept whole, 2 x 1004 padded
            assert row["by_category"]["param16 (device)"] == 2 * 1004
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    config.save_pretrained(tmp_path)
    numel = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        assert main(["estimate", model, "--world-size", "8", "--model-states-only"]) == 0
        assert f"{numel:,} trainable parameters" in capsys.readouterr().out
    assert main(["estimate", "demo", "--model-states-only"]) == 0
    assert "demo: 805,632 trainable parameters" in capsys.readouterr().out
    assert main(["estimate", "demo", "--model-states-only", "--seq-len", "8"]) == 2
    assert "--model-states-only skips the step" in capsys.readouterr().err


def _start_demo(rank: int, world: int, stage: int) -> str:
    import zerodp
    from zerodp.demo import DEMO_DEFAULT, TinyGPT

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}
    try:
        engine, *_ = zerodp.initialize(model=TinyGPT(DEMO_DEFAULT), config=config)
    except ValueError as err:  # PreflightError is one
        return f"{type(err).__name__}: {err}"
    return f"started, {engine.memory_report()['model_states']} bytes of model states"


def test_the_preflight_refuses_model_states_over_the_limit_on_every_rank_and_names_what_fits() -> None:
    """The demo GPT at stage 0 holds 12.89 MB of model states per rank (bf16, Adam): refused under a
    5 MB limit, with the strategies that fit; started under 20 MB, or with the preflight switched off."""
    limited = run_ranks(_start_demo, 2, args=(0,), env={"ZERODP_DEVICE_MEMORY_LIMIT": "5MB"})
    assert limited[0] == limited[1]  # the same error on each rank, from no communication
    assert limited[0].startswith("PreflightError: initialize() refused to start: the model states alone need 12.89 MB per rank "
                                 "on the device at stage 0 (2 ranks, bf16), more than the 5.00 MB of "
                                 "$ZERODP_DEVICE_MEMORY_LIMIT=5MB")
    assert "Strategies whose model states fit: stage 1, offload optimizer -> cpu (3.22 MB)" in limited[0]
    for env in ({"ZERODP_DEVICE_MEMORY_LIMIT": "20MB"}, {"ZERODP_DEVICE_MEMORY_LIMIT": "5MB", "ZERODP_PREFLIGHT": "0"}):
        assert all(r.startswith("started") for r in run_ranks(_start_demo, 2, args=(0,), env=env)), env
    refused = run_ranks(_start_demo, 2, args=(0,), env={"ZERODP_DEVICE_MEMORY_LIMIT": "lots"})
    assert "$ZERODP_DEVICE_MEMORY_LIMIT 'lots': expected a size such as 5GB" in refused[0]

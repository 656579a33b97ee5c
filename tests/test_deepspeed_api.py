"""The rest of DeepSpeed's public API that scripts and DeepSpeed's own test harness use (issue 34):
`deepspeed.comm.destroy_process_group`, `utils.RepeatingLoader`, `OnDevice`, `runtime.config.DeepSpeedConfig`,
the ZeRO config classes, the lr_schedules constants, `accelerator.is_current_accelerator_supported`,
`git_version_info`, `runtime.zero.unwrap_model_for_generation`, `engine.tput_timer`'s epoch counter, the
`torch_autocast` section and `engine.compile()` / the `compile` section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import _zerodp_as_deepspeed as switch
from tests.harness import run_ranks
from tests.models import batch, make_block_lm, make_model, train_steps, train_with_ddp, two_groups
from zerodp.compat import deepspeed as ds
from zerodp.compat.deepspeed.runtime import lr_schedules
from zerodp.compat.deepspeed.runtime.config import DeepSpeedConfig
from zerodp.compat.deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from zerodp.compat.deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                                 DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum)

REPO = Path(__file__).resolve().parent.parent
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)


def test_every_new_name_imports_under_deepspeed_s_paths() -> None:
    code = """
        import deepspeed, torch
        from deepspeed.comm import destroy_process_group
        from deepspeed.utils import RepeatingLoader, OnDevice
        from deepspeed.runtime.dataloader import RepeatingLoader as R2
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
        from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig, DeepSpeedZeroOffloadOptimizerConfig, OffloadDeviceEnum
        from deepspeed.runtime.lr_schedules import WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE, LR_RANGE_TEST_MIN_LR, CYCLE_MAX_LR
        from deepspeed.accelerator import is_current_accelerator_supported
        from deepspeed.git_version_info import version, git_hash, git_branch, torch_info, installed_ops, compatible_ops
        from deepspeed.runtime.zero import unwrap_model_for_generation
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation as u2
        assert deepspeed.OnDevice is OnDevice and R2 is RepeatingLoader and u2 is unwrap_model_for_generation
        print(version == deepspeed.__version__, is_current_accelerator_supported(), ZeroStageEnum.weights == 3)
    """
    environ = {**os.environ, switch.ENV_VAR: "1"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True"]


# --- deepspeed.comm.destroy_process_group -----------------------------------------------------------

def _destroy_and_init_again(rank: int, world: int, init_file: str) -> tuple:
    from zerodp.compat.deepspeed import comm as dist

    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    gone = dist.is_initialized()
    with pytest.raises(RuntimeError, match="there is no process group to destroy"):
        dist.destroy_process_group()
    dist.init_distributed("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    total = torch.ones(1)
    dist.all_reduce(total)
    alone = dist.new_group([rank for rank in range(world)][:1])  # every rank creates it; rank 0 is in it
    own = torch.ones(1)
    if rank == 0:
        dist.all_reduce(own, group=alone)
    return gone, total.item(), own.item()


def test_destroy_process_group_ends_the_group_and_a_new_one_can_start(tmp_path: Path) -> None:
    results = run_ranks(_destroy_and_init_again, 2, args=(str(tmp_path / "again"),), timeout=120)
    assert results == [(False, 2.0, 1.0), (False, 2.0, 1.0)]  # new_group([0]): rank 0 sums with itself


# --- utils: RepeatingLoader, OnDevice ----------------------------------------------------------------

def test_repeating_loader_starts_over_and_names_an_empty_loader() -> None:
    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=2)
    repeating = ds.utils.RepeatingLoader(loader)
    assert iter(repeating) is repeating
    assert [next(repeating).tolist() for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]
    with pytest.raises(ValueError, match="the loader yields no batch at all"):
        next(ds.utils.RepeatingLoader([]))


def test_on_device_builds_a_module_on_the_meta_device_in_the_dtype_and_restores_torch_s_defaults() -> None:
    with ds.OnDevice(dtype=torch.bfloat16, device="meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        kept = torch.zeros(2, device="cpu", dtype=torch.float32)  # explicit device and dtype are kept
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
    assert (kept.device.type, kept.dtype) == ("cpu", torch.float32)
    assert torch.get_default_dtype() == torch.float32 and torch.empty(1).device.type == "cpu"
    with ds.OnDevice(dtype=torch.float16, device="meta", enabled=False):
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    with pytest.raises(ValueError, match="expected a floating-point torch.dtype"):
        ds.OnDevice(dtype=torch.int64)


# --- config classes and constants --------------------------------------------------------------------

class _Mpu:
    def get_data_parallel_world_size(self) -> int:
        return 4


def test_deepspeed_config_resolves_a_dict_or_a_file_as_deepspeed_does(tmp_path: Path) -> None:
    raw = {"train_batch_size": 32, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR", "params": {lr_schedules.WARMUP_NUM_STEPS: 10}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    config = DeepSpeedConfig(raw)  # no process group: world size 1
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
            config.world_size) == (32, 16, 2, 1)
    assert (config.zero_optimization_stage, config.zero_enabled, config.bfloat16_enabled, config.fp16_enabled,
            config.bfloat16_config.enabled) == (3, True, True, False, True)
    assert config.zero_config.offload_param.device == OffloadDeviceEnum.cpu
    assert (config.optimizer_name, config.optimizer_params, config.scheduler_name) == ("adamw", {"lr": 1e-3}, "WarmupLR")
    assert config._param_dict == raw and config.torch_autocast_dtype is None and config.communication_data_type is None
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    from_file = DeepSpeedConfig(str(path), mpu=_Mpu())  # the mpu's data-parallel size
    assert (from_file.world_size, from_file.train_micro_batch_size_per_gpu) == (4, 4)
    with pytest.raises(ds.DeepSpeedConfigError, match="zero_optimisation"):
        DeepSpeedConfig({"train_batch_size": 2, "zero_optimisation": {"stage": 2}})


def test_zero_config_classes_validate_the_section_with_deepspeed_s_defaults() -> None:
    zero = DeepSpeedZeroConfig(**{"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}})
    assert (zero.stage, zero.reduce_bucket_size, zero.offload_param) == (2, 500_000_000, None)
    assert zero.offload_optimizer.device == OffloadDeviceEnum.cpu and not zero.offload_optimizer.pin_memory
    assert DeepSpeedZeroOffloadParamConfig(device="nvme", nvme_path="/x").buffer_count == 5
    assert DeepSpeedZeroOffloadOptimizerConfig().device == OffloadDeviceEnum.none
    with pytest.raises(ValueError, match="stag"):
        DeepSpeedZeroConfig(**{"stag": 3})


def test_lr_schedule_constants_name_the_scheduler_parameters() -> None:
    params = {lr_schedules.WARMUP_MIN_LR: 0.0, lr_schedules.WARMUP_MAX_LR: 1e-2, lr_schedules.WARMUP_NUM_STEPS: 4,
              lr_schedules.WARMUP_TYPE: lr_schedules.WARMUP_LINEAR_RATE}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    scheduler = lr_schedules.WarmupLR(optimizer, **params)
    for _ in range(2):
        scheduler.step()
    assert scheduler.get_last_lr() == [pytest.approx(1e-2 * 1 / 4)]  # iteration 1 of a 4-step linear warmup
    assert (lr_schedules.LR_RANGE_TEST_STEP_SIZE, lr_schedules.CYCLE_MIN_MOM, lr_schedules.TOTAL_NUM_STEPS) == (
        "lr_range_test_step_size", "cycle_min_mom", "total_num_steps")


def test_accelerator_support_and_git_version_info() -> None:
    from zerodp.compat.deepspeed import git_version_info as info

    assert ds.accelerator.is_current_accelerator_supported()
    assert info.version == ds.__version__ and (info.git_hash, info.git_branch) == ("[none]", "[none]")
    assert info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert info.torch_info["cuda_version"] == (torch.version.cuda or "0.0")
    assert info.installed_ops["cpu_adam"] and info.compatible_ops["fused_adam"] and not info.installed_ops["async_io"]


# --- unwrap_model_for_generation -----------------------------------------------------------------

def _generate_unwrapped(rank: int, world: int) -> tuple:
    import zerodp
    from zerodp.compat.deepspeed.runtime.zero import unwrap_model_for_generation

    full = make_block_lm()
    expected = full(batch(0, 0, 0)[0], None)
    model = make_block_lm()
    engine, *_ = zerodp.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                   config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
                                       "stage": 3, "stage3_param_persistence_threshold": 0}})
    sharded = model.blocks[1].fc1.weight.numel()
    with torch.no_grad(), unwrap_model_for_generation(engine) as unwrapped:
        shapes_inside = model.blocks[1].fc1.weight.shape
        logits = unwrapped.module(batch(0, 0, 0)[0], None)
    return sharded, tuple(shapes_inside), model.blocks[1].fc1.weight.numel(), torch.equal(logits, expected)


def test_unwrap_model_for_generation_holds_every_stage3_parameter_for_the_block() -> None:
    for sharded, inside, after, equal in run_ranks(_generate_unwrapped, 2, timeout=120):
        assert sharded == 0 and inside == (32, 16) and after == 0 and equal


# --- tput_timer ----------------------------------------------------------------------------------

def _epochs(rank: int, world: int) -> tuple:
    import zerodp

    model = make_model()
    engine, *_ = zerodp.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                   config={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    train_steps(engine, rank, range(2))
    before = (engine.tput_timer.epoch_count, engine.tput_timer.micro_step_count, engine.tput_timer.global_step_count)
    engine.tput_timer.update_epoch_count()  # DeepSpeed-Chat step 1, at the end of each epoch
    train_steps(engine, rank, range(2, 3))
    return before, (engine.tput_timer.epoch_count, engine.tput_timer.micro_step_count,
                    engine.tput_timer.global_step_count), engine.tput_timer.avg_samples_per_sec() > 0


def test_tput_timer_counts_epochs_and_the_micro_steps_of_the_current_epoch() -> None:
    assert run_ranks(_epochs, 1, timeout=120) == [((0, 4, 2), (1, 2, 3), True)]


# --- torch_autocast ([Note: torch_autocast]) -------------------------------------------------------

def _autocasted_forward(model: torch.nn.Module) -> torch.nn.Module:
    """`model` whose forward runs under torch.autocast(cpu, bf16): the plain-PyTorch reference."""
    inner = model.forward

    def forward(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return inner(*args, **kwargs)

    model.forward = forward
    return model


def _autocast_parity(rank: int, world: int, stage: int, gas: int) -> tuple:
    import zerodp

    reference = _autocasted_forward(make_model())
    ref_losses, ref_params = train_with_ddp(reference, torch.optim.AdamW(two_groups(reference), **ADAMW), rank, 3, gas,
                                            100.0)
    model = make_model()
    engine, *_ = zerodp.initialize(model=model, model_parameters=two_groups(model),
                                   optimizer=lambda groups: torch.optim.AdamW(groups, **ADAMW),
                                   config={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
                                           "gradient_clipping": 100.0, "zero_optimization": {"stage": stage},
                                           "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}})
    losses = train_steps(engine, rank, range(3), gas)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses == ref_losses, all(torch.equal(params[n], ref_params[n]) for n in ref_params), \
        {p.dtype for p in model.parameters()}


@pytest.mark.parametrize("stage,gas", [(0, 2), (2, 1)])  # the accumulations DDP parity holds bitwise at (test_parity)
def test_torch_autocast_trains_as_plain_torch_autocast_bitwise_with_fp32_parameters(stage: int, gas: int) -> None:
    # before: "torch_autocast.enabled: true is not supported by zerodp"
    for same_losses, same_params, dtypes in run_ranks(_autocast_parity, 2, args=(stage, gas), timeout=180):
        assert same_losses and same_params and dtypes == {torch.float32}


def _outer_autocast(rank: int, world: int) -> bool:
    import zerodp

    model = make_model()
    engine, *_ = zerodp.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                   config={"train_micro_batch_size_per_gpu": 4})
    idx, targets = batch(rank, 0, 0)
    with torch.no_grad():
        plain = model(idx, targets)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outer = engine(idx, targets)
    return torch.equal(plain, outer)


def test_an_outer_autocast_is_switched_off_inside_the_forward_when_the_section_is_off() -> None:
    assert run_ranks(_outer_autocast, 1, timeout=120) == [True]  # as DeepSpeed: the config decides


@pytest.mark.parametrize("section,match", [
    ({"enabled": True, "dtype": "fp16"}, r'torch_autocast.dtype: "fp16"; zerodp autocasts to bf16 only'),
    ({"enabled": True}, r"torch_autocast.dtype: unset \(torch's default for the device: float16 on CUDA\)"),
])
def test_torch_autocast_without_bf16_is_refused_naming_what_to_use(section: dict, match: str) -> None:
    from zerodp.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config({"train_micro_batch_size_per_gpu": 1, "torch_autocast": section}, world_size=1)


def test_lower_precision_safe_modules_must_name_module_classes() -> None:
    from zerodp.config import load_config
    from zerodp.forward_policy import ForwardPolicy

    def policy(names: list[str]) -> ForwardPolicy:
        cfg = load_config({"train_micro_batch_size_per_gpu": 1, "torch_autocast": {
            "enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": names}}, world_size=1)
        return ForwardPolicy(cfg, torch.nn.Linear(2, 2), torch.device("cpu"))

    assert policy(["torch.nn.Linear", "torch.nn.Conv2d"]).lower_precision_safe_classes == [torch.nn.Linear,
                                                                                            torch.nn.Conv2d]
    with pytest.raises(ValueError, match=r"'torch.nn.Lineer' does not import"):
        policy(["torch.nn.Lineer"])
    with pytest.raises(ValueError, match=r"'torch.nn.functional.relu' is not an nn.Module class"):
        policy(["torch.nn.functional.relu"])


# --- compile ([Note: compiling at stage 3]) --------------------------------------------------------

def _compiled(rank: int, world: int, stage: int, how: str) -> tuple:
    import zerodp

    graphs = []

    def counting(gm, example_inputs):  # a dynamo backend that runs the graph as traced
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.register_backend(name="zerodp_test_counting", compiler_fn=counting)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if how == "config":
        config["compile"] = {"disable": False, "backend": "zerodp_test_counting", "kwargs": {"dynamic": False}}
    model = make_block_lm()
    engine, *_ = zerodp.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   config=config)
    if how == "call":
        engine.compile(backend="zerodp_test_counting")
        engine.compile(backend="zerodp_test_counting")  # a second call changes nothing
    ops = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    return train_steps(engine, rank, range(2)), len(graphs), engine.is_compiled, ops


@pytest.mark.parametrize("stage,how", [(0, "call"), (3, "call"), (2, "config")])
def test_the_compiled_module_is_what_runs_and_trains_as_the_eager_one(stage: int, how: str) -> None:
    eager = run_ranks(_compiled, 2, args=(stage, "eager"), timeout=240)
    compiled = run_ranks(_compiled, 2, args=(stage, how), timeout=240)
    for (eager_losses, no_graphs, not_compiled, _), (losses, num_graphs, is_compiled, ops) in zip(eager, compiled):
        assert no_graphs == 0 and not not_compiled
        assert num_graphs >= 1 and is_compiled and losses == eager_losses
        # the model's compute only: stage 3's hooks (buffers made, parameters swapped) run eagerly
        assert not [op for op in ops if "empty" in op or "setattr" in op.lower() or "tensor" in op], ops


def test_compile_refuses_deepcompile_schedules_and_unknown_section_keys() -> None:
    from zerodp.config import ConfigError, load_config
    from zerodp.forward_policy import ForwardPolicy

    cfg = load_config({"train_micro_batch_size_per_gpu": 1}, world_size=1)
    policy = ForwardPolicy(cfg, torch.nn.Linear(2, 2), torch.device("cpu"))
    with pytest.raises(NotImplementedError, match=r"engine.compile\(schedule=...\): DeepCompile schedules"):
        policy.compile("eager", schedule=[(0, [])])
    with pytest.raises(NotImplementedError, match="compiled_autograd_enabled=True"):
        policy.compile("eager", compiled_autograd_enabled=True)
    assert not policy.is_compiled
    with pytest.raises(ConfigError, match=r"compile.backnd: not a key of the compile section.*did you mean 'backend'"):
        load_config({"train_micro_batch_size_per_gpu": 1, "compile": {"backnd": "eager"}}, world_size=1)
    with pytest.raises(ConfigError, match=r"compile.deepcompile: true is not supported by zerodp"):
        load_config({"train_micro_batch_size_per_gpu": 1, "compile": {"deepcompile": True}}, world_size=1)
    # DeepCompile's other keys are DeepSpeed's and act only with deepcompile: accepted
    assert load_config({"train_micro_batch_size_per_gpu": 1, "compile": {"free_activation": True}},
                       world_size=1).compile == {"free_activation": True}

"""The DeepSpeed drop-in: ZERODP_AS_DEEPSPEED=1 makes `import deepspeed` zerodp.compat.deepspeed.

Three layers: the switch itself (subprocesses with and without the variable, with and without a
`deepspeed` distribution already installed), the compatibility surface (in process), and DeepSpeed-style
scripts launched by `zerodp deepspeed` / `zerodp run`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import _zerodp_as_deepspeed as switch
from tests.harness import json_objects, run_ranks
from tests.models import batch, make_model, train_steps, two_groups
from zerodp.compat import deepspeed as ds
from zerodp.launcher import deepspeed_torchrun_argv, hostfile_slots

REPO = Path(__file__).resolve().parent.parent


def _python(code: str, env: dict | None = None, cwd: Path | None = None, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != switch.ENV_VAR}
    environ.update(env or {})
    if pythonpath:
        environ["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=120)


# --- the switch ---------------------------------------------------------------------------------

def test_the_switch_makes_import_deepspeed_zerodp_and_reports_a_deepspeed_distribution() -> None:
    out = _python("""
        import importlib.metadata, importlib.util, deepspeed, zerodp
        from deepspeed.ops.adam import FusedAdam
        import deepspeed.runtime.zero.partition_parameters as pp
        from transformers.integrations.deepspeed import is_deepspeed_available
        assert deepspeed.initialize.__wrapped__ is zerodp.initialize and deepspeed.zero.Init is zerodp.zero.Init
        assert pp is deepspeed.runtime.zero.partition_parameters  # one module object under both names
        assert importlib.util.find_spec("deepspeed") is not None and is_deepspeed_available()
        print(importlib.metadata.version("deepspeed"), deepspeed.__version__, importlib.metadata.metadata("deepspeed")["Name"])
    """, env={switch.ENV_VAR: "1"})
    assert out.returncode == 0, out.stderr
    zerodp_version = __import__("importlib.metadata").metadata.version("zerodp")
    assert out.stdout.split() == [f"0.20.2+zerodp.{zerodp_version}"] * 2 + ["deepspeed"]


def test_without_the_switch_deepspeed_is_whatever_is_installed(tmp_path: Path) -> None:
    missing = _python("import deepspeed")
    assert missing.returncode != 0 and "No module named 'deepspeed'" in missing.stderr
    # a stand-in for a real DeepSpeed install: a package and its dist-info on the path
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "deepspeed-0.18.0.dist-info").mkdir()
    (tmp_path / "deepspeed-0.18.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.18.0\n")
    probe = "import importlib.metadata, deepspeed; print(getattr(deepspeed, 'REAL', False), importlib.metadata.version('deepspeed'))"
    real = _python(probe, pythonpath=str(tmp_path))
    assert real.stdout.split() == ["True", "0.18.0"], real.stderr
    for off in ("0", "false", ""):
        assert _python(probe, env={switch.ENV_VAR: off}, pythonpath=str(tmp_path)).stdout.split() == ["True", "0.18.0"]
    zerodp = _python(probe, env={switch.ENV_VAR: "1"}, pythonpath=f"{tmp_path}{os.pathsep}{REPO}")
    assert zerodp.stdout.split()[0] == "False" and zerodp.stdout.split()[1].startswith("0.20.2+zerodp."), zerodp.stderr


def test_an_unknown_switch_value_is_named_and_changes_nothing() -> None:
    out = _python("import deepspeed", env={switch.ENV_VAR: "maybe"})
    assert out.returncode != 0
    assert "ZERODP_AS_DEEPSPEED='maybe' is not understood (use 1 to switch it on, 0 for off)" in out.stderr


def test_what_zerodp_lacks_is_named_as_deepspeed_s_path() -> None:
    out = _python("""
        import deepspeed
        for stmt in ("from deepspeed.utils import nvtx", "import deepspeed.inference",
                     "import deepspeed.runtime.sequence_parallel.ulysses_sp_v2",
                     "deepspeed.PipelineModule", "deepspeed.ops.lion", "deepspeed.get_accelerator().lazy_call"):
            try:
                exec(stmt)
            except (ImportError, AttributeError) as err:
                print(type(err).__mro__[1].__name__, str(err).split(":")[0])
        print(hasattr(deepspeed, "PipelineModule"), hasattr(deepspeed.ops, "adam"))
    """, env={switch.ENV_VAR: "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "ModuleNotFoundError deepspeed.utils.nvtx is not provided by zerodp",
        "ModuleNotFoundError deepspeed.inference is not provided by zerodp",
        "ModuleNotFoundError deepspeed.runtime.sequence_parallel.ulysses_sp_v2 is not provided by zerodp",
        "AttributeError deepspeed.PipelineModule is not provided by zerodp",
        "AttributeError deepspeed.ops.lion is not provided by zerodp",
        "AttributeError deepspeed.accelerator.get_accelerator().lazy_call is not provided by zerodp",
        "False True",
    ]


def test_the_pth_file_ships_in_the_wheel(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(REPO)], check=True, capture_output=True, timeout=300)
    import zipfile

    (wheel,) = tmp_path.glob("zerodp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "zerodp_as_deepspeed.pth" in names and "_zerodp_as_deepspeed.py" in names
    assert "zerodp/compat/deepspeed/runtime/zero/partition_parameters.py" in names


# --- the surface, in process -------------------------------------------------------------------

def test_fused_adam_and_cpu_adam_are_torch_s_fused_adam_with_deepspeed_s_arguments() -> None:
    def run(make):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(37))
        opt = make([p])
        for _ in range(3):
            p.grad = torch.sin(p.detach() * 3)
            opt.step()
        return p.detach()

    adamw = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True))
    adam_l2 = run(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, fused=True))
    assert torch.equal(run(lambda ps: ds.ops.adam.FusedAdam(ps, lr=1e-2, weight_decay=0.1)), adamw)
    assert torch.equal(run(lambda ps: ds.ops.adam.FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False)), adam_l2)
    assert torch.equal(run(lambda ps: ds.ops.adam.DeepSpeedCPUAdam(ps, lr=1e-2, weight_decay=0.1)), adamw)
    assert torch.equal(run(lambda ps: ds.ops.adam.DeepSpeedCPUAdam(ps, lr=1e-2, weight_decay=0.1, adamw_mode=False)), adam_l2)
    with pytest.raises(ValueError, match=r"FusedAdam\(bias_correction=False\) is not supported by zerodp"):
        ds.ops.adam.FusedAdam([torch.nn.Parameter(torch.ones(2))], bias_correction=False)
    with pytest.raises(ValueError, match=r"DeepSpeedCPUAdam\(fp32_optimizer_states=False\)"):
        ds.ops.adam.DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(2))], fp32_optimizer_states=False)


def _train_with(rank: int, world: int, stage: int, optimizer_name: str, offload: bool) -> list[float]:
    import zerodp
    from zerodp.compat.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    make = {"FusedAdam": lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.1),
            "DeepSpeedCPUAdam": lambda g: DeepSpeedCPUAdam(g, lr=1e-2, weight_decay=0.1),
            "AdamW": lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1, fused=True)}[optimizer_name]
    model = make_model()
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    engine, *_ = zerodp.initialize(model=model, optimizer=make(two_groups(model)),
                                   config={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                           "zero_optimization": zero})
    return train_steps(engine, rank, range(3))


@pytest.mark.parametrize("stage,optimizer_name,offload", [(0, "FusedAdam", False), (1, "FusedAdam", False),
                                                           (2, "DeepSpeedCPUAdam", True), (3, "FusedAdam", False)])
def test_deepspeed_s_adam_classes_train_at_every_stage_as_torch_s_fused_adamw(stage: int, optimizer_name: str,
                                                                              offload: bool) -> None:
    # before: stages 1-3 refused FusedAdam by class name ("cannot run on ZeRO stage 1's owned shards")
    theirs = run_ranks(_train_with, 2, args=(stage, optimizer_name, offload))
    torchs = run_ranks(_train_with, 2, args=(stage, "AdamW", offload))
    assert theirs == torchs


def test_accelerator_on_the_cpu() -> None:
    acc = ds.get_accelerator()
    assert acc is ds.accelerator.get_accelerator()
    assert (acc.device_name(), acc.current_device_name(), acc.communication_backend_name()) == ("cpu", "cpu", "gloo")
    assert acc.is_available() and acc.is_bf16_supported()
    acc.reset_peak_memory_stats()
    held = torch.ones(16 * 2**20 // 4)  # 16 MiB, touched
    assert acc.max_memory_allocated() >= acc.memory_allocated() >= held.numel() * 4
    acc.manual_seed(3)
    first = torch.rand(2)
    acc.manual_seed_all(3)
    assert torch.equal(torch.rand(2), first)
    acc.synchronize(), acc.empty_cache()


def test_small_utilities_behave_as_deepspeed_s() -> None:
    model = make_model()
    assert ds.compression.helper.recursive_getattr(model, "fc1.weight") is model.fc1.weight
    ds.utils.module_utils.recursive_setattr(model, "fc1", torch.nn.Identity())
    assert isinstance(model.fc1, torch.nn.Identity)
    base = torch.arange(10.0)
    cloned = ds.checkpoint.utils.clone_tensors_for_torch_save({"a": [base[2:4]], "b": 1})
    assert cloned["b"] == 1 and torch.equal(cloned["a"][0], base[2:4])
    assert cloned["a"][0].untyped_storage().nbytes() == 8  # its own two elements, not the view's storage
    groups = two_groups(make_model())
    assert ds.moe.utils.split_params_into_different_moe_groups_for_optimizer(tuple(groups)) == groups
    expert = torch.nn.Parameter(torch.ones(2))
    expert.allreduce = False
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        ds.moe.utils.split_params_into_different_moe_groups_for_optimizer({"params": [expert]})
    pp = ds.runtime.zero.partition_parameters
    ones = pp.zero_wrapper_for_fp_tensor_constructor(pp._orig_torch_ones, torch.bfloat16, torch.device("cpu"))(3)
    assert ones.dtype == torch.bfloat16 and pp.ZeroParamStatus.NOT_AVAILABLE.value == 2
    assert ds.runtime.lr_schedules.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
                                                          "WarmupCosineLR"]
    assert ds.runtime.zero.offload_config.OffloadDeviceEnum("cpu") == "cpu"
    assert isinstance(ds.DeepSpeedEngine, type) and ds.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"


def _zero_to_fp32(rank: int, world: int, ckpt: str) -> None:
    import zerodp

    model = make_model()
    engine, *_ = zerodp.initialize(model=model, config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
                                                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    engine.backward(engine(*batch(rank, 0, 0)))
    engine.step()
    engine.save_checkpoint(ckpt)


def test_zero_to_fp32_reads_a_zerodp_checkpoint(tmp_path: Path) -> None:
    run_ranks(_zero_to_fp32, 2, args=(str(tmp_path / "ckpt"),))
    from zerodp.checkpoint.convert import load_state_dict_from_checkpoint

    z = ds.utils.zero_to_fp32
    expected = load_state_dict_from_checkpoint(tmp_path / "ckpt")
    state = z.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    model = z.load_state_dict_from_zero_checkpoint(make_model(seed=1), tmp_path / "ckpt")
    assert torch.equal(model.fc1.weight, expected["fc1.weight"])
    files = z.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out", safe_serialization=True)
    assert [f.name for f in files] == ["model.safetensors"]
    with pytest.raises(NotImplementedError, match="exclude_frozen_parameters=True"):
        z.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True)


# --- the launcher ------------------------------------------------------------------------------

def test_deepspeed_launcher_flags_map_onto_torchrun(tmp_path: Path) -> None:
    assert deepspeed_torchrun_argv(["--num_gpus", "2", "train.py", "--deepspeed_config", "ds.json"]) == [
        "--standalone", "--nproc-per-node=2", "train.py", "--local_rank=${local_rank}", "--deepspeed_config", "ds.json"]
    assert deepspeed_torchrun_argv(["--no_local_rank", "--master_port", "29600", "t.py"], cuda_devices=4) == [
        "--nproc-per-node=4", "--master-port=29600", "t.py"]
    assert deepspeed_torchrun_argv(["--no_ssh", "--num_nodes", "2", "--node_rank", "1", "--master_addr", "h0", "t.py"]) == [
        "--nproc-per-node=1", "--nnodes=2", "--node-rank=1", "--master-addr=h0", "t.py", "--local_rank=${local_rank}"]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one machine\nlocalhost slots=3\n")
    assert hostfile_slots(str(hostfile)) == [("localhost", 3)]
    assert deepspeed_torchrun_argv(["--hostfile", str(hostfile), "t.py"])[:2] == ["--standalone", "--nproc-per-node=3"]
    hostfile.write_text("a slots=2\nb slots=2\n")
    with pytest.raises(ValueError, match="lists 2 hosts, and zerodp does not ssh into hosts"):
        deepspeed_torchrun_argv(["--hostfile", str(hostfile), "t.py"])
    with pytest.raises(ValueError, match="--num_nodes 2 needs --no_ssh"):
        deepspeed_torchrun_argv(["--num_nodes", "2", "t.py"])
    with pytest.raises(ValueError, match="does not support --bind_cores_to_rank, --include: DeepSpeed-only"):
        deepspeed_torchrun_argv(["--include", "localhost:0", "--bind_cores_to_rank", "t.py"])
    hostfile.write_text("a slots=two\n")
    with pytest.raises(ValueError, match=r"hostfile:1: 'a slots=two' is not a hostfile line"):
        hostfile_slots(str(hostfile))


DEEPSPEED_SCRIPT = '''
"""A DeepSpeed-style script, as DeepSpeed's examples write it (cifar / DeepSpeed-Chat patterns)."""
import argparse, json, subprocess, sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from tests.models import batch, make_model, two_groups

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--offload", action="store_true")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
if args.local_rank != -1:  # DeepSpeed-Chat initialises only when the launcher passed --local_rank
    get_accelerator().set_device(args.local_rank)
    deepspeed.init_distributed()
    assert deepspeed.comm.get_local_rank() == args.local_rank
model = make_model()
adam = DeepSpeedCPUAdam if args.offload else FusedAdam
engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, optimizer=adam(two_groups(model), lr=1e-2))
assert isinstance(engine, deepspeed.DeepSpeedEngine) and isinstance(optimizer, adam)
rank = deepspeed.comm.get_rank()
losses = []
for step in range(3):
    for micro in range(engine.gradient_accumulation_steps()):
        loss = engine(*batch(rank, step, micro))
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 6))
child = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__name__)"], capture_output=True, text=True)
print(json.dumps({"rank": rank, "losses": losses, "child": child.stdout.strip()}))
'''


@pytest.mark.parametrize("launcher,stage,offload", [("deepspeed", 2, True), ("run", 3, False)])
def test_a_deepspeed_script_runs_unchanged_under_zerodp_s_launchers(tmp_path: Path, launcher: str, stage: int,
                                                                   offload: bool) -> None:
    import json

    script = tmp_path / "train.py"
    script.write_text(DEEPSPEED_SCRIPT)
    config = tmp_path / "ds.json"
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                  "zero_optimization": zero}))
    flags = ["--num_gpus", "2"] if launcher == "deepspeed" else ["--nproc-per-node", "2"]
    env = {k: v for k, v in os.environ.items() if k != switch.ENV_VAR}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", "from zerodp.cli import main; raise SystemExit(main())", launcher, *flags, str(script), "--deepspeed_config",
                          str(config), *(["--offload"] if offload else [])],
                         env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    results = sorted((r for r in json_objects(out.stdout) if "rank" in r), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["child"] == "zerodp.compat.deepspeed" for r in results)  # the workers' own children too
    assert all(len(r["losses"]) == 6 for r in results)


def test_no_zerodp_module_imports_the_compatibility_package() -> None:
    # design.md: compat/ is a skin over zerodp; zerodp's own modules never depend on it
    offenders = [str(path.relative_to(REPO)) for path in (REPO / "zerodp").rglob("*.py")
                 if "compat" not in path.relative_to(REPO / "zerodp").parts
                 and ("zerodp.compat" in path.read_text() or "_zerodp_as_deepspeed" in path.read_text())]
    assert offenders == []


def _engine_surface(rank: int, world: int) -> dict:
    import zerodp

    model = make_model()
    model.greeting = lambda: "from the module"
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zerodp.initialize(model=model, config=config)
    for step in range(3):
        engine.backward(engine(*batch(rank, step, 0)))
        engine.step()
    try:
        engine.no_such_thing
    except AttributeError as err:
        missing = str(err)
    full = engine._zero3_consolidated_16bit_state_dict()
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"greeting": engine.greeting(), "fc1": engine.fc1 is model.fc1, "missing": missing,
            "stage": engine.config.get("zero_optimization", {}).get("stage"), "item": engine.config["train_batch_size"],
            "absent": engine.config.get("no_such_key", "default"), "gather_on_save": engine.zero_gather_16bit_weights_on_model_save(),
            "tput": engine.tput_timer.avg_samples_per_sec(), "steps": engine.tput_timer.global_step_count,
            "full_matches": None if full is None else all(torch.equal(full[n], expected[n]) for n in expected),
            "full_keys": None if full is None else sorted(full)}


def test_the_engine_answers_what_deepspeed_s_engine_does() -> None:
    results = run_ranks(_engine_surface, 2)
    for rank, r in enumerate(results):
        assert (r["greeting"], r["fc1"], r["stage"], r["item"], r["absent"], r["gather_on_save"], r["steps"]) == (
            "from the module", True, 3, 8, "default", False, 3)
        assert r["missing"] == "neither the engine nor its module (TiedMLP) has an attribute 'no_such_thing'"
        assert r["tput"] > 0
    assert results[0]["full_matches"] is True and "head.weight" in results[0]["full_keys"]  # tied names kept
    assert results[1]["full_matches"] is None  # None off rank 0, as DeepSpeed


def _init_with_autos(rank: int, world: int, config: dict) -> list[str]:
    import zerodp

    with zerodp.zero.Init(config_dict_or_path=config):
        model = make_model()
    return sorted({str(p._zerodp_init_shard.dtype) for p in model.parameters()})


def test_zero_init_reads_only_the_precision_of_a_config_that_still_holds_autos() -> None:
    # what transformers passes before its Trainer resolves the batch and bucket sizes
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}
    assert run_ranks(_init_with_autos, 2, args=(config,)) == [["torch.bfloat16"]] * 2
    from zerodp.config import ConfigError, precision_of

    assert precision_of({"fp16": {"enabled": True}, "train_batch_size": "auto"}) == "fp16"
    assert precision_of({"bfloat16": {"enabled": True}}) == "bf16" and precision_of({}) == "fp32"
    with pytest.raises(ConfigError, match=r'bf16.enabled: "auto" must be resolved before zero.Init reads the precision'):
        precision_of({"bf16": {"enabled": "auto"}})


def _ds_attributes(rank: int, world: int) -> dict:
    import zerodp
    from zerodp.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    with zerodp.zero.Init(config=config):
        model = make_model()
    w = model.fc1.weight
    at_init = (w.ds_status, w.ds_tensor.numel(), w.ds_shape, hasattr(w, "ds_id"))
    with zerodp.zero.GatheredParameters([w]):
        during = w.ds_status
    engine, *_ = zerodp.initialize(model=model, config=config)
    engine.backward(engine(*batch(rank, 0, 0)))
    engine.step()
    ids = [p.ds_id for p in model.parameters()]
    owned = sum(p.ds_tensor.numel() for p in model.parameters())
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        gathered = {p.ds_status for p in model.parameters()}
    return {"init": at_init, "during": during, "after": {p.ds_status for p in model.parameters()}, "gathered": gathered,
            "unique_ids": len(set(ids)) == len(ids), "owned": owned,
            "total": sum(p.ds_numel for p in model.parameters()), "enum": ZeroParamStatus.AVAILABLE in gathered}


def test_stage_3_parameters_carry_deepspeed_s_attributes() -> None:
    # TRL and DeepSpeed-Chat decide what to gather from ds_id / ds_status
    from zerodp.zero.units import ZeroParamStatus as S

    results = run_ranks(_ds_attributes, 2)
    for r in results:
        assert r["init"] == (S.NOT_AVAILABLE, 16 * 64 // 2, torch.Size([64, 16]), True) and r["during"] is S.AVAILABLE
        assert r["after"] == {S.NOT_AVAILABLE} and r["gathered"] == {S.AVAILABLE} and r["unique_ids"] and r["enum"]
    # the ranks' ds_tensors together hold every element once (padding aside)
    assert sum(r["owned"] for r in results) == results[0]["total"]


class _SavesItsWeight(torch.autograd.Function):
    """A fused head as TRL writes it: saves the weight and reads DeepSpeed's attributes from it in backward."""

    @staticmethod
    def forward(ctx, h, weight):
        ctx.save_for_backward(h, weight)
        return h @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        _SavesItsWeight.seen.append(hasattr(weight, "ds_status"))
        return grad @ weight, grad.flatten(0, -2).t() @ h.flatten(0, -2)


def _counts_and_hooks(rank: int, world: int) -> dict:
    import zerodp

    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    out = {}
    for name, init, extra in (("zerodp", zerodp.initialize, {}), ("deepspeed", ds.initialize, {}),
                              ("breakdown", ds.initialize, {"memory_breakdown": True})):
        model = make_model()
        model.head.forward = lambda h, m=model.head: _SavesItsWeight.apply(h, m.weight)
        engine, *_ = init(model=model, config={**config, **extra})
        _SavesItsWeight.seen = []
        train_steps(engine, rank, range(1), gas=1)
        out[name] = (engine.count_activations, bool(engine.memory_report()["activations"]), _SavesItsWeight.seen)
    # TRL's unwrap_model_for_generation: hold every unit, remove the forward hooks, run, register them again
    model = make_model()
    engine, *_ = ds.initialize(model=model, config=config)
    reference, *_ = zerodp.initialize(model=make_model(), config=config)
    offload = engine.optimizer.parameter_offload
    with ds.zero.GatheredParameters(model.parameters()):
        for hook in offload.forward_hooks:
            hook.remove()
        offload.forward_hooks = []
        with torch.no_grad():
            held = [engine(*batch(rank, 0, 0)).item() for _ in range(2)]
        offload._register_deepspeed_module(offload.module)
    out["hooks"] = (len(offload.forward_hooks) > 0, held[0] == held[1], offload.module.ds_external_parameters())
    out["after"] = train_steps(engine, rank, range(2)) == train_steps(reference, rank, range(2))
    out["released"] = {p.ds_status.name for p in model.parameters()}
    return out


def test_deepspeed_initialize_leaves_saved_tensors_alone_and_trl_can_remove_the_hooks() -> None:
    # saved-tensor hooks (zerodp's activation count) unpack a saved parameter as a plain tensor: TRL's fused LM
    # head then misses ds_status, so engines built through deepspeed.initialize count only with memory_breakdown
    for r in run_ranks(_counts_and_hooks, 2):
        assert r["zerodp"] == (True, True, [False])
        assert r["deepspeed"] == (False, False, [True])
        assert r["breakdown"] == (True, True, [False])
        assert r["hooks"] == (True, True, []) and r["after"] and r["released"] == {"NOT_AVAILABLE"}


def test_parameters_partitioned_by_a_real_deepspeed_are_refused() -> None:
    import zerodp

    model = make_model()
    model.fc1.weight.ds_id = 7  # what DeepSpeed's zero.Init leaves on a parameter
    with pytest.raises(ValueError, match=r"'fc1.weight'\) were partitioned by DeepSpeed's own zero.Init"):
        zerodp.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})


def _comm_calls(rank: int, world: int) -> list[float]:
    from zerodp.compat.deepspeed import comm as dist

    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    b = torch.full((1,), float(rank + 5))
    handle = dist.broadcast(b, src=1, async_op=True)  # DeepSpeed's signature
    handle.wait()
    return [t.tolist(), b.item(), dist.get_local_rank()]


def test_deepspeed_comm_takes_deepspeed_s_arguments() -> None:
    assert run_ranks(_comm_calls, 2) == [[[3.0, 3.0], 6.0, 0], [[3.0, 3.0], 6.0, 1]]

"""What DeepSpeed's own unit-test harness (tests/unit/common.py, simple_model.py) and its config tests
import from `deepspeed`, as zerodp's compatibility package provides it: the pipeline and MoE names
refuse when used, the op builders say which ops exist, config_utils / precision_config behave as
DeepSpeed's, DeepSpeed's internal optimizer classes exist by name only (bench/deepspeed_unit_tests.py
runs DeepSpeed's tests themselves)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from pydantic import Field, ValidationError

from zerodp.compat.deepspeed import ops, pipe
from zerodp.compat.deepspeed.checkpoint.utils import get_model_ckpt_name_for_rank
from zerodp.compat.deepspeed.moe.layer import MoE, MoENotProvided
from zerodp.compat.deepspeed.ops.op_builder import (AsyncIOBuilder, CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder,
                                                    OpBuilderNotProvided)
from zerodp.compat.deepspeed.runtime.config_utils import (DeepSpeedConfigModel, dict_raise_error_on_duplicate_keys,
                                                          get_config_default)
from zerodp.compat.deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from zerodp.compat.deepspeed.runtime.precision_config import DeepSpeedFP16Config, get_bfloat16_config
from zerodp.compat.deepspeed.runtime.zero import leaf_module_config
from zerodp.compat.deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from zerodp.compat.deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from zerodp.compat.deepspeed.utils.torch import required_torch_version
from zerodp.config.schema import LeafModuleConfig


def test_pipeline_classes_import_and_subclass_but_refuse_when_built() -> None:
    class Stack(pipe.PipelineModule):  # a class statement builds nothing: DeepSpeed's simple_model.py does this
        def __init__(self) -> None:
            super().__init__(layers=[pipe.LayerSpec(torch.nn.Linear, 2, 2)])

    for build in (Stack, lambda: pipe.PipelineModule(layers=[]), lambda: pipe.LayerSpec(torch.nn.Linear, 2, 2),
                  lambda: pipe.TiedLayerSpec("embed", torch.nn.Linear, 2, 2)):
        with pytest.raises(NotImplementedError, match="pipeline parallelism is not implemented by zerodp"):
            build()


def test_moe_layer_refuses_naming_the_feature() -> None:
    with pytest.raises(MoENotProvided, match=r"MoE\(num_experts=4, ep_size=2\): mixture-of-experts"):
        MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=4, ep_size=2)


def test_op_builders_are_compatible_only_where_zerodp_provides_the_optimizer() -> None:
    assert CPUAdamBuilder().is_compatible() and FusedAdamBuilder().is_compatible()
    assert not FusedLambBuilder().is_compatible() and not AsyncIOBuilder().is_compatible()
    assert ops.__compatible_ops__[CPUAdamBuilder.NAME] and not ops.__compatible_ops__[FusedLambBuilder.NAME]
    with pytest.raises(OpBuilderNotProvided, match="'cpu_adam' is not provided by zerodp.*deepspeed.ops.adam"):
        CPUAdamBuilder().load()
    with pytest.raises(OpBuilderNotProvided, match="'fused_lamb'"):
        FusedLambBuilder().jit_load()


class _Conf(DeepSpeedConfigModel):
    size: int = 0
    old_names: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "names",
                                                              "new_param_fn": lambda v: [v]})
    names: Optional[list[str]] = None
    alias_target: int = Field(0, alias="alias_key")


def test_config_model_moves_a_deprecated_field_and_refuses_both() -> None:
    assert _Conf(old_names="a").names == ["a"]
    with pytest.raises(AssertionError, match="'old_names' is deprecated and replaced by 'names'"):
        _Conf(old_names="a", names=["b"])
    with pytest.raises(ValueError):  # the same error is a ValueError too (zerodp's type for user input)
        _Conf(old_names="a", names=["b"])


def test_config_model_keeps_deepspeeds_conventions() -> None:
    assert _Conf(size="auto").size == 0  # "auto" is dropped: the default stays
    assert _Conf(alias_key=3).alias_target == 3 and _Conf(alias_target=3).alias_target == 3
    with pytest.raises(ValidationError):
        _Conf(sise=1)
    with pytest.raises(ValidationError):
        _Conf(size="auto", strict=True)
    assert get_config_default(_Conf, "size") == 0
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['a'\]"):
        dict_raise_error_on_duplicate_keys([("a", 1), ("b", 2), ("a", 3)])


def test_fp16_section_follows_deepspeeds_value_rules() -> None:
    assert DeepSpeedFP16Config(loss_scale="3").loss_scale == 3.0
    for bad in (True, -1, float("nan")):
        with pytest.raises(ValidationError):
            DeepSpeedFP16Config(loss_scale=bad)
    with pytest.raises(ValidationError, match="must be a number"):
        DeepSpeedFP16Config(loss_scale=[])
    with pytest.raises(ValidationError, match="loss_scale_window must be > 0 with dynamic loss scaling"):
        DeepSpeedFP16Config(enabled=True, loss_scale=0, loss_scale_window=0)
    assert DeepSpeedFP16Config(enabled=True, loss_scale=128, loss_scale_window=0).loss_scale_window == 0
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled


@pytest.mark.parametrize("cls", [DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, FP16_UnfusedOptimizer])
def test_deepspeeds_internal_optimizers_exist_by_name_only(cls: type) -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert not isinstance(optimizer, cls)
    with pytest.raises(NotImplementedError, match=f"deepspeed.runtime.*{cls.__name__} is DeepSpeed's internal class"):
        cls(optimizer)


def test_small_helpers() -> None:
    from zerodp.compat import deepspeed as ds

    assert ds.__git_hash__ == ds.__git_branch__ == "[none]"  # DeepSpeed's value for a build outside git
    assert required_torch_version(min_version="1.0") and not required_torch_version(max_version="1.0")
    with pytest.raises(ValueError, match="give min_version, max_version or both"):
        required_torch_version()
    assert get_model_ckpt_name_for_rank("ckpt/global_step0", "00") == "ckpt/global_step0/mp_rank_00_model_states.pt"
    assert leaf_module_config.DEFAULT_LEAF_MODULE_CLASSES == LeafModuleConfig().classes


def test_deepspeed_spellings_zerodp_reads_the_same() -> None:
    from zerodp.compat.deepspeed.runtime.config import DeepSpeedConfig
    from zerodp.compat.deepspeed.runtime.utils import call_to_str

    assert leaf_module_config.DeepSpeedZeroLeafModuleConfig(name_suffixes="tail").name_suffixes == ["tail"]
    assert call_to_str("f") == "f()" and call_to_str("hello", 1138, "x", val=3) == "hello(1138, 'x', val=3)"
    assert DeepSpeedConfig({"train_batch_size": 1}, mpu=_OneRank()).gradient_allreduce_op == "mean"


class _OneRank:
    """A model-parallel unit of one data-parallel rank (so DeepSpeedConfig needs no torch.distributed)."""

    def get_data_parallel_world_size(self) -> int:
        return 1


def _empty_partition_cache(rank: int, world: int) -> tuple:
    from tests.models import make_model, train_steps
    from zerodp.compat import deepspeed as ds

    model = make_model()
    engine, *_ = ds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                               config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}})
    train_steps(engine, rank, range(1))
    steps = engine.global_steps
    result = engine.empty_partition_cache()
    train_steps(engine, rank, range(1, 2))  # training goes on after it
    return result, engine.global_steps - steps


def test_engines_from_deepspeed_initialize_have_empty_partition_cache() -> None:
    from tests.harness import run_ranks

    [(result, steps)] = run_ranks(_empty_partition_cache, 1, timeout=120)
    assert result is None and steps > 0


def test_the_bench_counts_what_finished_in_a_module_killed_at_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "deepspeed_unit_tests.py"
    spec = importlib.util.spec_from_file_location("deepspeed_unit_tests", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclass looks its module up there
    spec.loader.exec_module(bench)
    output = ("unit/a.py::TestX::test[1-True] \x1b[32mPASSED\x1b[0m [  1%]\n"
              "unit/a.py::TestX::test[2-False] FAILED [  2%]\n"
              "unit/a.py::test_y SKIPPED (2 ranks) [  3%]\n"
              "unit/a.py::test_z ERROR [  4%]\n"
              "unit/a.py::test_w ")  # the test running when the module was killed
    result = bench.parse_verbose(output, "unit/a.py")
    assert (result.collected, result.passed, result.failed, result.errors, result.skipped) == (4, 1, 1, 1, 1)


def test_cpu_device_count_reads_deepspeeds_local_size_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's CPU accelerator counts LOCAL_SIZE devices when it is set (its harness skips a
    2-rank test on a 1-device machine otherwise); zerodp's falls back to LOCAL_WORLD_SIZE, then 1."""
    from zerodp.compat.deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if torch.cuda.is_available():
        pytest.skip("the CPU accelerator's count: this machine has CUDA")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert accelerator.device_count() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert accelerator.device_count() == 2
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert accelerator.device_count() == 4
    monkeypatch.setenv("LOCAL_SIZE", "0")  # DeepSpeed's "unset"
    assert accelerator.device_count() == 2

"""`zerodp.zero.Init` and `zerodp.zero.GatheredParameters`: build and edit stage-3 models without
ever holding the whole model on one rank.

    with zerodp.zero.Init(config=ds_config):
        model = MyModel()                    # each parameter partitioned as its module is built
    with zerodp.zero.GatheredParameters(model.embed.weight, modifier_rank=0):
        if rank == 0:
            model.embed.weight[0].zero_()    # rank 0's edit reaches every rank's shard on exit
    engine, *_ = zerodp.initialize(model=model, config=ds_config)

[Note: partitioning at construction]
Inside `Init`, every `nn.Module` subclass's `__init__` is wrapped: when the outermost `__init__` of
a module returns, its parameters are broadcast from rank 0 (so every rank holds the same values
whatever its random state), each rank keeps its equal share of each parameter (padded to a
multiple of the world size, as zero/layout.py pads) and `param.data` becomes an empty tensor
(`param.ds_shape` keeps the shape; `ds_id`, `ds_status`, `ds_tensor` are DeepSpeed's attributes too). At most one module's own parameters exist in full at a time.
`module.apply(fn)` and the `torch.nn.init` functions (weight initialisation after construction, on
parameters already partitioned) gather the parameters they touch and keep rank 0's result. `zerodp.initialize` regroups these per-parameter shards into
its units one unit at a time.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

from zerodp import comm
from zerodp.offload.nvme import PARAM_NVME_PATH_KEY, SwapStore
from zerodp.offload.param_swap import resident
from zerodp.offload.swap import SwapSlot
from zerodp.zero.layout import group_layout
from zerodp.zero.units import Unit, UnitState, ZeroParamStatus, mark_partitioned

_active: list["Init"] = []  # the Init contexts entered, innermost last


class Init:
    """Construct modules already partitioned across data-parallel ranks (ZeRO stage 3).

    Args (DeepSpeed's names; the others it accepts are ignored):
        module: an already-built module to partition now instead of using a `with` block.
        config / config_dict_or_path: the training config; its bf16/fp16 section sets the dtype, and
            its `zero_optimization.offload_param` where the shards go (as `remote_device`).
        dtype: the parameter dtype (default: from the config, else the parameters' own).
        remote_device: where each rank's shards live until `initialize`: "cpu" (host memory), "nvme"
            (a swap file under the config's offload_param.nvme_path, so a model larger than host memory
            can be built), None / "none" / "cuda" = the device (default: the config's offload_param).
        enabled: False makes this a no-op context.
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, remote_device: str | None = None, **_deepspeed_only: Any) -> None:
        if data_parallel_group is not None:
            raise NotImplementedError("zero.Init(data_parallel_group=...): zerodp shards over all ranks")
        if remote_device not in (None, "none", "cuda", "cpu", "nvme"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): expected None, \"none\", \"cuda\", "
                             "\"cpu\" or \"nvme\"")
        self.remote_device = remote_device
        self.enabled = enabled
        self.config = config if config is not None else config_dict_or_path
        self.dtype = dtype
        self.held_bytes = 0  # parameter bytes held now: shards + full parameters not yet partitioned
        self.peak_bytes = 0  # the most held at once during construction
        self._originals: dict[type, Any] = {}
        if module is not None and enabled:
            self._setup()
            self._partition(module)
            self.store = None

    def _setup(self) -> None:
        from zerodp.config import param_offload_of

        comm.init_distributed()
        self.rank, self.num_ranks = comm.get_rank(), comm.get_world_size()
        self.device = comm.device_for_backend()
        if self.dtype is None and self.config is not None:
            self.dtype = _config_dtype(self.config)
        device, nvme_path = param_offload_of(self.config) if self.config is not None else ("none", None)
        device = self.remote_device if self.remote_device not in (None, "none", "cuda") else device
        self.shard_device = torch.device("cpu") if device in ("cpu", "nvme") else self.device
        self.store = None  # nvme: the shards' swap file, removed once initialize() has read them all
        if device == "nvme":
            if nvme_path is None:
                raise ValueError('zero.Init(remote_device="nvme") needs zero_optimization.offload_param.nvme_path '
                                 "in the config passed as config= / config_dict_or_path=")
            self.store = SwapStore(nvme_path, key=PARAM_NVME_PATH_KEY)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._setup()
        for cls in _subclasses(nn.Module):
            if "__init__" in vars(cls) and not getattr(cls.__init__, "_zerodp_wrapped", False):
                self._originals[cls] = cls.__init__
                cls.__init__ = _wrapped_init(cls.__init__)
        self._originals[nn.Module] = nn.Module.apply
        nn.Module.apply = _gathered_apply
        self._init_functions = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS if hasattr(nn.init, name)}
        for name, fn in self._init_functions.items():
            setattr(nn.init, name, _gathered_init(fn))
        self._handle = nn.modules.module.register_module_parameter_registration_hook(self._on_register)
        _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        self.store = None  # kept alive by the parameters' slots only: it goes when initialize() has read them
        _active.remove(self)
        self._handle.remove()
        for cls, original in self._originals.items():
            if cls is nn.Module:
                nn.Module.apply = original
            else:
                cls.__init__ = original
        self._originals.clear()
        for name, fn in self._init_functions.items():
            setattr(nn.init, name, fn)

    def _on_register(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not is_partitioned(param):
            self._count(param.numel() * param.element_size())

    def _count(self, delta: int) -> None:
        self.held_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    @torch.no_grad()
    def _partition(self, module: nn.Module) -> None:
        """Partition every parameter of `module` not partitioned yet (see [Note: partitioning at construction])."""
        for p in module.parameters():
            if is_partitioned(p):
                continue
            dtype = self.dtype if self.dtype is not None and p.is_floating_point() else p.dtype
            full = p.detach().to(device=self.device, dtype=dtype).reshape(-1)
            if self.num_ranks > 1:
                full = full.contiguous()
                comm.broadcast(full, src=0)
            layout = group_layout([full.numel()], self.num_ranks)
            start, stop = layout.owned_range(self.rank)
            shard = torch.zeros(stop - start, dtype=dtype, device=self.shard_device)
            real = full[start:stop]
            shard[: real.numel()].copy_(real)
            mark_partitioned(p, shard)
            p._zerodp_init_shard = shard
            if self.store is not None:  # written and freed: the next module's shards take its place
                p._zerodp_init_slot = slot = SwapSlot(self.store, f"init/{p.ds_id}", shard)
                slot.write().wait()
                slot.evict()
            in_memory = 0 if self.store is not None else shard.numel() * shard.element_size()
            self._count(in_memory - p.numel() * p.element_size())
            p.data = torch.empty(0, dtype=dtype, device=self.device)


def is_partitioned(p: torch.Tensor) -> bool:
    """True for a parameter partitioned by zero.Init or owned by a stage-3 engine."""
    return hasattr(p, "_zerodp_init_shard") or hasattr(p, "_zerodp_unit")


def gather_init_param(p: nn.Parameter) -> torch.Tensor:
    """The full value of a zero.Init-partitioned parameter, all-gathered from the ranks' shards
    (every rank must call it, for the same parameters in the same order)."""
    shard = p._zerodp_init_shard
    device = comm.device_for_backend()
    full = torch.empty(shard.numel() * comm.get_world_size(), dtype=shard.dtype, device=device)
    with _init_shard_resident(p):
        if comm.get_world_size() > 1:
            comm.all_gather_into_tensor(full, shard.to(device))
        else:
            full.copy_(shard)
    return full[: p.ds_numel].view(p.ds_shape)


def _init_shard_resident(p: nn.Parameter, modify: bool = False) -> contextlib.AbstractContextManager[None]:
    """p's zero.Init shard in memory inside the block (read from its swap file with remote_device
    "nvme", written back on exit if `modify`, then freed)."""
    return resident(getattr(p, "_zerodp_init_slot", None), modify)


def release_init_shard(p: nn.Parameter) -> None:
    """Forget p's zero.Init shard (initialize() has copied it into its unit); the last one released
    lets the swap file go."""
    del p._zerodp_init_shard
    if hasattr(p, "_zerodp_init_slot"):
        del p._zerodp_init_slot


def _init_shard_from(p: nn.Parameter, full: torch.Tensor) -> None:
    """Store this rank's share of the full value `full` (padded layout) back into p's shard."""
    shard = p._zerodp_init_shard
    start = comm.get_rank() * shard.numel()
    real = full.reshape(-1)[start : start + shard.numel()]
    with _init_shard_resident(p, modify=True):
        shard[: real.numel()].copy_(real)


class GatheredParameters:
    """Full parameters inside the block, partitioned again on exit (DeepSpeed's API). Their units stay
    gathered until the block exits: forwards inside it (a `generate()` call) gather nothing, where
    each forward would otherwise gather and release every unit.

    Args:
        params: a parameter or an iterable of them (non-parameters and unpartitioned ones are
            left alone, as in DeepSpeed).
        modifier_rank: None = read-only (edits are dropped on exit); r = rank r's values are
            broadcast on exit and every rank's shard (and fp32 master) updated from them.
        fwd_module: also registers the parameters as used by this module's forward
            (zerodp.zero.register_external_parameter); only effective before initialize().
        enabled: False makes this a no-op.
    Every rank must enter the block, for the same parameters.
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True) -> None:
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        self.params = [p for p in params if isinstance(p, nn.Parameter) and is_partitioned(p)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)
        if fwd_module is not None:
            from zerodp.zero.units import register_external_parameter

            for p in self.params:
                register_external_parameter(fwd_module, p)
        if modifier_rank is not None and not 0 <= modifier_rank < comm.get_world_size():
            raise ValueError(f"modifier_rank={modifier_rank} is not a rank (world size {comm.get_world_size()})")

    def __enter__(self) -> None:
        if not self.enabled:
            return
        self.units: dict[Unit, bool] = {}  # unit -> was it sharded before
        with comm.ledger.outside_step():
            for p in self.params:
                unit = getattr(p, "_zerodp_unit", None)
                if unit is None:
                    p.data = gather_init_param(p)
                    p.ds_status = ZeroParamStatus.AVAILABLE
                elif unit not in self.units:
                    self.units[unit] = unit.state is UnitState.SHARDED
                    unit.gather(exact=True)  # never quantized (qwZ): the values are read or edited
                    unit.holds += 1

    @torch.no_grad()
    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        with comm.ledger.outside_step():
            for p in self.params:
                if getattr(p, "_zerodp_unit", None) is None:
                    self._repartition_init_param(p)
            for unit, was_sharded in self.units.items():
                unit.holds -= 1
                if self.modifier_rank is not None:
                    unit.take_values_from(self.modifier_rank)
                if was_sharded:
                    unit.release()  # (a no-op while an enclosing block still holds it)

    def _repartition_init_param(self, p: nn.Parameter) -> None:
        full = p.data.reshape(-1)
        if self.modifier_rank is not None and comm.get_world_size() > 1:
            full = full.contiguous()
            comm.broadcast(full, src=self.modifier_rank)
        if self.modifier_rank is not None:
            _init_shard_from(p, full)
        p.data = torch.empty(0, dtype=full.dtype, device=full.device)
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE


# ---------------------------------------------------------------------------------------------


def _config_dtype(config: Any) -> torch.dtype | None:
    """bf16 / fp16 from a config (dict, path, JSON string or ZeroDPConfig), else None. Only the
    precision sections are read: Hugging Face builds models under zero.Init with a config whose
    other "auto" values it resolves later."""
    from zerodp.config import precision_of

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision_of(config))


def _subclasses(cls: type) -> set[type]:
    found, todo = set(), [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def _wrapped_init(init: Any) -> Any:
    @functools.wraps(init)
    def wrapper(module: nn.Module, *args: Any, **kwargs: Any) -> None:
        depth = module.__dict__.get("_zerodp_init_depth", 0)
        module.__dict__["_zerodp_init_depth"] = depth + 1
        try:
            init(module, *args, **kwargs)
        finally:
            module.__dict__["_zerodp_init_depth"] = depth
        if depth == 0 and _active:
            del module.__dict__["_zerodp_init_depth"]
            _active[-1]._partition(module)

    wrapper._zerodp_wrapped = True
    return wrapper


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


def _gathered_init(fn: Any) -> Any:
    """torch.nn.init.<fn> inside Init: on a partitioned parameter (a model's own `_init_weights`
    after its submodules were built), gather it, initialise it, keep rank 0's values."""
    @functools.wraps(fn)
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(tensor, nn.Parameter) and is_partitioned(tensor):
            with GatheredParameters(tensor, modifier_rank=0):
                fn(tensor, *args, **kwargs)
            return tensor
        return fn(tensor, *args, **kwargs)
    return init


def _gathered_apply(self: nn.Module, fn: Any) -> nn.Module:
    """nn.Module.apply inside Init: each module's own parameters are gathered around `fn`, rank 0's
    result kept (weight initialisation after construction must not act on empty shards)."""
    for child in self.children():
        child.apply(fn)
    with GatheredParameters(list(self.parameters(recurse=False)), modifier_rank=0):
        fn(self)
    return self

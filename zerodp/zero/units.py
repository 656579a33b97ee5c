"""Stage-3 units: parameters that are gathered and released together, and how they are chosen.

A unit is one module's subtree (a transformer block) whose parameters live in one or two flat
buffers: trainable parameters in one, frozen ones in the other (so a LoRA model reduce-scatters
only its adapters). Each flat buffer is cut into equal owned shards with zero/layout.py; a rank
keeps its shard for the life of training and holds the full buffer only while the unit is
gathered.

[Note: releasing a gathered unit]
Released parameters keep their Parameter objects (autograd leaves, optimizer and hook identity)
but `param.data` becomes an empty tensor, so code touching a released parameter fails loudly on
its shape instead of computing with stale values; `param.ds_shape` / `param.ds_numel` keep the
full shape (DeepSpeed's names). The full buffer's storage is resized to 0, which frees it even
though autograd still holds views of it (a linear layer saves `weight.t()`); gathering resizes the
same storage back and all-gathers into it, so those saved views read the gathered values in
backward. That is why a unit must be gathered before its backward runs (the pre-backward hook).

[Note: choosing units]
`zerodp.zero.set_z3_leaf_modules(model, [Block])` (DeepSpeed's name) makes every module of those
classes a unit (the model's own class: the whole model is one unit, the root below). Otherwise each child of the model's largest outermost `nn.ModuleList` (its repeated blocks)
is a unit, the expert lists of mixture-of-experts blocks left out of that choice. A MoE block is
never split: one inside a chosen unit stays in it whole, one outside every unit, or holding marked
modules, is a unit itself (zero/moe.py's [Note: MoE blocks are gathered whole]). Every parameter outside those units belongs to the root unit, the whole model, which
stays gathered from the start of forward to the end of backward (FSDP2's root): embeddings, the
output head and parameters used outside their own module's forward (a head tied to the embedding,
`F.linear(h, self.wte.weight)`) are then always available. A parameter registered in two units
(a weight shared between blocks) belongs to the root unit too. Parameters of at most
`stage3_param_persistence_threshold` elements (biases, norms) are never released: they form one
persistent unit, which saves a collective per tiny tensor.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from functools import partial
from enum import Enum
from typing import Callable, Union

import torch
from torch import nn

from zerodp import comm, timers
from zerodp.checkpointing import repeated_blocks
from zerodp.memory import nbytes
from zerodp.offload.param_swap import resident
from zerodp.zero.layout import GroupLayout, group_layout
from zerodp.zero.moe import find_moe_blocks, inside_blocks, outermost
from zerodp.zero.quantized_comm import QuantizedGather
from zerodp.zero.topology import Partition


class UnitState(Enum):
    """Where a unit's parameters are (see [Note: releasing a gathered unit])."""

    SHARDED = "sharded"  # only the owned shards are held; the full buffers' storage is freed
    GATHERING = "gathering"  # all-gathers into the full buffers are in flight (a prefetch)
    GATHERED = "gathered"  # params are views of the full buffers, readable and differentiable


class ZeroParamStatus(Enum):
    """`param.ds_status` of a stage-3 parameter, with DeepSpeed's names and values: code written for
    DeepSpeed (TRL, DeepSpeed-Chat) reads it to decide what to gather."""

    AVAILABLE = 1  # the full value is present (its unit is GATHERED)
    NOT_AVAILABLE = 2  # only shards are held (SHARDED)
    INFLIGHT = 3  # being gathered (GATHERING)


_PARAM_STATUS = {UnitState.SHARDED: ZeroParamStatus.NOT_AVAILABLE, UnitState.GATHERING: ZeroParamStatus.INFLIGHT,
                 UnitState.GATHERED: ZeroParamStatus.AVAILABLE}
_ds_ids = itertools.count()


def mark_partitioned(p: nn.Parameter, shard: torch.Tensor) -> None:
    """Give a partitioned parameter DeepSpeed's attributes: `ds_id` (unique in the process),
    `ds_shape` / `ds_numel` (its full shape), `ds_status`, and `ds_tensor` (this rank's elements
    of it, possibly none)."""
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_ds_ids)
    if not hasattr(p, "ds_shape"):
        p.ds_shape, p.ds_numel = p.shape, p.numel()
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    p.ds_tensor = shard
    # DeepSpeed's modules-using-it set, which code written for DeepSpeed clears (TRL, around generation);
    # zerodp counts who holds a unit in `Unit.holds`, so it stays empty
    p.ds_active_sub_modules = set()


def _owned_part(start: int, numel: int, owned: slice) -> slice:
    """The part of the shard (`full[owned]`) that holds elements [start, start + numel) of the
    full buffer: an empty slice when this rank owns none of them."""
    lo, hi = max(start, owned.start), min(start + numel, owned.stop)
    return slice(lo - owned.start, max(lo, hi) - owned.start)


class FlatShard:
    """Parameters flattened into one buffer of `layout.padded_numel` elements, of which this rank
    owns `full[owned]`, kept in `shard`."""

    def __init__(self, params: list[nn.Parameter], rank: int, num_ranks: int, dtype: torch.dtype,
                 device: torch.device, keep_full: bool, shard_device: torch.device | None = None,
                 secondary: tuple[int, int] = (0, 1)) -> None:
        self.params = params
        self.layout: GroupLayout = group_layout([p.ds_numel for p in params], num_ranks)
        self.full = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
        # hpZ: this rank's part (secondary rank, of secondary size) of the full buffer, kept from the last
        # gather over all ranks: see [Note: hierarchical partitioning] in zero/topology.py
        secondary_rank, secondary_size = secondary
        size = self.layout.padded_numel // secondary_size  # the padding to num_ranks is to a multiple of it
        self.secondary_range = slice(secondary_rank * size, (secondary_rank + 1) * size)
        self.secondary = torch.empty(size, dtype=dtype, device=device) if secondary_size > 1 and not keep_full else None
        self.views = [self.full[o : o + p.ds_numel].view(p.ds_shape) for p, o in zip(params, self.layout.offsets)]
        start, stop = self.layout.owned_range(rank)
        self.owned = slice(start, stop)
        self.keep_full = keep_full  # persistent units and 1-rank jobs: `shard` is a view of `full`
        # the owned shard: on the host with offload_param (copied to the device to be gathered)
        self.shard = self.full[self.owned] if keep_full else torch.empty(
            stop - start, dtype=dtype, device=shard_device or device, pin_memory=(shard_device or device) != device
            and torch.cuda.is_available())
        self.slot = None  # offload_param nvme: a SwapSlot holding the shard's bytes (offload/param_swap.py)

    def shard_resident(self, modify: bool = False, overwrite: bool = False):
        """The owned shard in memory inside the block (NVMe param offload swaps it in; `overwrite`
        skips the read when every element will be written); written back on exit if `modify`."""
        return resident(self.slot, modify=modify, overwrite=overwrite)

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def allocate(self) -> None:
        """Give the full buffer its storage back (same storage object: saved views stay valid)."""
        storage = self.full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.full_bytes)

    def free(self) -> None:
        storage = self.full.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)


class Unit:
    """One stage-3 unit: `module`'s parameters in a trainable and a frozen FlatShard."""

    def __init__(self, index: int, name: str, module: nn.Module, params: list[nn.Parameter],
                 partition: Partition, dtype: torch.dtype, device: torch.device, persistent: bool = False,
                 shard_device: torch.device | None = None, offloaded: bool = False,
                 trains: Callable[[nn.Parameter], bool] | None = None, weight_block_numel: int = 0) -> None:
        self.index, self.name, self.module, self.persistent = index, name, module, persistent
        # qwZ: the forward's and backward's gathers send int8 blocks of this many elements (0: exact)
        self.weight_block_numel = weight_block_numel
        self._exact = True  # the gather in flight is exact (see [Note: quantized collectives])
        self.num_ranks = num_ranks = partition.shard_size  # the ranks its flat buffers are cut over
        self.group = partition.shard_group  # they all-gather over it
        self.secondary_group = partition.secondary_group  # hpZ: later gathers go over this one
        self.secondary_valid = False  # hpZ: the secondary shards hold the parameters' current values
        # never released: persistent, or nothing to shard across (1 rank) unless shards are offloaded
        keep_full = persistent or (num_ranks == 1 and not offloaded)
        trains = trains or (lambda p: p.requires_grad)  # the optimizer's parameters (none: forward only)
        trainable = [p for p in params if trains(p)]
        frozen = [p for p in params if not trains(p)]
        flat = partial(FlatShard, rank=partition.shard_rank, num_ranks=num_ranks, dtype=dtype, device=device,
                       keep_full=keep_full, shard_device=shard_device,
                       secondary=(partition.secondary_rank, partition.secondary_size))
        self.trainable = flat(trainable) if trainable else None
        self.frozen = flat(frozen) if frozen else None
        self.flats = [f for f in (self.trainable, self.frozen) if f is not None]
        self.numel = sum(f.layout.padded_numel for f in self.flats)
        self.keeps_full = keep_full or not self.flats  # never released
        self.holds = 0  # GatheredParameters blocks open on it: not released until the last one exits
        self.state = UnitState.GATHERED  # until `shard_from_full` has run (set through _enter)
        self._works: list = []  # all-gathers in flight
        self._reads: list = []  # NVMe parameter offload: shard reads in flight
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self.master: torch.Tensor | None = None  # the trainable shard's fp32 master (set by the strategy)
        self.master_slot = None  # NVMe offload: the SwapSlot holding the master's bytes
        self.owned_grad: torch.Tensor | None = None  # reduced gradient shard (set by the strategy)
        self.master_resident = contextlib.nullcontext  # NVMe offload: brings the master into memory
        self.pieces: list[tuple[int, int, int]] = []  # (optimizer group, start, stop) in the owned shard
        self.piece_views: list[torch.Tensor] = []  # master[start:stop] of each: the optimizer's params
        # backward bookkeeping, reset per backward (see stage3_hooks.py's [Note: when a unit is released])
        self.calls_pending = 0  # forward calls whose post-backward has not run yet
        self.grads_pending = 0  # trainable params whose gradient is not final yet

    def shard_from_full(self) -> None:
        """Keep this rank's shard of the values now in the full buffers; release unless kept."""
        with torch.no_grad():
            for f in self.flats:
                if not f.keep_full:
                    f.shard.copy_(f.full[f.owned])
        for f in self.flats:
            for p, start in zip(f.params, f.layout.offsets):
                mark_partitioned(p, f.shard[_owned_part(start, p.ds_numel, f.owned)])
        self._enter(UnitState.GATHERED)
        self._keep_secondary()
        self.point_params_at_full()
        if not self.keeps_full:
            self.release()

    def point_params_at_full(self) -> None:
        for f in self.flats:
            for p, view in zip(f.params, f.views):
                p.data = view

    # --- state transitions -----------------------------------------------------------------------

    def _enter(self, state: UnitState) -> None:
        self.state = state
        status = _PARAM_STATUS[state]
        for f in self.flats:
            for p in f.params:
                p.ds_status = status

    def start_gather(self, exact: bool = False) -> None:
        """SHARDED -> GATHERING: launch the all-gathers into re-allocated full buffers (with NVMe
        parameter offload: launch the shards' reads; the all-gathers follow in finish_gather).
        `exact` (default False): never quantized, even with qwZ ([Note: quantized collectives])."""
        if self.state is not UnitState.SHARDED:
            raise AssertionError(f"rank {comm.get_rank()}: start_gather on unit {self.name} in state {self.state}")
        self._exact = exact or not self.weight_block_numel
        if not self._reads:  # else read ahead already
            self._reads = [f.slot.read() for f in self.flats if f.slot is not None]  # evicted when gathered
        self._works = [] if self._reads else self._launch_all_gathers()
        self._enter(UnitState.GATHERING)

    def _launch_all_gathers(self) -> list:
        works = []
        # hpZ: inside the secondary group, unless an exact gather must not read quantized values there
        secondary = self.secondary_valid and (not self._exact or not self.weight_block_numel)
        for f in self.flats:
            f.allocate()
            source, group = (f.secondary, self.secondary_group) if secondary else (f.shard, self.group)
            if source.device != f.full.device:  # offload_param: fetched from the host
                with timers.waiting("offload", nbytes(source)):
                    source = source.to(f.full.device, non_blocking=True)
            if self._exact:
                works.append(comm.all_gather_into_tensor(f.full, source, group=group, async_op=True))
            else:  # qwZ: quantized on the gather's device, dequantized on arrival
                works.append(QuantizedGather(f.full, source, group, self.weight_block_numel))
        return works

    def _keep_secondary(self) -> None:
        """hpZ, after a gather over all ranks: keep this rank's secondary shards of the values."""
        if self.secondary_group is None or self.secondary_valid:
            return
        with torch.no_grad():
            for f in self.flats:
                if f.secondary is not None:
                    f.secondary.copy_(f.full[f.secondary_range])
        self.secondary_valid = all(f.secondary is not None for f in self.flats)

    def invalidate_secondary(self) -> None:
        """The shards changed (an optimizer step, a load): the next gather goes over all ranks."""
        self.secondary_valid = False

    def finish_gather(self) -> None:
        """GATHERING -> GATHERED: wait, then make the parameters views of the full buffers."""
        if self.state is not UnitState.GATHERING:
            raise AssertionError(f"rank {comm.get_rank()}: finish_gather on unit {self.name} in state {self.state}")
        if self._wait_reads():
            self._works = self._launch_all_gathers()
        for work in self._works:
            work.wait()
        self._works = []
        self._keep_secondary()
        self._evict_swapped_shards()
        self.point_params_at_full()
        self._enter(UnitState.GATHERED)

    def gather(self, exact: bool = False) -> None:
        """Make the unit GATHERED from any state (waits for a prefetch in flight); `exact` as in
        `start_gather`."""
        if self.state is UnitState.SHARDED:
            self.start_gather(exact)
        if self.state is UnitState.GATHERING:
            self.finish_gather()

    @property
    def swapped_numel(self) -> int:
        """Elements of this rank's shards kept in NVMe swap files (0 without parameter offload)."""
        return sum(f.shard.numel() for f in self.flats if f.slot is not None)

    @property
    def reading_ahead(self) -> bool:
        return self.state is UnitState.SHARDED and bool(self._reads)

    def read_ahead(self) -> None:
        """NVMe parameter offload, while SHARDED: start reading the swapped shards now, ahead of the
        all-gather that `start_gather` will launch when they land."""
        if self.state is UnitState.SHARDED and not self._reads:
            self._reads = [f.slot.read() for f in self.flats if f.slot is not None]

    def _wait_reads(self) -> bool:
        """Wait for the shard reads in flight (NVMe parameter offload); whether there were any."""
        reads, self._reads = self._reads, []
        for read in reads:
            read.wait()
        return bool(reads)

    def _evict_swapped_shards(self) -> None:
        for f in self.flats:
            if f.slot is not None:
                f.slot.evict()

    def release(self) -> None:
        """-> SHARDED: free the full buffers (a gather in flight is waited for first) and any
        shards read ahead but not gathered."""
        if self.state is UnitState.SHARDED and self._wait_reads():
            self._evict_swapped_shards()
        if self.keeps_full or self.holds or self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.GATHERING:
            self.finish_gather()
        self._check_params_are_views()
        for f in self.flats:
            for p in f.params:
                p.data = self._empty
            f.free()
        self._enter(UnitState.SHARDED)

    def _check_params_are_views(self) -> None:
        """RuntimeError naming a parameter whose `.data` its module replaced while the unit was gathered.

        [Note: a module that replaces its parameter's data]
        A gathered parameter is a view of its unit's full buffer; releasing the unit keeps only this
        rank's shard of that buffer. A module that assigns `weight.data = new` in its forward (bitsandbytes'
        Linear4bit repacks its 4-bit weight so on a CPU with AVX512-BF16 when it runs in eval mode on an input
        that needs no gradient, and marks its quant_state as repacked) would lose the new data at the release
        while keeping its own bookkeeping, so the next gather would silently compute with the old layout.
        Refused instead, on the first release."""
        for f in self.flats:
            for p, view in zip(f.params, f.views):
                if view.numel() and (p.data.data_ptr() != view.data_ptr() or p.data.shape != view.shape):
                    name = next((n for n, q in self.module.named_parameters() if q is p), f"of shape {tuple(view.shape)}")
                    raise RuntimeError(
                        f"stage 3: a module replaced the data of parameter {name} (unit {self.name}) while it was "
                        "gathered, and zerodp keeps only the shards of the gathered values: the change would be lost. "
                        "bitsandbytes' Linear4bit does this in eval mode on CPU (it repacks its 4-bit weight for "
                        "inference): call model.train() before training, or use stage 0-2")

    @torch.no_grad()
    def take_values_from(self, src: int) -> None:
        """After rank `src` edited the gathered parameters: broadcast its values and refresh every
        rank's shards and fp32 master (GatheredParameters(modifier_rank=src))."""
        if self.state is not UnitState.GATHERED:
            raise AssertionError(f"rank {comm.get_rank()}: take_values_from on {self.name} in state {self.state}")
        self.invalidate_secondary()
        for f in self.flats:
            if comm.get_world_size() > 1:  # every rank holds the gathered unit
                comm.broadcast(f.full, src=src)
            if not f.keep_full:
                with f.shard_resident(modify=True, overwrite=True):
                    f.shard.copy_(f.full[f.owned])
        if self.master is not None and self.master is not self.trainable.shard:
            with self.master_resident():  # from the gathered buffer: a shard on NVMe is evicted again by now
                self.master.copy_(self.trainable.full[self.trainable.owned])
        self._keep_secondary()

    def held_full_bytes(self) -> int:
        """Bytes of gathered full buffers this unit holds now (0 while SHARDED)."""
        if self.state is UnitState.SHARDED or self.keeps_full:
            return 0
        return sum(f.full_bytes for f in self.flats)


# ---------------------------------------------------------------------------------------------
# choosing units (see [Note: choosing units])


LeafClass = Union[type, str]
"""A leaf-module class: the class, its name (`"MixtralSparseMoeBlock"`) or its qualified name
(`"transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"`), as DeepSpeed accepts."""


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` (a module) is flagged as a stage-3 leaf module (set_z3_leaf_modules)."""
    return bool(getattr(model, "_z3_leaf", False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` flagged as stage-3 leaf modules, in module order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _class_matches(module: nn.Module, leaf_class: LeafClass) -> bool:
    if isinstance(leaf_class, type):
        return isinstance(module, leaf_class)
    cls = type(module)
    return leaf_class in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag_classes(model: nn.Module, leaf_classes: list[LeafClass], flag: bool,
                  raise_if_not_found: bool) -> list[nn.Module]:
    bad = [c for c in leaf_classes if not isinstance(c, (type, str))]
    if bad:
        raise ValueError(f"leaf_module_classes must be classes or class names; got {bad!r}")
    matched = [m for m in model.modules() if any(_class_matches(m, c) for c in leaf_classes)]
    if not matched and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in leaf_classes]
        raise ValueError(f"no module of classes {names} in the model ({type(model).__name__}): give classes "
                         "(or their names) of modules the model contains")
    for m in matched:
        m._z3_leaf = flag
    return matched


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[LeafClass],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Make every module of `leaf_module_classes` (classes or class names) in `model` one stage-3
    unit: its whole subtree is gathered and released together, so a mixture-of-experts block whose
    experts differ per rank gathers all of them on every rank. Call before `zerodp.initialize`.
    Returns the modules marked; raises ValueError when none matches unless `raise_if_not_found`
    is False (DeepSpeed's signature)."""
    return _flag_classes(model, list(leaf_module_classes), True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[LeafClass],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Clear the leaf flag of every module of `leaf_module_classes`; returns those modules."""
    return _flag_classes(model, list(leaf_module_classes), False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag (`flag`, default True) of the modules named in `model.named_modules()`;
    returns (modules matched, names not found). Raises ValueError on a missing name unless
    `raise_if_not_found` is False."""
    by_name = dict(model.named_modules())
    missing = [n for n in module_names if n not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing} in the model ({type(model).__name__}); names are "
                         "those of model.named_modules(), e.g. 'model.layers.0.mlp'")
    matched = [by_name[n] for n in module_names if n in by_name]
    for m in matched:
        m._z3_leaf = flag
    return matched, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag (`flag`, default True) of every module whose name in `model.named_modules()`
    ends with one of `module_name_suffixes`; returns (modules matched, each once; suffixes that
    matched nothing). Raises ValueError on an unmatched suffix unless `raise_if_not_found` is False."""
    named = list(model.named_modules())
    matched: list[nn.Module] = []
    missing: list[str] = []
    for suffix in module_name_suffixes:
        hits = [m for n, m in named if n.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        matched += [m for m in hits if not any(m is k for k in matched)]
    if missing and raise_if_not_found:
        raise ValueError(f"no module names end with {missing} in the model ({type(model).__name__})")
    for m in matched:
        m._z3_leaf = flag
    return matched, missing


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that `module`'s forward uses `parameter`, which another module registers, so the
    unit that gathers `module` gathers `parameter` too (DeepSpeed's name). Call before initialize."""
    external = module.__dict__.setdefault("_zerodp_external_params", [])
    if not any(p is parameter for p in external):
        external.append(parameter)


@dataclass
class UnitPlan:
    """Pure description of the units: (name, module, params) with the root unit first."""

    units: list[tuple[str, nn.Module, list[nn.Parameter]]]
    persistent: list[nn.Parameter]


def plan_units(model: nn.Module, persistence_threshold: int, model_persistence_threshold: int,
               detect_moe: bool = True) -> UnitPlan:
    """Assign every parameter of `model` to exactly one unit; see [Note: choosing units].
    `detect_moe` (default True): keep each mixture-of-experts block whole (zero/moe.py)."""
    roots = _unit_roots(model, detect_moe)
    unit_of_module: dict[nn.Module, int] = {}
    for i, (_, m) in enumerate(roots, start=1):
        for sub in m.modules():
            unit_of_module.setdefault(sub, i)
    owners: dict[nn.Parameter, set[int]] = {}
    order: list[nn.Parameter] = []
    for m in model.modules():
        for p in [*m.parameters(recurse=False), *m.__dict__.get("_zerodp_external_params", [])]:
            if p not in owners:
                order.append(p)
            owners.setdefault(p, set()).add(unit_of_module.get(m, 0))
    persistent, budget = [], model_persistence_threshold
    for p in order:
        numel = full_numel(p)
        if numel <= persistence_threshold and numel <= budget:
            persistent.append(p)
            budget -= numel
    persistent_set = set(persistent)
    members: list[list[nn.Parameter]] = [[] for _ in range(len(roots) + 1)]
    for p in order:
        if p not in persistent_set:
            unit_ids = owners[p]
            members[unit_ids.pop() if len(unit_ids) == 1 else 0].append(p)
    units = [("<root>", model, members[0])] + [(n, m, ps) for (n, m), ps in zip(roots, members[1:])]
    return UnitPlan([u for u in units if u[2] or u[1] is model], persistent)


def full_numel(p: torch.Tensor) -> int:
    """Elements of the full parameter, also while it is partitioned (`ds_numel`)."""
    return getattr(p, "ds_numel", p.numel())


def mark_leaf_modules_from_config(model: nn.Module, classes: list[str], names: list[str],
                                  name_suffixes: list[str]) -> int:
    """`zero_optimization.leaf_module`: mark modules by class name (short or qualified), module name
    or name suffix as units (as set_z3_leaf_modules does); returns how many were marked."""
    marked = _flag_classes(model, classes, True, raise_if_not_found=False) if classes else []
    marked += set_z3_leaf_modules_by_name(model, names, raise_if_not_found=False)[0]
    marked += set_z3_leaf_modules_by_suffix(model, name_suffixes, raise_if_not_found=False)[0]
    return len({id(m) for m in marked if m is not model})


def _unit_roots(model: nn.Module, detect_moe: bool) -> list[tuple[str, nn.Module]]:
    """Modules marked by set_z3_leaf_modules, else the model's repeated blocks; with `detect_moe`,
    the MoE blocks too and no expert list as the repeated blocks. Outermost only, in module order.
    No units when the model itself is marked: then it is one unit, the root (gathered whole from the start
    of forward to the end of backward), so its forward may choose modules differently on each rank."""
    if z3_leaf_module(model):
        return []
    moe = [(n, m) for n, m in find_moe_blocks(model) if m is not model] if detect_moe else []
    marked = [(n, m) for n, m in model.named_modules() if z3_leaf_module(m) and m is not model]
    roots = marked or repeated_blocks(model, skip=inside_blocks(moe))
    if not moe:
        return outermost(roots)
    position = {m: i for i, m in enumerate(model.modules())}
    return sorted(outermost(roots + moe), key=lambda nm: position[nm[1]])

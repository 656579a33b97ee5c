"""Stage 3: parameters, gradients and optimizer states partitioned across ranks.

Each rank keeps only its owned shard of every unit's flat buffers (zero/units.py), plus the fp32
master and optimizer state for that shard. A unit is all-gathered just before its forward and
released after it, gathered again for its backward, and its gradients are reduce-scattered into
the owned gradient shard as soon as they are final. Communication per step is 3Ψ: all-gather in
forward, all-gather in backward, reduce-scatter (design.md §4).

The hooks that gather and release units, prefetch and read ahead, and the pass state they run in
(PassKind) are in zero/stage3_hooks.py ([Note: stage-3 hooks], [Note: the pass state] there); the
NVMe parameter tier is offload/param_swap.py.
"""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn

from zerodp import comm
from zerodp.log import logger, warn_once
from zerodp.memory import DEVICE, NVME, Category, MemoryLedger, add_flat, add_module_states, quantized_numel
from zerodp.offload.cpu import Home
from zerodp.offload.nvme import OPTIMIZER_NVME_PATH_KEY, PARAM_NVME_PATH_KEY
from zerodp.offload.param_swap import ParamSwapper
from zerodp.offload.swap import OptimizerSwapper, SwapSlot, add_optimizer_state, swap_store
from zerodp.precision import first_nonfinite
from zerodp.zero.base import (Fragment, OptimizerFactory, index_of, Piece, Strategy, clip_coefficient, elementwise_state, step_grad,
                             stepping_in, sum_over_ranks_grad_stats)
from zerodp.zero import pairing, quantize
from zerodp.zero.buckets import BucketSequence
from zerodp.zero.flat import trainable_in_registration_order
from zerodp.zero.init import gather_init_param, is_partitioned, release_init_shard
from zerodp.zero.moe import ExpertCalls
from zerodp.zero.quantized_comm import QuantizedReduceScatter
from zerodp.zero.stage12 import MAX_BUCKETS_IN_FLIGHT, check_elementwise
from zerodp.zero.stage3_hooks import PassKind, Stage3Hooks
from zerodp.zero.topology import stage3_partition
from zerodp.zero.trace import UnitTrace
from zerodp.zero.granularity import mark_leaf_modules_by_granularity
from zerodp.zero.units import FlatShard, Unit, UnitState, mark_leaf_modules_from_config, plan_units

FULL_WEIGHTS_HINT = ('Set "zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true} to gather full '
                     "weights on rank 0 (which needs host memory for the whole model; every rank must call), or use "
                     "engine.save_checkpoint() and `zerodp ckpt convert` for a consolidated copy")


_RELEASED_SHAPE = re.compile(r"(?<![\d.])0x\d|\dx0(?![\d.])|\[0\]|\[0, |\(0\)|torch\.Size\(\[0|"
                            r"size 0\b|\b0 elements|shape '?\[0\b")
"""What an error says when a released parameter (shape [0]) reached an operator: "mat1 and mat2 shapes
cannot be multiplied (4x16 and 0x16)", "size of tensor b (0)", "torch.Size([0])", "shape [0]"."""


class Stage3(Stage3Hooks, Strategy):
    """ZeRO stage 3: parameters, gradients and optimizer states partitioned."""

    reduces_every_micro_batch = True

    def wrap(self, module: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> None:
        self.module = module
        self.rank, self.num_ranks = comm.get_rank(), comm.get_world_size()
        zero = self.config.zero_optimization
        self.prefetch_numel = 0 if zero.stage3_allgather_sequential else int(zero.stage3_prefetch_bucket_size)
        self.max_live_numel = int(zero.stage3_max_live_parameters)
        # cheap on gloo; on NCCL a host sync per gather, so only on request (see [Note: prefetch ...])
        self.sanity_checks = zero.enable_sanity_checks or comm.backend() == "gloo"
        trainable_in_registration_order(module, param_groups)  # every optimizer param is the model's
        self.names = {p: n for n, p in module.named_parameters(remove_duplicate=True)}
        self.partition = stage3_partition(int(zero.mics_shard_size), int(zero.zero_hpz_partition_size))
        # ZeRO++ qwZ / qgZ: int8 blocks of quantize.BLOCK_NUMEL elements, 0: exact ([Note: quantized collectives])
        self.weight_block_numel = quantize.BLOCK_NUMEL if zero.zero_quantized_weights else 0
        self.grad_block_numel = quantize.BLOCK_NUMEL if zero.zero_quantized_gradients else 0
        # MiCS: gradient shards are all-reduced across replicas once per step, at the accumulation boundary,
        # where they are on the device (offloaded to the host, NCCL cannot: then every micro-batch, on the device)
        self._replicas_at_boundary = self.partition.num_replicas > 1 and self.home.device == self.device
        self.optim_store = swap_store(zero.offload_optimizer, OPTIMIZER_NVME_PATH_KEY, self.config.aio)
        self.param_store = swap_store(zero.offload_param, PARAM_NVME_PATH_KEY, self.config.aio)
        section = zero.offload_param  # offload_param nvme: the parameter shards' tier (offload/param_swap.py)
        self.param_swapper = None if self.param_store is None else ParamSwapper(
            self.param_store, int(section.max_in_cpu), int(section.buffer_count), int(section.buffer_size))
        self._build_units(module, param_groups)
        self._place_buffers(module)
        module._is_fsdp_managed_module = True  # transformers' generate() then syncs ranks: [Note: paired passes] in zero/pairing.py
        self.optimizer = make_optimizer(self._optimizer_groups(param_groups))
        check_elementwise(self.optimizer, self.config)
        self.swapper = self._swapper(zero.offload_optimizer)
        self._install_hooks()
        self.trace = UnitTrace()
        self._stats: torch.Tensor | None = None
        self.in_flight: list[tuple[Unit, torch.Tensor, torch.Tensor, object]] = []
        self.boundary_reduced = False  # the owned gradient shards hold a whole step's reduced gradient

    # --- set-up ------------------------------------------------------------------------------------

    def _build_units(self, module: nn.Module, param_groups: list[dict]) -> None:
        zero = self.config.zero_optimization
        leaf = zero.leaf_module
        if (leaf.classes or leaf.names or leaf.name_suffixes) and not mark_leaf_modules_from_config(
                module, leaf.classes, leaf.names, leaf.name_suffixes):
            raise ValueError(f"zero_optimization.leaf_module {leaf.model_dump()} matches no module of the model: "
                             "give class names, module names or name suffixes that exist")
        if zero.stage3_module_granularity_threshold:
            mark_leaf_modules_by_granularity(module, int(zero.stage3_module_granularity_threshold))
        # DeepSpeed's default leaf classes are its MoE blocks; zerodp's default is to recognise MoE blocks
        # by structure, and a `classes` list in the config replaces that default too ([Note: MoE blocks ...])
        plan = plan_units(module, int(zero.stage3_param_persistence_threshold),
                          int(zero.stage3_model_persistence_threshold), detect_moe="classes" not in leaf.model_fields_set)
        self.group_of = {p: g for g, group in enumerate(param_groups) for p in group["params"]}
        position = {p: i for i, p in enumerate(module.parameters())}
        # trainable params of a unit ordered by optimizer group: each group is one contiguous range
        key = lambda p: (self.group_of.get(p, -1), position[p])  # noqa: E731
        specs = [(n, m, sorted(ps, key=key), False) for n, m, ps in plan.units]
        if plan.persistent:
            specs.append(("<persistent>", module, sorted(plan.persistent, key=key), True))
        self.units: list[Unit] = []
        for index, (name, m, params, persistent) in enumerate(specs):
            for p in params:
                if not is_partitioned(p):
                    p.ds_shape, p.ds_numel = p.shape, p.numel()
            unit = Unit(index, name, m, params, self.partition, self.policy.param_dtype, self.device,
                        persistent, shard_device=self.param_home.device, offloaded=self.param_home.offload,
                        trains=self.group_of.__contains__, weight_block_numel=self.weight_block_numel)
            self._fill_from_rank0(unit)
            self._init_grad_state(unit)
            self._swap_out(unit)  # NVMe: one unit's shard and master in memory at a time, even here
            self.units.append(unit)
        self.root = self.units[0]
        self.unit_of = {p: u for u in self.units for f in u.flats for p in f.params}
        logger.debug("stage 3 units: %s", [(u.name, u.numel) for u in self.units])

    @torch.no_grad()
    def _fill_from_rank0(self, unit: Unit) -> None:
        """Copy the parameters' values into the full buffers (rank 0's: broadcast, or gathered from
        zero.Init's shards), keep this rank's shard, release."""
        for f in unit.flats:
            from_init = [hasattr(p, "_zerodp_init_shard") for p in f.params]
            for p, view, partitioned in zip(f.params, f.views, from_init):
                view.copy_(gather_init_param(p) if partitioned else p.detach())
                if partitioned:
                    release_init_shard(p)
            if self.num_ranks > 1 and not all(from_init):
                comm.broadcast(f.full, src=0)
        for f in unit.flats:
            for p in f.params:
                p._zerodp_unit = unit
        unit.shard_from_full()

    @torch.no_grad()
    def _place_buffers(self, module: nn.Module) -> None:
        """Buffers stay whole and keep their dtype (as in DeepSpeed 0.19; see flat.prepare_module):
        move, take rank 0's values."""
        for sub in module.modules():
            for name, buf in sub.named_buffers(recurse=False):
                sub._buffers[name] = buf = buf.to(device=self.device)
                if self.num_ranks > 1:
                    comm.broadcast(buf, src=0)

    def _init_grad_state(self, unit: Unit) -> None:
        """Master copy and owned gradient shard of the unit's trainable flat."""
        f = unit.trainable
        if f is None:
            return
        unit.master = self.home.master_of(f.shard, self.policy.master_dtype, copy=self.param_store is not None)
        unit.owned_grad = self.home.zeros(f.layout.shard_numel, self.policy.grad_accum_dtype)
        unit.pieces = _group_pieces(f, self.group_of)  # (group, start, stop) within the owned shard
        unit.piece_views = [unit.master[lo:hi] for _, lo, hi in unit.pieces]  # made before any swap-out

    def _optimizer_groups(self, param_groups: list[dict]) -> list[dict]:
        tensors: list[list[torch.Tensor]] = [[] for _ in param_groups]
        self.optim_pieces_of: dict[Unit, list] = {}
        for unit in self.units:
            for (g, lo, hi), view in zip(unit.pieces, unit.piece_views):
                tensors[g].append(view)
                self.optim_pieces_of.setdefault(unit, []).append((unit, lo, hi, view))
        return [{**g, "params": ts} for g, ts in zip(param_groups, tensors)]

    def _swap_out(self, unit: Unit) -> None:
        """NVMe offload: write the unit's parameter shards (beyond offload_param.max_in_cpu elements)
        and its fp32 master to the swap files and free them (offload/param_swap.py, offload/swap.py)."""
        if self.param_swapper is not None and not unit.keeps_full:
            for f in unit.flats:
                f.slot = self.param_swapper.place(f"{unit.name}/{'trainable' if f is unit.trainable else 'frozen'}",
                                                  f.shard)
        if self.optim_store is not None and unit.master is not None:
            unit.master_slot = SwapSlot(self.optim_store, f"{unit.name}/master", unit.master, unit.piece_views)
            unit.master_slot.write().wait()
            unit.master_slot.evict()

    def _swapper(self, section) -> OptimizerSwapper | None:
        """offload_optimizer.device=nvme: masters and optimizer state in swap files (ZeRO-Infinity)."""
        if self.optim_store is None:
            return None
        self.swapper_units = [u for u in self._trainable() if u.master is not None]
        chunks = [(u.name, u.master_slot, [v for *_, v in self.optim_pieces_of.get(u, [])]) for u in self.swapper_units]
        swapper = OptimizerSwapper(self.optim_store, self.optimizer, chunks, section.buffer_count)
        for i, unit in enumerate(self.swapper_units):
            unit.master_resident = partial(swapper.resident_chunk, i)
        return swapper

    def _install_hooks(self) -> None:
        """The module hooks (zero/stage3_hooks.py), the gradient hooks and the state-dict hook."""
        self._init_pass_hooks()
        trainable = [u for u in self.units if u.trainable is not None]
        # the fixed reduce-scatter order: later blocks first (backward order), root and persistent last
        self.reduce_order = sorted(trainable, key=lambda u: (u.persistent, u is self.root, -u.index))
        self.reduce_slot = {u: k for k, u in enumerate(self.reduce_order)}
        self.sequence = BucketSequence([len(u.trainable.params) for u in self.reduce_order],
                                       lambda k: self._launch_reduce(self.reduce_order[k]))
        for unit in trainable:
            for p in unit.trainable.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.expert_calls = ExpertCalls.inside(self.module, self._in_training_forward)  # [Note: experts a rank ...]
        self.uncalled_params: set[nn.Parameter] = set()  # this backward's: counted final at its start
        self.module._register_state_dict_hook(self._state_dict_hook)

    def _in_training_forward(self) -> bool:
        """Inside a forward whose backward will follow (the root's training forward; a model without
        root hooks runs its forwards in IDLE: then by grad mode), not in a recomputation."""
        kind = self.passes.kind
        return kind is PassKind.TRAINING_FORWARD or (
            kind is PassKind.IDLE and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1)

    # --- backward --------------------------------------------------------------------------------------

    def before_backward(self, boundary: bool) -> None:
        self.passes.begin(PassKind.BACKWARD)
        self._stats = None
        self.trace.begin("backward")
        self.sequence.reset()
        for unit in self.units:
            unit.grads_pending = len(unit.trainable.params) if unit.trainable is not None else 0
        self._count_uncalled_experts()

    def _count_uncalled_experts(self) -> None:
        """The trainable parameters of experts no forward called get no gradient in this backward:
        final now ([Note: experts a rank did not call] in zero/moe.py)."""
        uncalled = [p for e in self.expert_calls.take_uncalled() for p in e.parameters() if p in self.group_of]
        self.uncalled_params = set(uncalled)
        for p in uncalled:
            unit = self.unit_of[p]
            unit.grads_pending -= 1
            self.sequence.grad_ready(self.reduce_slot[unit], self.names.get(p, "?"))

    def _launch_reduce(self, unit: Unit) -> None:
        """Pack the unit's gradients (freeing them) and reduce-scatter them to their owners."""
        f = unit.trainable
        buffer = torch.zeros(f.layout.padded_numel, dtype=self.policy.grad_accum_dtype, device=self.device)
        for p, offset in zip(f.params, f.layout.offsets):
            if p.grad is not None:  # None: unused in this backward
                buffer[offset : offset + p.ds_numel].copy_(p.grad.reshape(-1))
                p.grad = None
        self.note_transient("reduce_buffer", buffer)
        if self.num_ranks == 1:
            Home.accumulate(unit.owned_grad, buffer)
            return
        buffer.mul_(self.grad_mean_factor)  # mean over every replica, divided before the sum as DDP does
        out = torch.empty(f.layout.shard_numel, dtype=buffer.dtype, device=buffer.device)
        if self.grad_block_numel:  # qgZ: int8 pieces by all-to-all, summed in fp32 at the owner
            work = QuantizedReduceScatter(out, buffer, unit.group, self.grad_block_numel)
        else:
            work = comm.reduce_scatter_tensor(out, buffer, group=unit.group, async_op=True)
        self.in_flight.append((unit, out, buffer, work))
        if len(self.in_flight) > MAX_BUCKETS_IN_FLIGHT:
            self._finish_reduce()

    def _finish_reduce(self) -> None:
        unit, out, buffer, work = self.in_flight.pop(0)
        work.wait()
        comm.free_after_wait(buffer)
        if self.partition.num_replicas > 1 and not self._replicas_at_boundary:  # MiCS, offloaded grads
            comm.all_reduce(out, group=self.partition.replica_group)
        Home.accumulate(unit.owned_grad, out)  # to the host first when the optimizer is offloaded

    def after_backward(self, boundary: bool) -> None:
        """Every micro-batch: reduce what is left (unused parameters), release every unit, check
        that all ranks ran the same units."""
        self.sequence.launch_in_order(force=True)
        while self.in_flight:
            self._finish_reduce()
        for unit in self.units:
            unit.release()
            unit.calls_pending = 0
        if boundary and self._replicas_at_boundary:
            for unit in self._trainable():  # MiCS: the step's summed shard, once, across the replicas
                comm.all_reduce(unit.owned_grad, group=self.partition.replica_group)
        self.boundary_reduced = boundary  # the owned shards hold the step's whole gradient
        self.trace.end("backward")
        self.passes.end(PassKind.BACKWARD)
        if not self.sanity_checks:  # else the per-gather checks have run
            pairing.check_same_order(self.trace, self.units)

    def finish_reduction(self) -> None:
        """Nothing to do: every backward has already reduced its gradients."""

    # --- the step --------------------------------------------------------------------------------------

    def _trainable(self) -> list[Unit]:
        return [u for u in self.units if u.trainable is not None]

    def _global_stats(self) -> torch.Tensor:
        if self._stats is None:
            # MiCS: one shard group holds every gradient once (its replicas hold the same)
            self._stats = sum_over_ranks_grad_stats([u.owned_grad for u in self._trainable()], self.device,
                                                    self.partition.shard_group)
        return self._stats

    def found_overflow(self) -> bool:
        return bool(self._global_stats()[1].item() > 0)

    def first_overflow_name(self) -> str | None:
        def named():
            for u in self._trainable():
                f, start = u.trainable, u.trainable.owned.start
                for s in f.layout.slices_in(f.owned.start, f.owned.stop):
                    lo = s.flat_offset - start
                    yield self.names.get(f.params[s.index], "?"), u.owned_grad[lo : lo + s.numel]
        return first_nonfinite(named())

    @torch.no_grad()
    def step(self, loss_scale: float, max_norm: float) -> float:
        held = [u.name for u in self.units if u.holds and not u.keeps_full]
        if held:  # the step updates shards and masters, not the full buffers the block keeps
            raise RuntimeError(f"engine.step() inside zerodp.zero.GatheredParameters(...) (units {held[:3]} are held "
                               "gathered): the update would not reach the gathered parameters; step after the block")
        total_norm, coef = clip_coefficient(float(self._global_stats()[0]), loss_scale, max_norm)
        if self.swapper is None:
            self._step_units(self._trainable(), coef)
        else:  # one unit's master, optimizer state and fp32 gradient in memory at a time
            units = self.swapper_units
            self.swapper.step(lambda i: self._step_units([units[i]], coef))
        self._finish_shard_writes()
        return total_norm

    def _step_units(self, units: list[Unit], coef: float) -> None:
        """The optimizer over these units' pieces (others have no .grad, so torch skips them), then
        their shards republished."""
        grads = {unit: step_grad(self, unit.owned_grad, coef) for unit in units}
        pieces = [(unit, lo, hi, view) for unit in units for (u, lo, hi, view) in self.optim_pieces_of.get(unit, [])]
        with stepping_in(self, [view for *_, view in pieces]):
            for unit, lo, hi, view in pieces:
                view.grad = grads[unit][lo:hi]
            self.optimizer.step()
        for _, _, _, view in pieces:
            view.grad = None
        self._publish(units)

    @torch.no_grad()
    def _publish(self, units: list[Unit]) -> None:
        """Masters -> working shards; units that stay gathered all-gather the new values. With
        NVMe parameter offload a shard is written back in the background while the step goes on
        (offload/param_swap.py); `_finish_shard_writes` waits for the rest."""
        for unit in units:
            f = unit.trainable
            unit.invalidate_secondary()
            if f.slot is not None:
                self.param_swapper.write_back(f.slot, partial(Home.publish, f.shard, unit.master))
            else:
                Home.publish(f.shard, unit.master)
            if unit.keeps_full and unit.num_ranks > 1:
                comm.all_gather_into_tensor(f.full, f.shard, group=unit.group)

    def _finish_shard_writes(self) -> None:
        if self.param_swapper is not None:
            self.param_swapper.finish_writes()

    def zero_grad(self) -> None:
        self._stats = None
        self.boundary_reduced = False
        for unit in self._trainable():
            unit.owned_grad.zero_()
            for p in unit.trainable.params:
                p.grad = None

    # --- the tensor-fragment API -----------------------------------------------------------------------

    def trains(self, param: torch.Tensor) -> bool:
        return param in self.group_of

    def fragment(self, param: torch.Tensor) -> Fragment:
        """The part of `param` inside this rank's owned shard of its unit (zero/layout.py's owned_slice)."""
        unit = self.unit_of[param]
        f = unit.trainable
        s = f.layout.owned_slice(index_of(f.params, param), self.partition.shard_rank)
        lo = s.flat_offset - f.owned.start
        # the optimizer tensor (one per optimizer group in the shard) that holds these elements
        view_lo, view = next(((a, v) for (_, a, b, v) in self.optim_pieces_of.get(unit, []) if a <= lo < b),
                             (lo, unit.master[lo:lo]))
        state = elementwise_state(self.optimizer, view) if s.numel else {}
        tensors = {"master": unit.master[lo : lo + s.numel],
                   **{k: v[lo - view_lo : lo - view_lo + s.numel] for k, v in state.items()}}
        grad = unit.owned_grad[lo : lo + s.numel] if self.boundary_reduced else None
        return Fragment(s.param_offset, s.numel, tensors, grad)

    def fragment_spans(self, param: torch.Tensor) -> list[tuple[int, int]]:
        f = self.unit_of[param].trainable
        index = index_of(f.params, param)
        return [(s.param_offset, s.numel) for s in map(partial(f.layout.owned_slice, index), range(f.layout.num_ranks))]

    def fragment_group(self) -> object | None:
        return self.partition.shard_group

    # --- checkpoints -------------------------------------------------------------------------------------

    def pieces(self, saving: bool) -> list[Piece]:
        if saving and self.partition.replica_index > 0:  # MiCS: the first replica saves the shards
            return []
        return [piece for unit in self._trainable() for piece in self._unit_pieces(unit)]

    def _unit_pieces(self, unit: Unit) -> list[Piece]:
        out = []
        f, start = unit.trainable, unit.trainable.owned.start
        for _, lo, hi, view in self.optim_pieces_of.get(unit, []):
            state = {"master": view.data, **elementwise_state(self.optimizer, view)}
            for s in f.layout.slices_in(start + lo, start + hi):
                a = s.flat_offset - start - lo
                out.append(Piece(self.names[f.params[s.index]], self.group_of[f.params[s.index]], s.param_offset,
                                 s.numel, {k: v[a : a + s.numel] for k, v in state.items()}))
        return out

    def resident_pieces(self, saving: bool):
        if self.swapper is None:
            return super().resident_pieces(saving)
        return self.swapper.resident_pieces(lambda i: self._unit_pieces(self.swapper_units[i]), saving)

    def num_piece_batches(self) -> int:
        return 1 if self.swapper is None else len(self.swapper_units)

    def swap_stores(self) -> dict:
        stores = {"optimizer": self.optim_store, "parameters": self.param_store}
        return {k: v for k, v in stores.items() if v is not None}

    def piece_index(self, rank: int) -> list[tuple[str, int, int]]:
        size = self.partition.shard_size
        if rank >= size:  # MiCS: a replica of rank % size's shards, saved by the first replica only
            return []
        return [(self.names[u.trainable.params[s.index]], s.param_offset, s.numel) for u in self._trainable()
                for s in u.trainable.layout.slices_in(*u.trainable.layout.owned_range(rank))]

    def after_load(self) -> None:
        if self.swapper is None:
            self._publish(self._trainable())
            self._finish_shard_writes()
            return
        for i, unit in enumerate(self.swapper_units):
            with self.swapper.resident_chunk(i, modify=False):
                self._publish([unit])
        self._finish_shard_writes()

    def error_hint(self, error: BaseException) -> str | None:
        text = str(error)
        if text.startswith("ZeRO stage 3:") or not _RELEASED_SHAPE.search(text):
            return None  # not about a released (shape [0]) parameter: a dead peer, a divergence, the user's own
        return ("zerodp ZeRO stage 3: parameters of modules that are not running are released (shape [0]). If the "
                "model uses a parameter outside the forward of the module that owns it, declare it with "
                "zerodp.zero.register_external_parameter(module, param) before initialize(), or read it inside "
                "zerodp.zero.GatheredParameters (docs/stage3.md)")

    def parameter_storages(self) -> list[torch.Tensor]:
        return [f.full for u in self.units for f in u.flats]

    # --- full weights ------------------------------------------------------------------------------------

    @comm.records_to_own_ledger
    def _state_dict_hook(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        """`module.state_dict()`: with stage3_gather_16bit_weights_on_model_save, full parameters on rank 0
        and {} elsewhere (every rank must call it); without it, DeepSpeed's answer: each parameter as
        this rank holds it (empty while its unit is released), with no communication, so a script may
        call it on one rank (DeepSpeed-Chat does before gathering the weights itself)."""
        gathering = self.passes.kind is PassKind.STATE_DICT  # gathered_state_dict(): gather and filter
        keep = self.passes.key_filter if gathering else None
        if keep is not None:
            for k in [k for k in state_dict if not keep(k[len(prefix):])]:
                del state_dict[k]
        if not (gathering or self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save):
            warn_once(f"state_dict() of a ZeRO stage-3 model returns the parameters as this rank holds them (empty "
                      f"tensors while partitioned), as DeepSpeed does. {FULL_WEIGHTS_HINT}")
            return
        aliases: dict[nn.Parameter, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            aliases.setdefault(p, []).append(prefix + name)
        for unit in self.units:
            keys = [(k, p) for f in unit.flats for p in f.params for k in aliases.get(p, []) if k in state_dict]
            if not keys:
                continue
            was_sharded = unit.state is UnitState.SHARDED
            with comm.ledger.outside_step():
                unit.gather(exact=True)
            if self.rank == 0:
                state_dict.update({k: p.detach().to("cpu", copy=True) for k, p in keys})
            if was_sharded:
                unit.release()
        if self.rank != 0:
            state_dict.clear()

    def check_full_weights_allowed(self) -> None:
        """save_16bit_model at stage 3 needs stage3_gather_16bit_weights_on_model_save (RuntimeError)."""
        if not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            raise RuntimeError(f"save_16bit_model() of a ZeRO stage-3 model: each rank holds only shards of the "
                               f"parameters. {FULL_WEIGHTS_HINT}")

    def gathered_state_dict(self, keep=None) -> dict:
        self.passes.begin(PassKind.STATE_DICT)
        self.passes.key_filter = keep
        try:
            return self.module.state_dict()
        finally:
            self.passes.key_filter = None
            self.passes.end(PassKind.STATE_DICT)

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Parameters: each rank writes its owned slice into its shards (the whole value where the
        unit stays gathered); buffers as usual."""
        named = dict(self.module.named_parameters(remove_duplicate=False))
        for name, value in state.items():
            p = named.get(name)
            if p is None:
                continue
            unit = self.unit_of[p]
            unit.invalidate_secondary()  # hpZ: the next gather goes over all ranks
            f = next(f for f in unit.flats if any(q is p for q in f.params))
            offset = f.layout.offsets[next(i for i, q in enumerate(f.params) if q is p)]
            flat_value = value.reshape(-1).to(f.shard.dtype)
            if f.keep_full:
                f.full[offset : offset + p.ds_numel].copy_(flat_value)
                continue
            lo, hi = max(offset, f.owned.start), min(offset + p.ds_numel, f.owned.stop)
            if lo < hi:
                with f.shard_resident(modify=True):
                    f.shard[lo - f.owned.start : hi - f.owned.start].copy_(flat_value[lo - offset : hi - offset])
        super().load_full_state({n: t for n, t in state.items() if n not in named})

    # --- reports -----------------------------------------------------------------------------------------

    def ledger(self) -> MemoryLedger:
        led = MemoryLedger()
        for unit in self.units:
            for f in unit.flats:
                # keeps_full: the full buffer (the shard is a view of it); else the owned shard
                category = Category.PARAM32_MASTER if f.full.dtype == torch.float32 else Category.PARAM16
                if f.slot is not None:
                    four_bit = f.shard.element_size() * quantized_numel(f.params, f.layout.offsets, f.owned.start,
                                                                        f.owned.stop)
                    if four_bit:  # a QLoRA base's 4-bit weights: their own row
                        led.add_bytes(Category.PARAM_4BIT, NVME, four_bit)
                    led.add_bytes(category, NVME, f.slot.num_bytes - four_bit)
                else:
                    tensor, start, tier = (f.full, 0, DEVICE) if f.keep_full else \
                        (f.shard, f.owned.start, self.param_home.tier)
                    add_flat(led, category, tensor, start, f.params, f.layout.offsets, tier)
                if f.secondary is not None:
                    led.add(Category.PARAM_SECONDARY, f.secondary, DEVICE)
            if unit.master is not None and unit.master is not unit.trainable.shard and self.swapper is None:
                led.add(Category.PARAM32_MASTER, unit.master, self.home.tier)
            if unit.owned_grad is not None:
                led.add(Category.GRAD, unit.owned_grad, self.home.tier)
        add_optimizer_state(led, self.optimizer, self.home.tier, self.swapper)
        add_module_states(led, self.module)
        led.transient_peak.update(self.transient_peak)
        return led


def _group_pieces(f: FlatShard, group_of: dict) -> list[tuple[int, int, int]]:
    """(group, start, stop) of each optimizer group's part of this rank's owned shard (relative)."""
    start, stop = f.owned.start, f.owned.stop
    bounds: dict[int, list[int]] = {}
    for p, offset in zip(f.params, f.layout.offsets):
        lo, hi = max(start, offset), min(stop, offset + p.ds_numel)
        if lo < hi:
            b = bounds.setdefault(group_of[p], [lo, hi])
            b[0], b[1] = min(b[0], lo), max(b[1], hi)
    return [(g, lo - start, hi - start) for g, (lo, hi) in bounds.items()]

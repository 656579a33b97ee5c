"""Stages 1 and 2: optimizer states (stage 1) and gradients (stage 2) partitioned across ranks.

Each param group is flattened into one flat parameter buffer (zero/layout.py's `group_layout`);
the module's parameters become views into it. Rank r owns one equal shard of every group: its fp32
master weights and optimizer state exist for that shard only, and the optimizer runs once per
group over it (one tensor per group, so foreach/fused kernels see one flat tensor). After the
step every rank all-gathers the updated shards back into the flat parameter buffers.

[Note: where gradients are reduced]
Stage 1 accumulates full-size gradients in a flat gradient buffer per group (`.grad` are views,
see zero/flat.py) and reduce-scatters each group once, at the accumulation boundary: no
communication between boundaries. Stage 2 keeps only the owned gradient shard: as backward
produces gradients, post-accumulate-grad hooks pack them into buckets of `reduce_bucket_size`
elements (contiguous ranges of a group's flat layout), each bucket's pieces are reduced to the
ranks that own them while backward goes on, and the full-size gradients are freed. Like DeepSpeed,
stage 2 reduces on every micro-batch, so with gradient accumulation it communicates Ψ per
micro-batch instead of once per step: that is the price of never holding full gradients.
`reduce_scatter: false` all-reduces each bucket instead (2x the traffic, DeepSpeed's fallback).

[Note: global norm and overflow]
The gradient norm and the inf/nan flag are computed on each rank's owned shards and combined in
one 2-element all-reduce (sum of squares, overflow count), so every rank takes the same decision.

[Note: NVMe at stages 1 and 2]
With `offload_optimizer.device: nvme` each group's owned master is split into chunks of at most
`sub_group_size` elements (rounded down to a multiple of offload/swap.py's CHUNK_ALIGN_NUMEL, so
fused optimizers round every element as in one tensor), each its own fp32 tensor and its own
optimizer param, written to the swap file as it is made (set-up never holds the whole master). The step runs the chunks through
offload/swap.py's pipeline: read chunk i+1, step chunk i and write its values into the flat
buffer, write chunk i-1 back; `buffer_count` chunks are in memory at most. The optimizer is
element-wise, so splitting changes no number: bitwise equal to CPU offload (tests/test_offload.py).
The reduced gradient shard stays in host memory (stage 2) or on the device (stage 1).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable

import torch
from torch import nn

from zerodp import comm
from zerodp.memory import DEVICE, Category, MemoryLedger, add_module_states, is_quantized
from zerodp.offload.cpu import Home
from zerodp.offload.nvme import OPTIMIZER_NVME_PATH_KEY
from zerodp.offload.swap import OptimizerSwapper, SwapSlot, add_optimizer_state, swap_chunk_numel, swap_store
from zerodp.precision import first_nonfinite
from zerodp.zero.base import (Fragment, OptimizerFactory, index_of, Piece, Strategy, clip_coefficient, elementwise_state, step_grad,
                              stepping_in, sum_over_ranks_grad_stats)
from zerodp.zero.buckets import BucketSequence
from zerodp.zero.flat import FlatGradBuffer, prepare_module, trainable_in_registration_order
from zerodp.zero.layout import Bucket, GroupLayout, assign_buckets, group_layout, owner_pieces

ELEMENTWISE_OPTIMIZERS = frozenset(
    {"SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adadelta", "ASGD"}
)
"""torch optimizers whose update of an element depends only on that element's history, so running
them on a shard is exact. Another class may say it is one with a class attribute
`zerodp_elementwise = True`; the rest need `zero_allow_untested_optimizer: true`."""

MAX_BUCKETS_IN_FLIGHT = 2
"""Stage 2 buckets being reduced at once (double buffering, as DeepSpeed's overlap_comm)."""


class FlatGroup:
    """One param group flattened into `flat_param`; this rank owns `flat_param[owned]`. Its fp32
    master is one tensor, or (NVMe offload) one per chunk of at most `chunk_numel` elements of the
    owned shard, each swapped on its own (see [Note: NVMe at stages 1 and 2])."""

    def __init__(self, params: list[nn.Parameter], layout: GroupLayout, rank: int, dtype: torch.dtype,
                 device: torch.device, make_master: Callable[[torch.Tensor], torch.Tensor],
                 chunk_numel: int | None = None) -> None:
        self.params = params
        self.layout = layout
        self.flat_param = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, offset in zip(params, layout.offsets):
                view = self.flat_param[offset : offset + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view  # the module now computes with the flat buffer
        start, stop = layout.owned_range(rank)
        self.owned = slice(start, stop)
        owned = self.flat_param[self.owned]
        size = chunk_numel or owned.numel()
        self.chunks = [(lo, min(lo + size, owned.numel())) for lo in range(0, owned.numel(), size)]
        views = [owned] if len(self.chunks) == 1 else [owned[lo:hi] for lo, hi in self.chunks]
        # The owned slice is its own master when it has the master's dtype (fp32 training, bf16
        # master weights) and is not offloaded; else a copy.
        self.masters = [make_master(view) for view in views]
        self.separate_master = self.masters[0] is not views[0]
        self.flat_grad: FlatGradBuffer | None = None  # stage 1: full-size accumulation
        self.owned_grad: torch.Tensor | None = None  # stage 1: reduced at the boundary; stage 2: persistent

    def named_owned_grads(self, names: dict) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, its piece of the owned gradient shard), in flat order."""
        start = self.owned.start
        return [(names.get(self.params[s.index], "?"), self.owned_grad[s.flat_offset - start : s.flat_offset - start + s.numel])
                for s in self.layout.slices_in(self.owned.start, self.owned.stop)]

    def write_master(self, k: int) -> None:
        """Write the updated master chunk k into the flat buffer (casting)."""
        if self.separate_master:
            lo, hi = self.chunks[k]
            Home.publish(self.flat_param[self.owned][lo:hi], self.masters[k])

    def all_gather(self, num_ranks: int) -> None:
        """Every rank's updated shard into the flat buffer."""
        if num_ranks > 1:
            comm.all_gather_into_tensor(self.flat_param, self.flat_param[self.owned])  # in place


@dataclass
class _InFlight:
    """A stage-2 bucket whose pieces are being reduced to their owners."""

    group: FlatGroup
    start: int  # flat offset of the bucket in its group
    buffer: torch.Tensor
    works: list


class Stage12(Strategy):
    """What stages 1 and 2 share; stage 1's gradient handling (stage 2 overrides it)."""

    def wrap(self, module: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> None:
        self.module = module
        prepare_module(module, self.policy.param_dtype, self.device)
        self.rank, self.num_ranks = comm.get_rank(), comm.get_world_size()
        order = trainable_in_registration_order(module, param_groups)
        self.position = {p: i for i, p in enumerate(order)}
        self.names = {p: n for n, p in module.named_parameters(remove_duplicate=True)}
        section = self.config.zero_optimization.offload_optimizer
        self.optim_store = swap_store(section, OPTIMIZER_NVME_PATH_KEY, self.config.aio)
        self.master_slots: list[SwapSlot] = []
        self.groups = [self._flat_group(g["params"]) for g in param_groups]
        self.group_of = {p: fg for fg in self.groups for p in fg.params}
        self.chunk_list = [(fg, k) for fg in self.groups for k in range(len(fg.chunks))]  # the optimizer's tensors
        self._init_gradients()
        for p in order:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.optimizer = make_optimizer([{**g, "params": fg.masters} for g, fg in zip(param_groups, self.groups)])
        check_elementwise(self.optimizer, self.config)
        self.swapper = None if self.optim_store is None else OptimizerSwapper(
            self.optim_store, self.optimizer,
            [(slot.name.removesuffix("/master"), slot, [slot.tensor]) for slot in self.master_slots],
            section.buffer_count)
        self._stats: torch.Tensor | None = None

    def _flat_group(self, params: list[nn.Parameter]) -> FlatGroup:
        params = sorted(params, key=self.position.__getitem__)  # flat order = registration order
        layout = group_layout([p.numel() for p in params], self.num_ranks)
        chunk = swap_chunk_numel(int(self.config.zero_optimization.sub_group_size)) if self.optim_store is not None else None
        return FlatGroup(params, layout, self.rank, self.policy.param_dtype, self.device, self._master_of, chunk)

    def _master_of(self, view: torch.Tensor) -> torch.Tensor:
        """The fp32 master of an owned chunk; with NVMe offload written to its swap file and freed
        before the next chunk's is made, so set-up never holds the whole master in host memory."""
        master = self.home.master_of(view, self.policy.master_dtype)
        if self.optim_store is not None:
            slot = SwapSlot(self.optim_store, f"chunk{len(self.master_slots)}/master", master)
            slot.write().wait()
            slot.evict()
            self.master_slots.append(slot)
        return master

    # --- gradients: stage 1 -------------------------------------------------------------------

    def _init_gradients(self) -> None:
        for fg in self.groups:
            fg.flat_grad = FlatGradBuffer(fg.params, list(fg.layout.offsets), fg.layout.padded_numel,
                                          self.policy.grad_accum_dtype, self.device)

    def before_backward(self, boundary: bool) -> None:
        self._stats = None
        self._check_views()
        if self.num_ranks > 1 and self.groups[0].owned_grad is not None:
            # A second backward at this step's boundary (two engine.backward calls for one micro-batch, as
            # DeepSpeed's GAN example makes): the first one's gradients are in the owned shards, and the
            # full buffers, divided in place, restart from zero so that they hold only the new ones.
            for fg in self.groups:
                fg.flat_grad.zero()

    def _check_views(self) -> None:
        """Parameters must still be views of the flat buffers: model.to()/.half()/.float() after
        initialize() replaces them, and training would silently update a buffer nobody reads."""
        for fg in self.groups:
            p = next((q for q in fg.params if q.numel()), None)
            if p is None:
                continue
            lo = fg.flat_param.data_ptr()
            if not lo <= p.data_ptr() < lo + fg.flat_param.numel() * fg.flat_param.element_size():
                raise RuntimeError(
                    f"parameter '{self.names.get(p, '?')}' was replaced after initialize() (model.to(), .half(), "
                    ".float() or an assignment to .data): ZeRO stage 1/2 keeps parameters as views of its flat "
                    "buffers. Cast or move the model before initialize(), or set the dtype in the config")

    @comm.records_to_own_ledger
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self.entering_backward_hook()
        self.group_of[p].flat_grad.fold(p)

    def finish_reduction(self) -> None:
        """Reduce-scatter now if no boundary backward did (no_sync, forced boundary)."""
        if self.groups[0].owned_grad is None:
            self.after_backward(True)

    def after_backward(self, boundary: bool) -> None:
        """At the boundary: reduce-scatter every group's full gradients into the owned shards."""
        if not boundary:
            return
        works = []
        for fg in self.groups:
            full = fg.flat_grad.buffer
            if self.num_ranks == 1:
                fg.owned_grad = full
                continue
            full.mul_(self.grad_mean_factor)  # mean, divided before the sum as DDP does
            shard = torch.empty(fg.layout.shard_numel, dtype=full.dtype, device=full.device)
            self.note_transient("reduced_grad_shard", shard)
            works.append((fg, shard, comm.reduce_scatter_tensor(shard, full, async_op=True)))
        for fg, shard, work in works:
            work.wait()
            fg.owned_grad = shard if fg.owned_grad is None else fg.owned_grad.add_(shard)  # see before_backward

    # --- the step ---------------------------------------------------------------------------------

    def _global_stats(self) -> torch.Tensor:
        """[sum of squares of all owned gradients, number of ranks with inf/nan], same on every rank."""
        if self._stats is None:
            self._stats = sum_over_ranks_grad_stats([fg.owned_grad for fg in self.groups], self.device)
        return self._stats

    def found_overflow(self) -> bool:
        return bool(self._global_stats()[1].item() > 0)

    def first_overflow_name(self) -> str | None:
        return first_nonfinite(piece for fg in self.groups for piece in fg.named_owned_grads(self.names))

    @torch.no_grad()
    def step(self, loss_scale: float, max_norm: float) -> float:
        total_norm, coef = clip_coefficient(float(self._global_stats()[0]), loss_scale, max_norm)
        if self.swapper is None:
            self._step_chunks(range(len(self.chunk_list)), coef)
        else:  # one chunk's master, optimizer state and fp32 gradient in memory at a time
            self.swapper.step(lambda i: self._step_chunks([i], coef))
        for fg in self.groups:
            fg.all_gather(self.num_ranks)
        return total_norm

    def _step_chunks(self, indices: Iterable[int], coef: float) -> None:
        """The optimizer over these master chunks (others have no .grad, so torch skips them), then
        their values written into the flat buffers."""
        chunks = [self.chunk_list[i] for i in indices]
        masters = [fg.masters[k] for fg, k in chunks]
        with stepping_in(self, masters):
            for fg, k in chunks:
                lo, hi = fg.chunks[k]
                fg.masters[k].grad = step_grad(self, fg.owned_grad[lo:hi], coef)
            self.optimizer.step()
        for fg, k in chunks:
            fg.masters[k].grad = None
            fg.write_master(k)

    def zero_grad(self) -> None:
        self._stats = None
        for fg in self.groups:
            fg.flat_grad.zero()
            fg.owned_grad = None

    # --- the tensor-fragment API -----------------------------------------------------------------------

    def trains(self, param: torch.Tensor) -> bool:
        return param in self.group_of

    def fragment(self, param: torch.Tensor) -> Fragment:
        """The part of `param` inside this rank's owned shard (zero/layout.py's owned_slice)."""
        fg = self.group_of[param]
        s = fg.layout.owned_slice(index_of(fg.params, param), self.rank)
        lo = s.flat_offset - fg.owned.start
        master = fg.masters[0]  # one chunk: NVMe offload (chunks) is refused by zero/fragments.py
        state = {"master": master.data, **elementwise_state(self.optimizer, master)}
        grad = fg.owned_grad[lo : lo + s.numel] if self.grads_reduced() else None
        return Fragment(s.param_offset, s.numel, {k: v[lo : lo + s.numel] for k, v in state.items()}, grad)

    def local_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """Stage 1's full-size buffer before the reduce-scatter (stage 2 reduces every backward: None)."""
        flat_grad = self.group_of[param].flat_grad
        accumulated = flat_grad is not None and flat_grad.folded and not self.grads_reduced()
        return flat_grad.view(param) if accumulated else None

    def fragment_spans(self, param: torch.Tensor) -> list[tuple[int, int]]:
        fg = self.group_of[param]
        index = index_of(fg.params, param)
        return [(s.param_offset, s.numel) for s in map(partial(fg.layout.owned_slice, index), range(self.num_ranks))]

    def grads_reduced(self) -> bool:
        """Whether this step's gradients are reduced into the owned shards (after the boundary backward)."""
        return bool(self.groups) and self.groups[0].owned_grad is not None

    # --- checkpoints ------------------------------------------------------------------------------

    def pieces(self, saving: bool) -> list[Piece]:
        """The parameter slices inside this rank's owned shards (the same to save and to load)."""
        return [piece for i in range(len(self.chunk_list)) for piece in self._chunk_pieces(i)]

    def _chunk_pieces(self, i: int) -> list[Piece]:
        fg, k = self.chunk_list[i]
        lo, hi = fg.chunks[k]
        start = fg.owned.start + lo
        state = {"master": fg.masters[k].data, **elementwise_state(self.optimizer, fg.masters[k])}
        return [Piece(self.names[fg.params[s.index]], self.groups.index(fg), s.param_offset, s.numel,
                      {key: v[s.flat_offset - start : s.flat_offset - start + s.numel] for key, v in state.items()})
                for s in fg.layout.slices_in(start, fg.owned.start + hi)]

    def piece_index(self, rank: int) -> list[tuple[str, int, int]]:
        out = []
        for fg in self.groups:
            start = fg.layout.owned_range(rank)[0]
            out += [(self.names[fg.params[s.index]], s.param_offset, s.numel)
                    for lo, hi in fg.chunks for s in fg.layout.slices_in(start + lo, start + hi)]
        return out

    def resident_pieces(self, saving: bool):
        if self.swapper is None:
            return super().resident_pieces(saving)
        return self.swapper.resident_pieces(self._chunk_pieces, saving)

    def num_piece_batches(self) -> int:
        return 1 if self.swapper is None else len(self.chunk_list)

    def swap_stores(self) -> dict:
        return {} if self.optim_store is None else {"optimizer": self.optim_store}

    @torch.no_grad()
    def after_load(self) -> None:
        for i, (fg, k) in enumerate(self.chunk_list):
            with self.swapper.resident_chunk(i, modify=False) if self.swapper is not None else contextlib.nullcontext():
                fg.write_master(k)
        for fg in self.groups:
            fg.all_gather(self.num_ranks)

    # --- reports -------------------------------------------------------------------------------

    def _grad_tensors(self) -> tuple[list[torch.Tensor], str]:
        """The gradient buffers held for the life of training, and their tier."""
        return [fg.flat_grad.buffer for fg in self.groups], DEVICE

    def ledger(self) -> MemoryLedger:
        led = MemoryLedger()
        trainable = set(self.group_of)
        tensors = [fg.flat_param for fg in self.groups] + [p for p in self.module.parameters() if p not in trainable]
        for t in tensors:  # the fp32 params are their own master
            led.add(Category.PARAM_4BIT if is_quantized(t) else Category.PARAM32_MASTER if t.dtype == torch.float32
                    else Category.PARAM16, t)
        led.add(Category.GRAD, *self._grad_tensors())
        if self.swapper is None:  # else the masters are in the swap files
            led.add(Category.PARAM32_MASTER, [m for fg in self.groups if fg.separate_master for m in fg.masters],
                    self.home.tier)
        add_optimizer_state(led, self.optimizer, self.home.tier, self.swapper)
        add_module_states(led, self.module)
        led.transient_peak.update(self.transient_peak)
        return led


class Stage1(Stage12):
    """ZeRO stage 1: optimizer states partitioned."""


class Stage2(Stage12):
    """ZeRO stage 2: optimizer states and gradients partitioned; buckets reduced during backward."""

    reduces_every_micro_batch = True

    def _init_gradients(self) -> None:
        zero = self.config.zero_optimization
        self.use_reduce = zero.reduce_scatter
        for fg in self.groups:
            fg.owned_grad = self.home.zeros(fg.layout.shard_numel, self.policy.grad_accum_dtype)
        # Every group's buckets, the last parameters' first: that is when backward produces them.
        buckets = [(fg, b) for fg in self.groups
                   for b in assign_buckets(list(fg.layout.numels), int(zero.reduce_bucket_size))]
        buckets.sort(key=lambda fb: -self.position[fb[0].params[fb[1].last - 1]])
        self.buckets: list[tuple[FlatGroup, Bucket]] = buckets
        self.bucket_of = {p: k for k, (fg, b) in enumerate(buckets) for p in fg.params[b.first : b.last]}
        self.sequence = BucketSequence([b.last - b.first for _, b in buckets], lambda k: self._launch(*self.buckets[k]))
        self.in_flight: list[_InFlight] = []
        self.boundary_reduced = False  # the owned shards hold a whole step's reduced gradient

    def before_backward(self, boundary: bool) -> None:
        self._stats = None
        self._check_views()
        self.sequence.reset()

    @comm.records_to_own_ledger
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self.entering_backward_hook()
        self.sequence.grad_ready(self.bucket_of[p], self.names.get(p, "?"))

    def _launch(self, fg: FlatGroup, bucket: Bucket) -> None:
        """Pack the bucket's gradients (freeing them), then reduce each owner's piece to its owner."""
        start = fg.layout.offsets[bucket.first]
        stop = fg.layout.offsets[bucket.last - 1] + fg.layout.numels[bucket.last - 1]
        buffer = torch.zeros(stop - start, dtype=self.policy.grad_accum_dtype, device=self.device)
        for p, offset in zip(fg.params[bucket.first : bucket.last], fg.layout.offsets[bucket.first : bucket.last]):
            if p.grad is not None:  # None: unused in this backward
                buffer[offset - start : offset - start + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        self.note_transient("reduce_bucket", buffer)
        works = []
        if self.num_ranks > 1:
            buffer.mul_(self.grad_mean_factor)
            if self.use_reduce:
                works = [comm.reduce(buffer[a - start : b - start], dst=r, async_op=True)
                         for r, a, b in owner_pieces(start, stop, fg.layout.shard_numel)]
            else:
                works = [comm.all_reduce(buffer, async_op=True)]
        self.in_flight.append(_InFlight(fg, start, buffer, works))
        if len(self.in_flight) > MAX_BUCKETS_IN_FLIGHT:
            self._finish(self.in_flight.pop(0))

    def _finish(self, flight: _InFlight) -> None:
        """Wait for a bucket and add this rank's piece into its owned gradient shard."""
        for work in flight.works:
            work.wait()
        fg, start = flight.group, flight.start
        stop = start + flight.buffer.numel()
        for r, a, b in owner_pieces(start, stop, fg.layout.shard_numel):
            if r == self.rank:
                Home.accumulate(fg.owned_grad[a - fg.owned.start : b - fg.owned.start], flight.buffer[a - start : b - start])
        comm.free_after_wait(flight.buffer)

    def after_backward(self, boundary: bool) -> None:
        """Every micro-batch: launch what is left (parameters unused in this backward), wait for all."""
        self.sequence.launch_in_order(force=True)
        while self.in_flight:
            self._finish(self.in_flight.pop(0))
        self.boundary_reduced = boundary  # the owned shards hold the step's whole gradient

    def grads_reduced(self) -> bool:
        return self.boundary_reduced

    def finish_reduction(self) -> None:
        """Nothing to do: every backward has already reduced its gradients."""

    def zero_grad(self) -> None:
        self._stats = None
        self.boundary_reduced = False
        for fg in self.groups:
            fg.owned_grad.zero_()

    def _grad_tensors(self) -> tuple[list[torch.Tensor], str]:
        return [fg.owned_grad for fg in self.groups], self.home.tier


def check_elementwise(optimizer: torch.optim.Optimizer, config) -> None:
    """Refuse optimizers that would compute whole-tensor statistics over a shard."""
    name = type(optimizer).__name__
    if name in ELEMENTWISE_OPTIMIZERS or getattr(type(optimizer), "zerodp_elementwise", False) is True \
            or config.zero_allow_untested_optimizer:
        return
    raise ValueError(
        f"{name} cannot run on ZeRO stage {config.zero_optimization.stage}'s owned shards: each rank updates "
        f"a flat slice that cuts across parameters, which is exact only for element-wise optimizers "
        f"({', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}). Optimizers with whole-tensor statistics (LBFGS, "
        f"Adafactor, Shampoo, Muon) would compute them over the wrong elements. If {name} is element-wise, "
        'set "zero_allow_untested_optimizer": true.'
    )

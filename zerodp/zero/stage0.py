"""Stage 0: plain data parallelism (the DDP baseline) behind the Strategy contract.

Every rank holds full parameters, gradients and optimizer state. Gradients live in one flat
gradient buffer; each parameter's `.grad` is a view into it (`gradient_as_bucket_view` in DDP's
words), so autograd accumulates micro-batches in place and a bucket is a contiguous slice that is
all-reduced without a copy.

[Note: stage-0 layout]
Buckets are launched in index order from post-accumulate-grad hooks on the boundary micro-batch
(zero/buckets.py's [Note: bucket order]). The first layout cuts buckets in registration order and puts the last
bucket first; after the first optimizer step the layout is rebuilt in the order gradients actually became ready on rank 0
(broadcast to all ranks), so buckets fill front to back during backward, as DDP does. Using the same
rule as DDP also gives the same element positions in each all-reduce, which is what makes fp32
results bitwise equal to DDP's at any world size (gloo's ring sums in a position-dependent order).

[Note: stage-0 bucket sizes]
Where a bucket ends decides each element's position in its all-reduce, and with more than two
ranks gloo's ring sums an element in an order set by that position: a model cut into other buckets
than DDP's differs from DDP by an ulp here and there (measured: a 400K-parameter TinyGPT at 4
ranks, whose 1.6 MB of gradients DDP splits into 1 MiB + the rest while a single 5e8-element
bucket held them all, differed in some losses in the last bit from step 4 on, with or without
accumulation; 2 ranks are immune, a + b = b + a). So when the config does not set
`reduce_bucket_size`, stage 0 cuts buckets as DDP does: one bucket before the first step (DDP
without find_unused_parameters), then, re-laid in ready order, DDP's rebuilt buckets (1 MiB, then
25 MiB; layout.py's `assign_buckets_like_ddp`, tested against torch's own assignment). A
`reduce_bucket_size` the user sets caps every bucket at that many elements, as DeepSpeed does.

[Note: mixed precision]
With bf16/fp16 the module's parameters are cast to 16 bits and an fp32 master copy per parameter
is what the optimizer updates. When `data_types.grad_accum_dtype` differs from the parameter dtype
(bf16 params, fp32 accumulation), autograd's 16-bit gradient is added into the fp32 buffer by the
hook and then dropped; otherwise `.grad` is the buffer view. At the step the reduced gradients are
cast once into a transient fp32 buffer for the masters (or used directly when already fp32).

[Note: stage-0 reduction state]
One step's gradient reduction moves through `ReductionState`:
  ACCUMULATING --before_backward(boundary)--> LAUNCHING --after_backward(boundary)--> REDUCED
  --zero_grad--> ACCUMULATING. Off the boundary a backward only folds gradients (ACCUMULATING stays,
  REDUCED stays: a later non-boundary backward does not undo a finished reduction). A step without
  a boundary backward (`no_sync`, a forced boundary) goes ACCUMULATING -> LAUNCHING -> REDUCED in
  `finish_reduction`. A boundary backward may start over LAUNCHING or REDUCED (one unwound by an
  exception, or a second backward before the step). Any other move raises AssertionError.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import nn

from zerodp import comm
from zerodp.memory import Category, MemoryLedger, add_module_states, is_quantized, optimizer_state_tensors
from zerodp.precision import first_nonfinite, has_inf_or_nan
from zerodp.zero.base import Fragment, OptimizerFactory, Piece, Strategy, elementwise_state
from zerodp.zero.flat import FlatGradBuffer, prepare_module, trainable_in_registration_order
from zerodp.zero.buckets import BucketSequence
from zerodp.config.keys import value_at
from zerodp.zero.layout import Bucket, assign_buckets, assign_buckets_like_ddp, flat_offsets


class ReductionState(Enum):
    """Where this optimizer step's gradient all-reduce is (see [Note: stage-0 reduction state])."""

    ACCUMULATING = "accumulating"  # gradients fold into the flat buffer; no bucket is launched
    LAUNCHING = "launching"  # the boundary backward: each bucket is all-reduced as soon as it is full
    REDUCED = "reduced"  # every bucket is all-reduced and waited for: the step may read the gradients


_NEXT_REDUCTION = {
    ReductionState.ACCUMULATING: {ReductionState.ACCUMULATING, ReductionState.LAUNCHING},
    ReductionState.LAUNCHING: {ReductionState.ACCUMULATING, ReductionState.LAUNCHING, ReductionState.REDUCED},
    ReductionState.REDUCED: {ReductionState.REDUCED, ReductionState.LAUNCHING},
}
"""Legal moves of ReductionState other than zero_grad's reset to ACCUMULATING (always legal)."""


class Stage0(Strategy):
    """Data parallelism: bucketed gradient all-reduce overlapped with backward."""

    def wrap(self, module: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> None:
        self.module = module
        prepare_module(module, self.policy.param_dtype, self.device)
        self.params = trainable_in_registration_order(module, param_groups)
        self.names = {p: n for n, p in module.named_parameters(remove_duplicate=True)}
        self.num_ranks = comm.get_world_size()
        bucket_numel, given = value_at(self.config, "zero_optimization.reduce_bucket_size")
        self.bucket_numel: int | None = int(bucket_numel) if given else None  # None: DDP's sizes
        self.layout_final = False  # relaid in rank 0's ready order after the first step
        self._layout(_initial_order(self.params, self.bucket_numel))
        self.ready_order: list[nn.Parameter] = []  # gradient-ready order of the first boundary backward
        self.reduction = ReductionState.ACCUMULATING  # this optimizer step's all-reduce
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.masters = [p.detach().float().clone() for p in self.params] if self.policy.needs_master_copy else None
        self.optimizer = make_optimizer(self._optimizer_groups(param_groups))

    # --- layout ---------------------------------------------------------------------------

    def _layout(self, order: list[nn.Parameter]) -> None:
        """Lay the flat gradient buffer out in `order` and cut it into buckets."""
        self.order = order
        numels = [p.numel() for p in order]
        self.grads = FlatGradBuffer(order, flat_offsets(numels), sum(numels), self.policy.grad_accum_dtype, self.device)
        self.buckets = self._cut_buckets(numels)
        self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in order[bucket.first : bucket.last]}
        self.sequence = BucketSequence([b.last - b.first for b in self.buckets], self._launch)
        self.works: list = []  # all-reduces in flight

    def _cut_buckets(self, numels: list[int]) -> list[Bucket]:
        """The configured bucket size, or DDP's (see [Note: stage-0 bucket sizes])."""
        if self.bucket_numel is not None:
            return assign_buckets(numels, self.bucket_numel)
        if not self.layout_final:  # DDP's first iteration: one bucket
            return assign_buckets(numels, max(sum(numels), 1))
        return assign_buckets_like_ddp(numels, self.grads.buffer.element_size())

    def _rebuild_in_ready_order(self) -> None:
        """After the first step: relayout in rank 0's gradient-ready order (see [Note: stage-0 layout])."""
        ready = list(dict.fromkeys(self.ready_order))  # a parameter once, even after two backwards
        order = ready + [p for p in reversed(self.params) if p not in set(ready)]
        index = {p: i for i, p in enumerate(self.params)}
        rank0_order = torch.tensor([index[p] for p in order], dtype=torch.int64, device=comm.device_for_backend())
        if self.num_ranks > 1:
            with comm.ledger.outside_step():
                comm.broadcast(rank0_order, src=0)
        self.ready_order, self.layout_final = [], True
        mine = comm.get_rank() == 0 or comm.simulated()  # a simulated rank's order stands for rank 0's
        new_order = order if mine else [self.params[i] for i in rank0_order.tolist()]
        if self.bucket_numel is None or any(a is not b for a, b in zip(new_order, self.order)):
            self._layout(new_order)  # DDP's sizes change the cut even in the same order

    # --- backward ---------------------------------------------------------------------------

    def _move(self, state: ReductionState) -> None:
        """Change the reduction state; an illegal move is a broken invariant."""
        if state not in _NEXT_REDUCTION[self.reduction]:
            raise AssertionError(f"rank {comm.get_rank()}: stage 0's reduction cannot go from "
                                 f"{self.reduction.name} to {state.name}")
        self.reduction = state

    def before_backward(self, boundary: bool) -> None:
        if boundary:
            self._move(ReductionState.LAUNCHING)
            self.sequence.reset()
        elif self.reduction is ReductionState.LAUNCHING:  # a boundary backward an exception unwound
            self._move(ReductionState.ACCUMULATING)

    @comm.records_to_own_ledger
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: fold the gradient into the flat buffer, launch ready buckets."""
        self.entering_backward_hook()
        self.grads.fold(p)
        if self.reduction is not ReductionState.LAUNCHING:
            return
        if not self.layout_final:
            self.ready_order.append(p)
        self.sequence.grad_ready(self.bucket_of[p], self.names.get(p, "?"))

    def _launch(self, b: int) -> None:
        """Start bucket b's all-reduce (a slice of the flat buffer: no copy)."""
        if self.num_ranks > 1:
            grads = self.grads.buffer[self.buckets[b].start : self.buckets[b].stop]
            grads.mul_(self.grad_mean_factor)  # mean, divided before the sum as DDP does
            self.works.append(comm.all_reduce(grads, async_op=True))

    def after_backward(self, boundary: bool) -> None:
        """At the boundary: launch what is left (parameters unused in this backward), wait for all."""
        if not boundary:
            return
        self.sequence.launch_in_order(force=True)
        for work in self.works:
            work.wait()
        self.works = []
        self._move(ReductionState.REDUCED)

    def finish_reduction(self) -> None:
        """All-reduce every bucket now if no boundary backward did (no_sync, forced boundary)."""
        if self.reduction is not ReductionState.REDUCED:
            self._move(ReductionState.LAUNCHING)
            self.sequence.reset()
            self.after_backward(True)

    # --- step ---------------------------------------------------------------------------------

    def found_overflow(self) -> bool:
        # Gradients are identical on every rank after the all-reduce, and inf/nan survive the
        # sum, so a local check gives every rank the same answer without a collective.
        return bool(has_inf_or_nan([self.grads.buffer]).item())

    def first_overflow_name(self) -> str | None:
        return first_nonfinite((self.names.get(p, "?"), self.grads.view(p)) for p in self.order)

    @torch.no_grad()
    def step(self, loss_scale: float, max_norm: float) -> float:
        targets, grads = self._step_grads()
        if loss_scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        # Same functions as torch.nn.utils.clip_grad_norm_, so fp32 matches DDP + clip bitwise.
        total_norm = torch.nn.utils.get_total_norm(grads)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(targets, max_norm, total_norm)
        self.optimizer.step()
        if self.masters is not None:
            torch._foreach_copy_(self.params, self.masters)
            for m in self.masters:
                m.grad = None
        return float(total_norm)

    def _step_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The tensors the optimizer updates and their gradients for this step."""
        if self.masters is None:
            self.grads.reset_grads()
            return self.params, [p.grad for p in self.params]
        flat_grad = self.grads.buffer
        grad32 = flat_grad if flat_grad.dtype == torch.float32 else flat_grad.float()
        if grad32 is not flat_grad:
            self.note_transient("step_grad_fp32", grad32)
        for p, m in zip(self.params, self.masters):
            start = self.grads.offsets[p]
            m.grad = grad32[start : start + p.numel()].view_as(m)
        return self.masters, [m.grad for m in self.masters]

    def zero_grad(self) -> None:
        """Zero the flat gradient buffer; after the first reduced step, relay it out once."""
        if self.reduction is ReductionState.REDUCED and not self.layout_final:  # the same step on every rank
            self._rebuild_in_ready_order()
        self.reduction = ReductionState.ACCUMULATING  # always legal: the next step starts over
        self.grads.zero()

    # --- the tensor-fragment API (every rank holds every parameter whole) ------------------------------

    def trains(self, param: torch.Tensor) -> bool:
        return param in self.grads.offsets

    def fragment(self, param: torch.Tensor) -> Fragment:
        """The whole parameter: its master (the parameter itself in fp32), its optimizer state, and its
        all-reduced gradient once the boundary backward has reduced it."""
        target = param if self.masters is None else dict(zip(self.params, self.masters))[param]
        grad = self.grads.view(param).reshape(-1) if self.reduction is ReductionState.REDUCED else None
        return Fragment(0, param.numel(), {"master": target.data.view(-1), **elementwise_state(self.optimizer, target)},
                        grad)

    def local_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        accumulated = self.reduction is ReductionState.ACCUMULATING and self.grads.folded
        return self.grads.view(param) if accumulated else None

    # --- checkpoints ------------------------------------------------------------------------------

    def pieces(self, saving: bool) -> list[Piece]:
        """Every parameter whole; only rank 0 saves (all ranks hold the same)."""
        if saving and comm.get_rank() != 0:
            return []
        targets = self.masters if self.masters is not None else self.params
        group_of = {t: g for g, group in enumerate(self.optimizer.param_groups) for t in group["params"]}
        return [Piece(self.names[p], group_of[t], 0, p.numel(), {"master": t.data.view(-1), **elementwise_state(self.optimizer, t)})
                for p, t in zip(self.params, targets)]

    def piece_index(self, rank: int) -> list[tuple[str, int, int]]:
        return [(self.names[p], 0, p.numel()) for p in self.params] if rank == 0 else []

    def layout_state(self) -> dict:
        """The bucket order after the first step: resuming at 4+ ranks in another order would sum
        gradients in another order (see [Note: stage-0 layout])."""
        return {"order": [self.names[p] for p in self.order], "final": self.layout_final}

    def load_layout_state(self, state: dict | None) -> None:
        by_name = {self.names[p]: p for p in self.params}
        if not state or not state["final"] or set(state["order"]) != set(by_name):
            return  # no layout yet, or another model: rebuild after the first step as usual
        self.ready_order, self.layout_final = [], True
        self._layout([by_name[n] for n in state["order"]])

    @torch.no_grad()
    def after_load(self) -> None:
        if self.masters is not None:
            torch._foreach_copy_(self.params, self.masters)

    def _optimizer_groups(self, param_groups: list[dict]) -> list[dict]:
        """The user's groups over the tensors the optimizer updates (params, or fp32 masters)."""
        if self.masters is None:
            return param_groups
        master_of = dict(zip(self.params, self.masters))
        return [{**g, "params": [master_of[p] for p in g["params"]]} for g in param_groups]

    def ledger(self) -> MemoryLedger:
        led = MemoryLedger()
        for p in self.module.parameters():  # trainable and frozen; the fp32 params are their own master
            led.add(Category.PARAM_4BIT if is_quantized(p) else Category.PARAM32_MASTER if p.dtype == torch.float32
                    else Category.PARAM16, p)
        if self.masters is not None:
            led.add(Category.PARAM32_MASTER, self.masters)
        led.add(Category.GRAD, self.grads.buffer)
        led.add(Category.OPTIM_STATE, optimizer_state_tensors(self.optimizer))
        add_module_states(led, self.module)
        led.transient_peak.update(self.transient_peak)
        return led


def _initial_order(params: list[nn.Parameter], bucket_numel: int | None) -> list[nn.Parameter]:
    """Before any gradient was seen: buckets cut in registration order, the last bucket first
    (DDP's initial layout; gradients of the last layers come first in backward). `bucket_numel`
    None: one bucket, as DDP's first iteration."""
    if bucket_numel is None:
        return list(params)
    buckets = assign_buckets([p.numel() for p in params], bucket_numel)
    return [p for b in reversed(buckets) for p in params[b.first : b.last]]

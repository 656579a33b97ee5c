"""Stage 3's forward and backward hooks, prefetch and NVMe read-ahead, and the pass they run in.

[Note: stage-3 hooks]
- forward pre-hook: gather the unit (or wait for its prefetch), prefetch the next units of the
  recorded order, and route the inputs that need grad through `_PostBackward`;
- forward hook: register a pre-backward hook on the outputs that need grad (it gathers the unit
  again when backward reaches them), then release the unit; the root unit stays gathered until
  the end of backward (FSDP2's root);
- post-accumulate-grad hook per trainable parameter: when all of a unit's gradients are final,
  its reduce-scatter is launched, in a fixed unit order on every rank (zero/buckets.py);
- forward hooks that run during backward (activation checkpointing's recomputation) only make
  sure the unit is gathered: no release, no trace, no new backward hooks;
- a submodule of a unit called on its own while the unit is released (`model.embed(ids)` outside
  the model's forward) gathers the unit around that call.

[Note: when a unit is released in backward]
Once backward has computed the gradients of every input of every call of the unit
(`calls_pending` = 0) and every trainable parameter's gradient is final (`grads_pending` = 0),
nothing in backward reads its parameters any more. A unit whose inputs need no grad (the first
block of a LoRA model) or with a parameter unused in this backward stays gathered until the end
of backward, when every unit is released.

[Note: prefetch and the recorded order]
The first forward and backward record the order units run in (`UnitTrace`). Later passes follow
that order and, after gathering unit i, start the all-gathers of the next units while the
compute runs: at most `stage3_prefetch_bucket_size` elements ahead and never more than
`stage3_max_live_parameters` gathered at once. A pass that runs units in another order (a branch
taken on some steps only) stops prefetching at the first difference and its order is recorded
for the next pass, so a prefetch never waits for a unit that does not come. Every rank makes the
same decisions because they run the same units. Ranks that run different modules must not pair up
the wrong gathers: on gloo (where it is cheap) and with `zero_optimization.enable_sanity_checks`
every gather is preceded by a 16-byte all-gather of the unit's index and the kind of pass, and
ranks about to gather different units raise naming them. On NCCL without sanity checks that would
cost a host sync per gather, so a hash of the order is compared at the end of every backward
instead: it catches divergences whose collectives still pair up one to one (same-size units in
another order); one that changes the sequence of collectives waits in a collective until the timeout.
The checks are in zero/pairing.py.

[Note: the pass state]
A Stage3 strategy is in one `PassKind` at a time (`self.passes.kind`), moved only by PassState's
named transitions, which raise AssertionError (rank, both kinds) on an illegal move:
- `begin(kind)`: the root's forward pre-hook begins TRAINING_FORWARD, NO_GRAD_FORWARD or HELD;
  `before_backward` begins BACKWARD; `gathered_state_dict` begins STATE_DICT. Legal from IDLE, and
  over a forward or backward that is still open because an exception skipped the hook that closes
  it (module hooks get no word of an exception; the engine drops its backward without
  `after_backward`). BACKWARD also begins over RECOMPUTE (a recomputation came before the first
  gradient hook of a backward the engine did not start). Nothing begins inside STATE_DICT.
- `end(kind)`: the root's forward hook ends the forward kind it began, `gathered_state_dict` ends
  STATE_DICT, `after_backward` ends BACKWARD or RECOMPUTE; each back to IDLE.
- `recompute()`: a forward hook while autograd's engine runs moves to RECOMPUTE (from BACKWARD,
  RECOMPUTE, IDLE or an open forward, never from STATE_DICT or HELD); a recomputation may stop
  early (torch's checkpoint stops once it has what it needs) and skip its forward hooks, so
  RECOMPUTE is left by the next backward hook (`backward_hook()`, back to BACKWARD), not by them.
Keeping units gathered through one `generate()` (engine.generation()) is a modifier of the no-grad
forwards inside the block (`PassState.keep_alive`), not a kind of its own. A model whose root unit
is never released (one rank; or every parameter in a block or persistent) has no root hooks: its
forwards run in IDLE.

[Note: recomputation is recognised by autograd's engine]
A forward hook cannot tell from the strategy's own state that autograd's engine called it (a
checkpointed block recomputed in backward): the first event of a `loss.backward()` the engine did
not start may be that recomputation, before any gradient hook opened the pass. So the forward hooks
(and only they: `_forward_call_kind`) ask torch whether a backward runs on this thread; everything
after that reads `self.passes`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from zerodp import comm
from zerodp.log import logger
from zerodp.zero import pairing
from zerodp.zero.units import Unit, UnitState

_eager = torch.compiler.disable  # hooks run outside a compiled module's graph (engine.compile)


class PassKind(Enum):
    """Which pass stage 3's hooks run in (see [Note: the pass state])."""

    IDLE = "idle"  # between passes
    TRAINING_FORWARD = "training forward"  # the root's forward with grad enabled
    NO_GRAD_FORWARD = "no-grad forward"  # the root's forward without grad (evaluation, generation)
    RECOMPUTE = "recompute"  # activation checkpointing's re-forward, inside a backward
    BACKWARD = "backward"  # between before_backward and after_backward
    HELD = "held"  # a no-grad forward with every unit held (GatheredParameters): nothing to gather
    STATE_DICT = "state-dict gather"  # gathered_state_dict(): module.state_dict() gathers full weights


FORWARD_KINDS = frozenset({PassKind.TRAINING_FORWARD, PassKind.NO_GRAD_FORWARD, PassKind.HELD})
_OPEN_AFTER_ERROR = FORWARD_KINDS | {PassKind.BACKWARD, PassKind.RECOMPUTE}
"""Kinds an exception can leave current: the next pass begins over them."""
_ENDS = {PassKind.TRAINING_FORWARD: {PassKind.TRAINING_FORWARD}, PassKind.NO_GRAD_FORWARD: {PassKind.NO_GRAD_FORWARD},
         PassKind.HELD: {PassKind.HELD}, PassKind.STATE_DICT: {PassKind.STATE_DICT},
         PassKind.BACKWARD: {PassKind.BACKWARD, PassKind.RECOMPUTE}}
"""end(kind) is legal from these kinds (a backward may end inside an early-stopped recomputation)."""
_RECOMPUTE_FROM = frozenset({PassKind.IDLE, PassKind.BACKWARD, PassKind.RECOMPUTE, PassKind.TRAINING_FORWARD,
                             PassKind.NO_GRAD_FORWARD})
_PAIRING_KIND = {PassKind.NO_GRAD_FORWARD: 0, PassKind.TRAINING_FORWARD: 1, PassKind.RECOMPUTE: 2,
                 PassKind.BACKWARD: 2}
"""The index in pairing.PASS_KINDS that ranks compare before a gather (a recomputation is backward)."""


@dataclass
class KeepAlive:
    """engine.generation(): units a no-grad forward keeps gathered, within a budget of elements."""

    budget_numel: int
    kept: list[Unit] = field(default_factory=list)


class PassState:
    """The current PassKind of one Stage3 strategy and its legal moves."""

    def __init__(self) -> None:
        self.kind = PassKind.IDLE
        self.keep_alive: KeepAlive | None = None  # inside engine.generation()
        self.key_filter = None  # STATE_DICT: which state-dict keys to keep (None: all)

    def _illegal(self, move: str, to: PassKind) -> AssertionError:
        return AssertionError(f"rank {comm.get_rank()}: stage 3 cannot {move} {to.name} while in {self.kind.name}")

    def begin(self, kind: PassKind) -> None:
        """Begin a forward, a backward or a state-dict gather (see [Note: the pass state])."""
        if kind not in _ENDS or not (self.kind is PassKind.IDLE or self.kind in _OPEN_AFTER_ERROR):
            raise self._illegal("begin", kind)
        if self.kind is not PassKind.IDLE and not (kind is PassKind.BACKWARD and self.kind is PassKind.RECOMPUTE):
            logger.debug("stage 3: %s begins over an unfinished %s (an exception unwound it)", kind.value,
                         self.kind.value)
        self.kind = kind

    def end(self, kind: PassKind) -> None:
        """End the pass `kind` began: back to IDLE."""
        if self.kind not in _ENDS.get(kind, ()):
            raise self._illegal("end", kind)
        self.kind = PassKind.IDLE

    def recompute(self) -> None:
        """A forward hook inside a backward: activation checkpointing recomputes."""
        if self.kind not in _RECOMPUTE_FROM:
            raise self._illegal("enter", PassKind.RECOMPUTE)
        self.kind = PassKind.RECOMPUTE

    def backward_hook(self) -> None:
        """A gradient hook of an open backward: a recomputation before it is over."""
        if self.kind not in (PassKind.BACKWARD, PassKind.RECOMPUTE):
            raise self._illegal("run a backward hook of", PassKind.BACKWARD)
        self.kind = PassKind.BACKWARD


def _autograd_is_running() -> bool:
    """True while autograd's engine runs a backward on this thread: see [Note: recomputation is
    recognised by autograd's engine]."""
    return torch._C._current_graph_task_id() != -1


class Stage3Hooks:
    """The module and gradient hooks of Stage3 (mixed into it: they read its units and budgets)."""

    units: list[Unit]
    root: Unit
    passes: PassState

    def _init_pass_hooks(self) -> None:
        """The pass state and the module hooks (wrap() calls it once)."""
        self.passes = PassState()
        self.forward_hooks: list[RemovableHandle] = []  # the units' module hooks (install_forward_hooks)
        # per call of a unit's submodule on its own (nested calls nest): did that call gather the unit
        self._alone_gathered: list[bool] = []
        self.install_forward_hooks()

    def install_forward_hooks(self) -> None:
        """(Re)register the module hooks that gather a unit before its forward and release it after.
        Code that holds every unit (GatheredParameters over all parameters) may remove them meanwhile
        (`remove_forward_hooks`; TRL does this around generation) and must install them again after."""
        self.remove_forward_hooks()
        for unit in self.units:
            if unit.keeps_full:
                continue
            self.forward_hooks += [
                unit.module.register_forward_pre_hook(_eager(partial(self._pre_forward, unit)), with_kwargs=True),
                unit.module.register_forward_hook(_eager(partial(self._post_forward, unit)))]
            members = {p for f in unit.flats for p in f.params}
            for m in unit.module.modules():  # submodules called on their own: see [Note: stage-3 hooks]
                if m is not unit.module and any(p in members for p in m.parameters(recurse=False)):
                    self.forward_hooks += [m.register_forward_pre_hook(_eager(partial(self._pre_forward_alone, unit))),
                                           m.register_forward_hook(_eager(partial(self._post_forward_alone, unit)))]

    def remove_forward_hooks(self) -> None:
        """Remove the hooks install_forward_hooks registered (the units must stay held meanwhile)."""
        for handle in self.forward_hooks:
            handle.remove()
        self.forward_hooks = []

    # --- forward ---------------------------------------------------------------------------------------

    def _forward_call_kind(self) -> PassKind:
        """What this forward hook's call is: RECOMPUTE (moving the pass there) or a forward by grad mode."""
        if _autograd_is_running():  # see [Note: recomputation is recognised by autograd's engine]
            self.passes.recompute()
            return PassKind.RECOMPUTE
        if self.passes.kind in (PassKind.BACKWARD, PassKind.RECOMPUTE):  # that backward was unwound by an error
            self.passes.end(PassKind.BACKWARD)
        return PassKind.TRAINING_FORWARD if torch.is_grad_enabled() else PassKind.NO_GRAD_FORWARD

    @comm.records_to_own_ledger
    def _pre_forward(self, unit: Unit, module: nn.Module, args: tuple, kwargs: dict):
        kind = self._forward_call_kind()
        if kind is PassKind.RECOMPUTE:  # see [Note: stage-3 hooks]
            self._gather(unit, kind)
            return None
        if unit is self.root:  # a no-grad pass with every unit held by GatheredParameters (generate()) is HELD
            held = kind is PassKind.NO_GRAD_FORWARD and all(u.holds or u.keeps_full for u in self.units)
            self.passes.begin(PassKind.HELD if held else kind)
        if self.passes.kind is PassKind.HELD:  # nothing to gather, prefetch, release or trace
            return None
        if unit is self.root:
            if not self.sanity_checks:  # else the per-gather check compares the passes
                pairing.check_same_kind_of_forward(_PAIRING_KIND[kind])
            self.trace.begin("forward")
        following = self.trace.visit("forward", unit.index)
        self._gather(unit, kind)
        if following:
            self._prefetch("forward", kind)
        if torch.is_grad_enabled():
            return self._route_through_post_backward(unit, args, kwargs)
        return None

    def _route_through_post_backward(self, unit: Unit, args: tuple, kwargs: dict):
        leaves, spec = tree_flatten((args, kwargs))
        needing = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not needing:
            return None
        unit.calls_pending += 1
        outs = _PostBackward.apply(partial(self._post_backward, unit), *[leaves[i] for i in needing])
        for i, out in zip(needing, outs if isinstance(outs, tuple) else (outs,)):
            leaves[i] = out
        return tree_unflatten(leaves, spec)

    @comm.records_to_own_ledger
    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple, output):
        if self.passes.kind is PassKind.HELD:
            if unit is self.root:  # the pass is over
                self.passes.end(PassKind.HELD)
            return None
        if self.passes.kind is PassKind.RECOMPUTE:
            return None
        if self.passes.keep_alive is not None and not torch.is_grad_enabled():
            self._keep_for_generation(unit)
        if torch.is_grad_enabled():
            self._hook_pre_backward(unit, output)
        if unit is not self.root:
            unit.release()
            return None
        self.trace.end("forward")
        for other in self.units:  # prefetches that the pass did not use
            if other is not self.root:
                other.release()
        if not torch.is_grad_enabled():
            self.root.release()
        self.passes.end(PassKind.TRAINING_FORWARD if self.passes.kind is PassKind.TRAINING_FORWARD
                        else PassKind.NO_GRAD_FORWARD)
        return None

    def _hook_pre_backward(self, unit: Unit, output) -> None:
        """Gather `unit` again when backward reaches the outputs of this call that need grad."""
        needing = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if needing:
            torch.autograd.graph.register_multi_grad_hook(needing, partial(self._pre_backward, unit), mode="any")

    @property
    def _kept(self) -> list[Unit] | None:
        """The units engine.generation() holds now (None outside the block)."""
        return None if self.passes.keep_alive is None else self.passes.keep_alive.kept

    @contextlib.contextmanager
    def generation(self, max_live_numel: int) -> Iterator[None]:
        """Inside the block, a unit gathered by a forward without grad stays gathered (held, as by
        GatheredParameters) while the kept units total at most `max_live_numel` elements; the others
        gather per forward as usual. Every kept unit is released at exit."""
        if self.passes.keep_alive is not None:
            raise RuntimeError("engine.generation() blocks do not nest")
        self.passes.keep_alive = KeepAlive(max_live_numel)
        try:
            yield
        finally:
            kept, self.passes.keep_alive = self.passes.keep_alive.kept, None
            for unit in kept:
                unit.holds -= 1
                unit.release()

    def _keep_for_generation(self, unit: Unit) -> None:
        """Hold `unit` for the rest of the generation block if the budget allows (the same decision on
        every rank: they run the same units in the same order)."""
        keep = self.passes.keep_alive
        if unit.keeps_full or unit.holds or sum(u.numel for u in keep.kept) + unit.numel > keep.budget_numel:
            return
        unit.holds += 1
        keep.kept.append(unit)

    @comm.records_to_own_ledger
    def _pre_forward_alone(self, unit: Unit, module: nn.Module, args: tuple) -> None:
        """A submodule of a released unit called outside the unit's forward: gather around it."""
        if unit.holds and not torch.is_grad_enabled():  # gathered by GatheredParameters: nothing to do
            return
        kind = self._forward_call_kind()
        gather = unit.state is UnitState.SHARDED
        if kind is not PassKind.RECOMPUTE:  # a recomputation may stop before the forward hook: no record
            self._alone_gathered.append(gather)
        if gather:
            self._gather(unit, kind)

    @comm.records_to_own_ledger
    def _post_forward_alone(self, unit: Unit, module: nn.Module, args: tuple, output) -> None:
        if unit.holds and not torch.is_grad_enabled():
            return
        if self.passes.kind is PassKind.RECOMPUTE or not self._alone_gathered.pop():
            return
        if torch.is_grad_enabled():
            self._hook_pre_backward(unit, output)
        unit.release()

    # --- backward --------------------------------------------------------------------------------------

    def _entering_backward_hook(self) -> None:
        """First call of every gradient hook: open the pass if the engine did not, leave a recomputation."""
        self.entering_backward_hook()
        self.passes.backward_hook()

    @comm.records_to_own_ledger
    def _pre_backward(self, unit: Unit, grad) -> None:
        self._entering_backward_hook()
        following = self.trace.visit("backward", unit.index)
        self._gather(unit, PassKind.BACKWARD)
        if following:
            self._prefetch("backward", PassKind.BACKWARD)

    @comm.records_to_own_ledger
    def _post_backward(self, unit: Unit) -> None:
        if self.passes.kind is PassKind.RECOMPUTE:
            self.passes.backward_hook()
        unit.calls_pending -= 1
        self._release_if_done(unit)

    @comm.records_to_own_ledger
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self._entering_backward_hook()
        if p in self.uncalled_params:
            raise RuntimeError(f"ZeRO stage 3: '{self.names.get(p, '?')}' received a gradient although no forward "
                               "called its expert module since the last backward, so its gradient was counted as "
                               "zero; a mixture-of-experts block must call an expert module whenever it uses "
                               "that expert's weights (zerodp.zero.moe's [Note: experts a rank did not call])")
        unit = self.unit_of[p]
        unit.grads_pending -= 1
        self.sequence.grad_ready(self.reduce_slot[unit], self.names.get(p, "?"))
        self._release_if_done(unit)

    def _release_if_done(self, unit: Unit) -> None:
        """See [Note: when a unit is released in backward]."""
        if unit.calls_pending == 0 and unit.grads_pending == 0:
            unit.release()

    # --- gathering -------------------------------------------------------------------------------------

    def _gather(self, unit: Unit, kind: PassKind) -> None:
        if unit.state is UnitState.SHARDED and self.sanity_checks:
            pairing.check_same_unit(self.units, unit, _PAIRING_KIND[kind])
        unit.gather()
        self._note_live()

    def _prefetch(self, phase: str, kind: PassKind) -> None:
        """Start the all-gathers of the next units in the recorded order, within the budgets."""
        live = sum(u.numel for u in self.units if u.state is not UnitState.SHARDED and not u.keeps_full)
        ahead = 0
        for index in self.trace.upcoming(phase):
            unit = self.units[index]
            if unit.state is not UnitState.SHARDED:
                continue
            if ahead + unit.numel > self.prefetch_numel or live + unit.numel > self.max_live_numel:
                break
            if self.sanity_checks:
                pairing.check_same_unit(self.units, unit, _PAIRING_KIND[kind])
            unit.start_gather()
            ahead += unit.numel
            live += unit.numel
        self._note_live()
        if self.param_swapper is not None:
            self._read_ahead(phase)

    def _read_ahead(self, phase: str) -> None:
        """NVMe parameter offload: read the swapped shards of the next units before their gathers,
        within the swapper's buffer pool (offload/param_swap.py), so the disk works while several
        units compute."""
        count_left, numel_left = self.param_swapper.read_ahead_room(
            [u.swapped_numel for u in self.units if u.reading_ahead])
        for index in self.trace.upcoming(phase):
            unit = self.units[index]
            if unit.state is not UnitState.SHARDED or unit.reading_ahead or not unit.swapped_numel:
                continue
            if count_left < 1 or unit.swapped_numel > numel_left:
                break
            unit.read_ahead()
            count_left -= 1
            numel_left -= unit.swapped_numel

    def _note_live(self) -> None:
        live = sum(u.held_full_bytes() for u in self.units)
        self.transient_peak["gathered_params"] = max(self.transient_peak.get("gathered_params", 0), live)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward reached all of them."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)

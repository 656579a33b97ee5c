"""Mixture-of-experts blocks at stage 3: recognised by their structure, gathered whole.

[Note: MoE blocks are gathered whole]
A mixture-of-experts block routes each token to a few of its experts, so two ranks with different
data call different experts. If each expert were a unit of its own, rank 0 would all-gather expert 2
while rank 1 all-gathers expert 3 (or nothing): their collectives pair up wrongly and training hangs
or stops with an error (DeepSpeed #7461, transformers #39275). So every rank gathers every expert of
a block whatever its routing: the block's parameters are always in one unit. A block is recognised
by structure, not by class name:
- a module with a direct child `nn.ModuleList` of >= 2 experts that are structurally identical
  (same class, same parameter names and shapes) MLPs (>= 2 weight matrices, no ModuleList of
  their own: not a stack of layers);
- and a router beside it: a direct child named `gate`, `router` or `gating`, or a direct child
  `nn.Linear`, holding a matrix of one row per expert over the experts' input size (a Linear from
  the hidden size to one logit per expert; DeepSeek's `MoEGate.weight`).
That covers DeepSeek-V2/V3's remote code, Mixtral and Qwen-MoE of older transformers releases,
Switch/NLLB-style routers and most hand-written MoE layers. transformers 5 stores the experts of
its own MoE models as one fused module, which is one module anyway.

Units then come from the model's repeated blocks with every expert list left out of the choice
(zero/units.py's [Note: choosing units]): the decoder layers become the units, each holding its
MoE block whole; a MoE block outside every repeated block becomes a unit of its own. Setting
`zero_optimization.leaf_module.classes` (DeepSpeed's key, whose default in DeepSpeed 0.19 is its
list of MoE block classes) replaces the detection, as it replaces DeepSpeed's defaults:
`"leaf_module": {"classes": []}` turns it off.

A model that still diverges (a router this does not recognise) gets the pairing error with the
line to add: `leaf_hint` names the class that holds the diverging modules in a ModuleList.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

ROUTER_NAMES = ("gate", "router", "gating")
"""Names of a MoE block's router child (DeepSeek, Mixtral, Qwen-MoE: `gate`; Switch, OLMoE forks: `router`)."""


def _shape(p: nn.Parameter) -> tuple[int, ...]:
    """The full shape, also of a parameter stage 3 has partitioned (`ds_shape`)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def _signature(module: nn.Module) -> tuple:
    """What makes two experts "structurally identical": class, parameter names and shapes."""
    return (type(module), tuple((n, _shape(p)) for n, p in module.named_parameters()))


def _expert_list(module: nn.Module) -> nn.ModuleList | None:
    """The first direct child ModuleList of >= 2 identical experts, each an MLP (>= 2 weight
    matrices) and not a stack (no ModuleList inside)."""
    for child in module.children():
        if not isinstance(child, nn.ModuleList) or len(child) < 2:
            continue
        experts = list(child)
        first = _signature(experts[0])
        if (sum(len(shape) == 2 for _, shape in first[1]) >= 2 and all(_signature(e) == first for e in experts[1:])
                and not any(isinstance(m, nn.ModuleList) for e in experts for m in e.modules())):
            return child
    return None


def _has_router(module: nn.Module, num_experts: int, experts: nn.ModuleList) -> bool:
    """A direct child named like a router, or a Linear, holding a matrix of `num_experts` rows
    that reads what the experts read (its columns: the experts' first matrix's input size)."""
    expert_input = next(_shape(p)[1] for p in experts[0].parameters() if len(_shape(p)) == 2)
    for name, child in module.named_children():
        if child is experts or not (name in ROUTER_NAMES or isinstance(child, nn.Linear)):
            continue
        if any(_shape(p) == (num_experts, expert_input) for p in child.parameters()):
            return True
    return False


def is_moe_block(module: nn.Module) -> bool:
    """Whether `module` is a mixture-of-experts block (see [Note: MoE blocks are gathered whole])."""
    experts = _expert_list(module)
    return experts is not None and _has_router(module, len(experts), experts)


def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every MoE block of `model`, outermost only, in module order."""
    found = [(n, m) for n, m in model.named_modules() if is_moe_block(m)]
    return outermost(found)


def outermost(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules of the list not inside another one of the list (each module once, in order)."""
    inside = {sub for _, m in modules for sub in list(m.modules())[1:]}
    kept, seen = [], set()
    for name, m in modules:
        if m not in inside and m not in seen:
            seen.add(m)
            kept.append((name, m))
    return kept


def inside_blocks(blocks: list[tuple[str, nn.Module]]) -> set[nn.Module]:
    """Every module of the blocks' subtrees, the blocks included."""
    return {sub for _, m in blocks for sub in m.modules()}


def leaf_hint(model: nn.Module, unit_names: list[str]) -> str:
    """The line that makes the diverging units' container one unit, or "" when none fits.

    For each unit name (a module path in `model`), the nearest module above it that is an element
    of an nn.ModuleList of structurally identical experts (no ModuleList inside: not a stack of
    layers) is an expert; the list's owner is the class to mark, unless it is the model itself."""
    classes: list[str] = []
    for name in unit_names:
        owner = _list_owner(model, name)
        if owner is not None and type(owner).__name__ not in classes:
            classes.append(type(owner).__name__)
    if not classes:
        return ""
    listed = ", ".join(classes)
    return (f" If these are the experts of a mixture-of-experts block that routes tokens differently on each rank, "
            f"make the block one unit before zerodp.initialize: `deepspeed.utils.set_z3_leaf_modules(model, "
            f"[{listed}])` (or zerodp.zero.set_z3_leaf_modules), or list it in the config: "
            f'"zero_optimization": {{"leaf_module": {{"classes": {[*classes]}}}}}'.replace("'", '"'))


def _list_owner(model: nn.Module, name: str) -> nn.Module | None:
    """The module holding the ModuleList that `name` (or its nearest ancestor in one) is an element of."""
    parts = name.split(".") if name and not name.startswith("<") else []
    while len(parts) >= 3:  # owner . list . index
        try:
            container = model.get_submodule(".".join(parts[:-1]))
        except AttributeError:
            return None
        if isinstance(container, nn.ModuleList):
            owner = model.get_submodule(".".join(parts[:-2]))
            return None if owner is model or _expert_list(owner) is not container else owner
        parts = parts[:-1]
    return None


class ExpertCalls:
    """Which experts of the MoE blocks inside stage-3 units each training forward called, so that
    backward can count the parameters of the others as final at once.

    [Note: experts a rank did not call]
    A unit's gradients are reduce-scattered when all of them are final, in one fixed unit order on
    every rank (zero/buckets.py's [Note: bucket order]). An expert that received no token on this
    rank produces no gradient here, so without help its unit would stay FILLING until the end of
    backward while another rank, whose tokens did reach that expert, launches the unit's
    reduce-scatter and goes on to gather the next unit: the two ranks' collectives no longer pair
    up and they wait on each other. DDP's `find_unused_parameters` solves this by walking the
    autograd graph after every forward; here the MoE block's own dispatch says it: an expert the
    block did not call has no gradient in this backward. Only experts of a block that called at
    least one of them count (a block that uses its experts' weights without calling them, a fused
    or stacked implementation, uses them all). Calls count inside a training forward (grad enabled
    at the model's forward, also where reentrant checkpointing runs a block without grad), not in
    an evaluation forward nor in a recomputation during backward. Leaf modules (set_z3_leaf_modules) holding a list of identical experts are watched too,
    their router recognised or not, with the detection on or off: a block gathered whole needs it
    either way. A gradient that arrives for such a parameter anyway is an error naming it.
    """

    def __init__(self, blocks: list[list[nn.Module]], in_training_forward: Callable[[], bool]) -> None:
        self.blocks = blocks  # per MoE block inside a unit: its experts
        self.in_training_forward = in_training_forward  # the strategy's pass: a call now counts
        self.called: set[nn.Module] = set()  # experts called by training forwards since the last backward
        self.handles = [e.register_forward_pre_hook(self._on_call) for experts in blocks for e in experts]

    @classmethod
    def inside(cls, model: nn.Module, in_training_forward: Callable[[], bool]) -> "ExpertCalls":
        """Watch the experts of every MoE block of `model`, and of every leaf module (set_z3_leaf_modules,
        `leaf_module`) that holds a list of identical experts, router recognised or not."""
        blocks = []
        for m in model.modules():
            experts = _expert_list(m)
            if experts is not None and (getattr(m, "_z3_leaf", False) or _has_router(m, len(experts), experts)):
                blocks.append(list(experts))
        return cls(blocks, in_training_forward)

    def _on_call(self, expert: nn.Module, args: tuple) -> None:
        if self.in_training_forward():
            self.called.add(expert)

    def take_uncalled(self) -> list[nn.Module]:
        """The experts not called since the last take, of blocks that called some; then forget the calls."""
        uncalled = [e for experts in self.blocks if any(e in self.called for e in experts)
                    for e in experts if e not in self.called]
        self.called = set()
        return uncalled

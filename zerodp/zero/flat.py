"""Pieces every strategy shares: module set-up, and a flat gradient buffer whose slices are the
parameters' `.grad`.

[Note: gradient views]
When gradients accumulate in the parameters' own dtype, each `.grad` is set to a view of the flat
buffer and autograd accumulates into it in place (torch DDP's `gradient_as_bucket_view`). When they
accumulate in another dtype (bf16 params, `data_types.grad_accum_dtype: fp32`), autograd produces a
16-bit `.grad`, which the post-accumulate-grad hook adds into the fp32 buffer and then drops. The
hook also repairs a view that was replaced behind our back (a user's `model.zero_grad()`): the
replacement holds the whole gradient, so it is copied in.
"""

from __future__ import annotations

import torch
from torch import nn

from zerodp import comm
from zerodp.log import warn_once


class FlatGradBuffer:
    """One flat gradient buffer for `params` at `offsets` (elements), `numel` long, in `dtype`."""

    def __init__(self, params: list[nn.Parameter], offsets: list[int], numel: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.offsets = dict(zip(params, offsets))
        self.buffer = torch.zeros(numel, dtype=dtype, device=device)
        self.hooked = any(p.dtype != dtype for p in params)  # see [Note: gradient views]
        self.folded = False  # whether a backward added to it since the last zero()
        self.reset_grads()

    def view(self, p: nn.Parameter) -> torch.Tensor:
        """The slice of the buffer that holds `p`'s gradient, shaped like `p`."""
        start = self.offsets[p]
        return self.buffer[start : start + p.numel()].view_as(p)

    def fold(self, p: nn.Parameter) -> None:
        """Called from `p`'s post-accumulate-grad hook: make sure its gradient is in the buffer."""
        view = self.view(p)
        self.folded = True
        if self.hooked:
            view.add_(p.grad)  # this backward's contribution only: .grad was None before it
            p.grad = None
        elif p.grad.data_ptr() != view.data_ptr():
            # .grad was replaced (model.zero_grad() set it to None, or an out-of-place
            # accumulation): the new tensor is the whole truth, so copy, never add.
            view.copy_(p.grad)
            p.grad = view

    def reset_grads(self) -> None:
        """Point every `.grad` back at its view (or None when hooked)."""
        for p in self.offsets:
            p.grad = None if self.hooked else self.view(p)

    def zero(self) -> None:
        """Start accumulating a new optimizer step."""
        self.buffer.zero_()
        self.folded = False
        self.reset_grads()


def prepare_module(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Move `module` to `device`, cast its floating-point parameters to `dtype`, and make every rank
    start from rank 0's values. Buffers keep their dtype, as in DeepSpeed 0.19 (a rotary `inv_freq`
    stays fp32; a bf16 copy of it would change the model's outputs)."""
    narrow = {p.dtype for p in module.parameters() if p.is_floating_point() and p.element_size() < 4}
    if dtype == torch.float32 and narrow:
        warn_once(f"casting the model's {sorted(map(str, narrow))} parameters to fp32, which doubles their "
                  'memory: the config enables neither "bf16" nor "fp16"; enable one to train in 16 bits')
    if any(t.device != device for t in [*module.parameters(), *module.buffers()]):
        module.to(device=device)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    _broadcast_from_rank0(module)


def _broadcast_from_rank0(module: nn.Module) -> None:
    """One broadcast per dtype of all parameters and buffers (tied parameters once)."""
    if comm.get_world_size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in [*module.parameters(), *module.buffers()]:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors([t.detach() for t in group])
            comm.broadcast(flat, src=0)
            for t, synced in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                t.copy_(synced)
            if all(flat.untyped_storage()._cdata != t.untyped_storage()._cdata for t in group):
                comm.free_after_wait(flat)  # a copy (one tensor's "flat" is the tensor itself)


def trainable_in_registration_order(module: nn.Module, param_groups: list[dict]) -> list[nn.Parameter]:
    """The optimizer's parameters in the module's registration order; each must belong to it."""
    wanted = {p for g in param_groups for p in g["params"]}
    ordered = [p for p in module.parameters() if p in wanted]
    if len(ordered) != len(wanted):
        raise ValueError(
            f"{len(wanted) - len(ordered)} parameter(s) given to the optimizer (model_parameters or "
            "the optimizer's param_groups) are not parameters of the model passed to initialize()"
        )
    return ordered

"""ALST's tiled compute (zerodp/sequence/tiled.py, tiled_compute.py) with DeepSpeed's signatures.

A tiny Hugging Face Llama MLP and LM head + cross-entropy, tiled vs untiled, on sequences the shard
count does not divide (14 tokens in 3 shards: 5, 5, 4): `TiledMLP` and `sequence_tiled_compute` give
the MLP's output and its input's gradient row for row, but not bitwise: each row's arithmetic is the
same formula, yet the CPU GEMM picks its kernel (and so the order it sums a dot product in) by the
shape and layout of the whole call, and a 10-row call rounds some rows differently from the 28-row
one (seen: 1.8e-7 on outputs of ~0.1, 1-2 float32 ulps; the same call on a strided view of the
28 rows matched bitwise). So rtol 1e-5 / atol 1e-6 on them, and on each weight's gradient, a sum over
the tiles instead of one matmul (float32 rounding, seen 2.6e-7 of its largest element: within 1e-5
of the largest element).
The tiled loss is a sum of per-shard sums instead of one sum: rtol 1e-6 on the loss, 1e-5 of the
largest element on the gradients. Every parameter's gradient hook fires once per backward, also for parameters missing from
`compute_params`. Under ZeRO-3 on 2 ranks, through `import deepspeed` with ZERODP_AS_DEEPSPEED=1 and
DeepSpeed's call signatures, a Llama whose MLPs and loss are tiled trains as the untiled one with
gradient accumulation, and gathers the same parameter bytes (once per pass, not per tile).
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_ranks

pytest.importorskip("transformers")

BATCH, SEQ, SHARDS, HIDDEN, VOCAB = 2, 14, 3, 32, 50
IGNORE = -100


def _close_to_scale(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """Every element within `rel` of `want`'s largest (a sum's rounding scales with its terms, not its value)."""
    error, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert error <= rel * scale, f"max error {error:.3g} > {rel} x {scale:.3g}"


def _mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=96))


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP's forward, as a function of (module, input) the way ALST's patches pass it."""
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _run_mlp(mlp, how: str) -> tuple:
    from zerodp.sequence import TiledMLP, sequence_tiled_compute

    mlp.zero_grad(set_to_none=True)
    counts = {n: 0 for n, _ in mlp.named_parameters()}
    handles = [p.register_post_accumulate_grad_hook(lambda p, n=n: counts.__setitem__(n, counts[n] + 1))
               for n, p in mlp.named_parameters()]
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1)).requires_grad_()
    if how == "whole":
        out = _mlp_forward(mlp, x)
    elif how == "TiledMLP":  # compute_params names one weight: the other two must still get every tile's share
        out = TiledMLP.apply(_mlp_forward, mlp, x, SHARDS, [mlp.down_proj.weight])
    else:
        out = sequence_tiled_compute(_mlp_forward, SEQ, SHARDS, {"x": x}, {"self": mlp}, "x", [mlp.down_proj.weight],
                                     output_unshard_dimension=1, output_reduction=None)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    for handle in handles:
        handle.remove()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters()}, counts


@pytest.mark.parametrize("how", ["TiledMLP", "sequence_tiled_compute"])
def test_a_tiled_llama_mlp_gives_the_whole_mlp_s_rows_and_each_weight_one_whole_gradient(how: str) -> None:
    mlp = _mlp()
    out, x_grad, grads, _ = _run_mlp(mlp, "whole")
    tiled_out, tiled_x_grad, tiled_grads, counts = _run_mlp(mlp, how)
    torch.testing.assert_close(tiled_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tiled_x_grad, x_grad, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        _close_to_scale(tiled_grads[name], grad)
    assert counts == {name: 1 for name in grads}  # one hook per parameter, whatever compute_params listed


def _loss_parts():
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    y[:, :3] = IGNORE  # a prompt
    return head, x, y


def _token_loss_sum(head, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    logits = head(x).view(-1, VOCAB)
    y = y.reshape(-1) if mask is None else torch.where(mask.reshape(-1).bool(), y.reshape(-1), IGNORE)
    return F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("how", ["TiledFusedLogitsLoss", "sequence_tiled_compute", "masked"])
def test_a_tiled_loss_equals_the_whole_cross_entropy(how: str) -> None:
    from zerodp.sequence import TiledFusedLogitsLoss, sequence_tiled_compute

    head, x, y = _loss_parts()
    runs = {}
    for tiled in (False, True):
        head.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        if not tiled:
            total = _token_loss_sum(head, xx, y)
        elif how == "TiledFusedLogitsLoss":
            total = TiledFusedLogitsLoss.apply(_token_loss_sum, head, xx, y, None, SHARDS, [head.weight], "sum")
        elif how == "masked":  # the labels' prompt as a mask instead
            mask = (y != IGNORE).long()
            total = TiledFusedLogitsLoss.apply(_token_loss_sum, head, xx, y.clamp(min=0), mask, SHARDS, [head.weight],
                                               "sum")
        else:
            total = sequence_tiled_compute(lambda head, x, y: _token_loss_sum(head, x, y), SEQ, SHARDS, {"x": xx, "y": y},
                                           {"head": head}, "x", [head.weight], output_unshard_dimension=0,
                                           output_reduction="sum")
        loss = total / (y != IGNORE).sum()
        (loss * 3).backward()  # an incoming gradient other than 1 (the engine's scaling) must reach every gradient
        runs[tiled] = (loss.detach(), xx.grad, head.weight.grad.clone())
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-6, atol=0)
    _close_to_scale(runs[True][1], runs[False][1])
    _close_to_scale(runs[True][2], runs[False][2])


def test_the_mean_of_equal_shards_and_a_clear_error_for_a_wrong_reduction() -> None:
    from zerodp.sequence import TiledFusedLogitsLoss, sequence_tiled_compute

    head, x, y = _loss_parts()
    y = y.clamp(min=0)  # every token labelled: the mean of 2 equal shards' means is the mean

    def mean_loss(head, x, y):
        return F.cross_entropy(head(x).view(-1, VOCAB), y.reshape(-1))

    tiled = TiledFusedLogitsLoss.apply(mean_loss, head, x, y, None, 2, [head.weight], "mean")
    torch.testing.assert_close(tiled, mean_loss(head, x, y), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="output_reduction='max'"):
        TiledFusedLogitsLoss.apply(mean_loss, head, x, y, None, 2, [head.weight], "max")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key='h'"):
        sequence_tiled_compute(mean_loss, SEQ, 2, {"x": x}, {"head": head}, "h")


# ---------------------------------------------------------------------------------------------
# ZeRO-3, 2 ranks, DeepSpeed's API


class _CausalLM(torch.nn.Module):
    """A Llama and its loss (sum of token losses / labelled tokens), the head and loss tiled or not."""

    def __init__(self, tiled: bool) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.lm = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64, attn_implementation="sdpa"))
        self.tiled = tiled

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(input_ids=input_ids).last_hidden_state
        shifted = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        head = self.lm.lm_head
        if self.tiled:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

            total = TiledFusedLogitsLoss.apply(_token_loss_sum, head, hidden, shifted, None, SHARDS, [head.weight],
                                               "sum")
        else:
            total = _token_loss_sum(head, hidden, shifted)
        return total / (shifted != IGNORE).sum()


def _tile_the_mlps(model: _CausalLM) -> None:
    """ALST's patches, with DeepSpeed's signatures: layer 0's MLP by TiledMLP, layer 1's by
    sequence_tiled_compute."""
    from deepspeed.runtime.sequence_tiled_compute import TiledMLP, sequence_tiled_compute

    def by_tiled_mlp(self, x):
        return TiledMLP.apply(_mlp_forward, self, x, SHARDS, [self.gate_proj.weight, self.up_proj.weight,
                                                              self.down_proj.weight])

    def by_tiled_compute(self, x):
        return sequence_tiled_compute(_mlp_forward, x.shape[1], SHARDS, {"x": x}, {"self": self}, "x",
                                      list(self.parameters()), output_unshard_dimension=1, output_reduction=None)

    layers = model.lm.model.layers
    layers[0].mlp.forward = types.MethodType(by_tiled_mlp, layers[0].mlp)
    layers[1].mlp.forward = types.MethodType(by_tiled_compute, layers[1].mlp)


def _zero3(rank: int, world: int, tiled: bool) -> dict:
    # The switch as the .pth hook turns it on at start-up; installed here because the ranks come
    # from a fork server that an earlier test may have started without ZERODP_AS_DEEPSPEED.
    os.environ["ZERODP_AS_DEEPSPEED"] = "1"
    import _zerodp_as_deepspeed

    _zerodp_as_deepspeed.install()
    import deepspeed

    model = _CausalLM(tiled)
    if tiled:
        _tile_the_mlps(model)
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for micro in range(4):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(10 * micro + rank))
        labels = ids.clone()
        labels[:, :3] = IGNORE
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    gathered = {op: rec["bytes"] for op, rec in engine.comm_report()["last_step"]["ops"].items() if "gather" in op}
    return {"losses": losses, "params": params, "gathered": gathered}


def test_a_tiled_llama_trains_at_stage_3_as_the_untiled_one_through_deepspeed_s_api() -> None:
    whole, tiled = (run_ranks(_zero3, 2, args=(t,)) for t in (False, True))
    for got, want in zip(tiled, whole):
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
        for name, param in want["params"].items():
            _close_to_scale(got["params"][name], param)
        assert got["gathered"] == want["gathered"] and got["gathered"]  # gathered once per pass, not per tile

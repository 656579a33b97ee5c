"""Activation checkpointing: same numbers, fewer saved bytes, one extra forward of FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tests.harness import run_ranks
from zerodp import checkpointing

B, D, L = 8, 16, 3  # batch, width, blocks


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(D, 4 * D), nn.Linear(4 * D, D), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.drop(self.fc2(torch.relu(self.fc1(x))))


class Stack(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(L))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _data(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, D, generator=torch.Generator().manual_seed(seed))


def _grads(model: nn.Module, seed: int = 0) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(123)  # dropout masks
    loss = model(_data(seed))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_same_loss_and_gradients_with_dropout() -> None:
    plain, ckpt = Stack(dropout=0.2), Stack(dropout=0.2)
    assert checkpointing.apply(ckpt) == ["blocks.0", "blocks.1", "blocks.2"]
    loss_a, grads_a = _grads(plain)
    loss_b, grads_b = _grads(ckpt)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_checkpoint_takes_kwargs_non_tensor_outputs_and_inputs_without_grad() -> None:
    block = Stack().blocks[0]
    x = _data()  # does not require grad

    def fn(inp: torch.Tensor, *, scale: float) -> tuple[torch.Tensor, str]:
        return block(inp, scale=scale), "tag"

    out, tag = checkpointing.checkpoint(fn, x, scale=0.5)
    out.sum().backward()
    expected = block.fc1.weight.grad.clone()
    block.zero_grad()
    block(x, scale=0.5).sum().backward()
    assert tag == "tag" and torch.equal(block.fc1.weight.grad, expected)


def _flops(model: nn.Module) -> tuple[int, int]:
    loss = None
    with FlopCounterMode(display=False) as forward:
        loss = model(_data())
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return forward.get_total_flops(), backward.get_total_flops()


# torch's recompute stops once it has rebuilt every tensor backward needs ("early stop"): in a
# block that is fc1's input and the ReLU output, so fc1's matmul is redone and fc2's is not.
RECOMPUTED_PER_BLOCK = 2 * B * D * 4 * D


def test_backward_recomputes_exactly_the_checkpointed_forward() -> None:
    fwd_plain, bwd_plain = _flops(Stack())
    model = Stack()
    checkpointing.apply(model)
    fwd_ckpt, bwd_ckpt = _flops(model)
    assert fwd_ckpt == fwd_plain
    assert bwd_ckpt - bwd_plain == L * RECOMPUTED_PER_BLOCK


def test_every_k_and_selective_policies() -> None:
    model = Stack()
    assert checkpointing.apply(model, policy="every_k", k=2) == ["blocks.0", "blocks.2"]
    _, bwd = _flops(model)
    _, bwd_plain = _flops(Stack())
    assert bwd - bwd_plain == 2 * RECOMPUTED_PER_BLOCK
    selective = Stack()
    checkpointing.apply(selective, selective=True)  # matmul outputs are kept: no matmul is redone
    assert _flops(selective)[1] == bwd_plain
    checkpointing.remove(selective)
    assert "forward" not in vars(selective.blocks[0])


class _ExpertsBlock(nn.Module):
    """A block holding a list longer than the list of blocks (an MoE layer's experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(2 * L))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(expert(x) for expert in self.experts)


def test_blocks_policy_picks_the_list_of_blocks_not_a_longer_list_inside_a_block() -> None:
    model = nn.Sequential()
    model.layers = nn.ModuleList(_ExpertsBlock() for _ in range(L))
    assert checkpointing.apply(model) == [f"layers.{i}" for i in range(L)]
    root_list = nn.ModuleList([_ExpertsBlock(), _ExpertsBlock()])  # the model itself is the list
    assert [n for n, _ in checkpointing.repeated_blocks(root_list)] == ["0", "1"]


def test_profile_counts_the_recomputations() -> None:
    model = Stack()
    checkpointing.apply(model)
    checkpointing.configure(profile=True)
    try:
        checkpointing.profile.take()
        model(_data()).backward()
        taken = checkpointing.profile.take()
    finally:
        checkpointing.configure(profile=False)
    assert taken["recompute_calls"] == L and taken["recompute_s"] > 0


def test_policy_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        checkpointing.apply(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="policy='all'"):
        checkpointing.apply(Stack(), policy="all")


# --- through the engine: saved bytes in the ledger, parity at every stage --------------------


def _engine_run(rank: int, world: int, stage: int, use_checkpointing: bool, dropout: float):
    import zerodp

    model = Stack(dropout=dropout)
    if use_checkpointing:
        checkpointing.apply(model)
    engine, *_ = zerodp.initialize(model=model, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=True),
                                   config={"train_micro_batch_size_per_gpu": B, "gradient_clipping": 0,
                                           "zero_optimization": _zero(stage)})
    losses = []
    for step in range(3):
        torch.manual_seed(100 * step + rank)  # dropout masks, same with and without checkpointing
        loss = engine(_data(10 * step + rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, _full_params(model), engine.memory_report()["activations"]


def _zero(stage: int) -> dict:
    """Stage 3 shards every parameter (the default 1e5 threshold would keep these small ones whole)."""
    return {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}


def _full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    import zerodp

    with zerodp.zero.GatheredParameters(list(model.parameters())):  # a no-op below stage 3
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointing_changes_no_number_at_any_stage(stage: int) -> None:
    plain = run_ranks(_engine_run, 2, args=(stage, False, 0.2))
    ckpt = run_ranks(_engine_run, 2, args=(stage, True, 0.2))
    for (losses_a, params_a, _), (losses_b, params_b, _) in zip(plain, ckpt):
        assert losses_a == losses_b
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))


def _engine_backward_flops(rank: int, world: int, stage: int, use_checkpointing: bool) -> int:
    import zerodp

    model = Stack()
    if use_checkpointing:
        checkpointing.apply(model)
    engine, *_ = zerodp.initialize(model=model, optimizer=lambda g: torch.optim.SGD(g, lr=0.1),
                                   config={"train_micro_batch_size_per_gpu": B, "zero_optimization": _zero(stage)})
    loss = engine(_data(rank))
    with FlopCounterMode(display=False) as backward:
        engine.backward(loss)
    return backward.get_total_flops()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_through_the_engine_backward_recomputes_exactly_the_checkpointed_forward(stage: int) -> None:
    """Stage 3's re-gathers for the recompute add no FLOPs and miss none."""
    plain = run_ranks(_engine_backward_flops, 2, args=(stage, False))
    ckpt = run_ranks(_engine_backward_flops, 2, args=(stage, True))
    assert all(b - a == L * RECOMPUTED_PER_BLOCK for a, b in zip(plain, ckpt))


@pytest.mark.parametrize("stage,world", [(0, 1), (3, 2)])
def test_ledger_reports_saved_activation_bytes_exactly(stage: int, world: int) -> None:
    """Per block without checkpointing: fc1's input (4BD bytes) and the ReLU output (16BD, which
    fc2 also saves). With it: only the block's input (4BD). Outside the blocks: the head's input
    (4BD) and the square's input (4B). Stage 3's gathered parameters are not activations."""
    plain = run_ranks(_engine_run, world, args=(stage, False, 0.0))[0][2]
    ckpt = run_ranks(_engine_run, world, args=(stage, True, 0.0))[0][2]
    assert plain == {"device": L * 20 * B * D + 4 * B * D + 4 * B}
    assert ckpt == {"device": L * 4 * B * D + 4 * B * D + 4 * B}


def _hf_gpt2(rank: int, world: int, stage: int, use_checkpointing: bool):
    import zerodp
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    if use_checkpointing:
        model.gradient_checkpointing_enable()  # Hugging Face's own switch, default arguments
    engine, *_ = zerodp.initialize(model=model, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3, foreach=True),
                                   config={"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0,
                                           "zero_optimization": _zero(stage)})
    losses = []
    for step in range(3):
        torch.manual_seed(100 + 10 * step + rank)  # GPT-2's dropout masks
        ids = torch.randint(0, 64, (2, 16))
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return losses, _full_params(model), engine.memory_report()["activations"]["device"]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_hugging_face_gradient_checkpointing_enable_works_under_zerodp(stage: int) -> None:
    pytest.importorskip("transformers")
    (losses_a, params_a, saved_a), _ = run_ranks(_hf_gpt2, 2, args=(stage, False))
    (losses_b, params_b, saved_b), _ = run_ranks(_hf_gpt2, 2, args=(stage, True))
    assert losses_a == losses_b and all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    assert saved_b * 5 < saved_a  # measured: 292,740 -> 29,572 bytes


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_checkpointed_hugging_face_model_trains_without_the_key_value_cache(family: str) -> None:
    """The cache would keep every layer's keys and values from forward to backward, and a recompute
    appends them again ([Note: no key/value cache under checkpointing]): forwards with gradients run
    without it unless the caller asks; generation without gradients keeps it; the config is left alone;
    `remove` takes the hook away. GPT-2 passes its cache to the blocks by position."""
    transformers = pytest.importorskip("transformers")
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1)
        model = transformers.LlamaForCausalLM(config)
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2))
    ids = torch.randint(0, 64, (2, 8))

    def cached() -> int:
        cache = model(input_ids=ids).past_key_values
        return 0 if cache is None else cache.get_seq_length()

    assert cached() == 8  # on by default, in training too
    checkpointing.apply(model)
    assert cached() == 0 and model.config.use_cache is True
    model(input_ids=ids, labels=ids).loss.backward()
    assert model(input_ids=ids, use_cache=True).past_key_values.get_seq_length() == 8  # asked for
    with torch.no_grad():
        assert cached() == 8
    checkpointing.remove(model)
    assert cached() == 8

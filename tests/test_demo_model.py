"""TinyGPT and the synthetic copy / reverse task behind `zerodp demo`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from zerodp.demo import DEMO_DEFAULT, GPTConfig, SyntheticTaskDataset, TinyGPT
from zerodp.demo.data import SEPARATOR
from zerodp.demo.model import IGNORE_INDEX

TINY = GPTConfig(vocab_size=10, seq_len=8, d_model=8, n_layer=1, n_head=2)


def _model(config: GPTConfig = TINY, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(config)


def test_logits_and_loss_shapes() -> None:
    model = _model()
    idx = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len))
    assert model(idx).shape == (3, TINY.seq_len, TINY.vocab_size)
    assert model(idx[:, :5]).shape == (3, 5, TINY.vocab_size)  # shorter inputs are fine
    loss = model(idx, idx)
    assert loss.shape == () and loss.dtype == torch.float32


def test_input_longer_than_seq_len_is_a_value_error() -> None:
    idx = torch.zeros(1, TINY.seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input has 9 tokens but GPTConfig.seq_len=8"):
        _model()(idx)


def test_config_validation_names_every_problem() -> None:
    with pytest.raises(ValueError, match=r"n_layer=0 must be >= 1.*d_model=10 must be divisible"):
        GPTConfig(vocab_size=8, seq_len=8, d_model=10, n_layer=0, n_head=4)


def test_attention_is_causal() -> None:
    model = _model(GPTConfig(vocab_size=10, seq_len=8, d_model=16, n_layer=2, n_head=2)).eval()
    idx = torch.randint(0, 10, (2, 8), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 5] = (idx[:, 5] + 1) % 10
    before, after = model(idx), model(changed)
    torch.testing.assert_close(after[:, :5], before[:, :5], atol=1e-6, rtol=0)
    # The change must be visible from position 5 on, or the check above proves nothing.
    assert (after[:, 5:] - before[:, 5:]).abs().amax() > 1e-3


def test_tied_embedding_is_one_shared_parameter() -> None:
    model = _model()
    assert model.head.weight is model.tok_emb.weight
    assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    assert sum(p is model.tok_emb.weight for p in model.parameters()) == 1
    with torch.no_grad():
        model.tok_emb.weight[3, 0] = 42.0
    assert model.head.weight[3, 0].item() == 42.0
    # Both uses (embedding lookup and output matmul) accumulate into the one gradient.
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    model(idx, idx).backward()
    assert model.head.weight.grad is model.tok_emb.weight.grad


def test_untied_embeddings_are_separate() -> None:
    untied = GPTConfig(**{**TINY.__dict__, "tie_embeddings": False})
    model = _model(untied)
    assert model.head.weight is not model.tok_emb.weight
    assert model.num_parameters() == _model().num_parameters() + 10 * 8


def test_num_parameters_by_hand() -> None:
    # vocab 10, seq 8, d 8, one block: tok 80, pos 64, ln_1 16, qkv 8*24+24, attn proj 8*8+8,
    # ln_2 16, fc 8*32+32, mlp proj 32*8+8, ln_f 16, head tied to tok.
    expected = 80 + 64 + 16 + 216 + 72 + 16 + 288 + 264 + 16
    assert _model().num_parameters() == expected == 1032
    assert _model().num_parameters(non_embedding=True) == expected - 64


def test_demo_default_size() -> None:
    assert DEMO_DEFAULT.vocab_size == 64 and DEMO_DEFAULT.n_layer == 4
    assert TinyGPT(DEMO_DEFAULT).num_parameters() == 805_632


def test_blocks_are_a_module_list_of_standalone_blocks() -> None:
    model = _model(GPTConfig(vocab_size=10, seq_len=8, d_model=8, n_layer=3, n_head=2))
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 3
    x = torch.randn(2, 8, 8)
    assert model.blocks[1](x).shape == x.shape  # each block runs alone (checkpointing unit)


def test_gpt2_init() -> None:
    config = GPTConfig(vocab_size=64, seq_len=32, d_model=128, n_layer=8, n_head=4)
    model = _model(config)
    block = model.blocks[0]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * 8)
    assert block.attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.mlp.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.count_nonzero(block.mlp.fc.bias) == 0
    assert torch.equal(block.ln_1.weight, torch.ones(128))


def test_construction_is_deterministic_given_the_seed() -> None:
    first, second, other = _model(seed=3), _model(seed=3), _model(seed=4)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name
    assert not torch.equal(first.tok_emb.weight, other.tok_emb.weight)


def test_loss_ignores_minus_100_positions() -> None:
    model = _model()
    idx = torch.randint(0, 10, (2, 8), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 10, (2, 8), generator=torch.Generator().manual_seed(1))
    masked = targets.clone()
    masked[:, :5] = IGNORE_INDEX
    log_probs = F.log_softmax(model(idx), dim=-1)
    kept = -log_probs[:, 5:].gather(-1, targets[:, 5:, None])
    torch.testing.assert_close(model(idx, masked), kept.mean())
    # The mask must change the loss, or the check above could pass with it ignored.
    assert model(idx, targets).item() != pytest.approx(kept.mean().item(), abs=1e-3)


def test_copy_sample_by_hand() -> None:
    dataset = SyntheticTaskDataset(num_samples=4, seq_len=6, vocab_size=5, seed=0)
    idx, targets = dataset[2]
    a, b, c = idx[:3].tolist()
    assert all(1 <= t < 5 for t in (a, b, c))  # token 0 is reserved for the separator
    assert idx.tolist() == [a, b, c, SEPARATOR, a, b]
    assert targets.tolist() == [-100, -100, -100, a, b, c]
    assert idx.dtype == targets.dtype == torch.long


def test_reverse_sample_and_odd_seq_len_by_hand() -> None:
    dataset = SyntheticTaskDataset(num_samples=4, seq_len=7, vocab_size=5, seed=0, task="reverse")
    idx, targets = dataset[1]
    a, b, c = idx[:3].tolist()
    assert idx.tolist() == [a, b, c, SEPARATOR, c, b, a]
    assert targets.tolist() == [-100, -100, -100, c, b, a, -100]


def test_dataset_is_deterministic_per_index() -> None:
    first = SyntheticTaskDataset(100, seq_len=16, vocab_size=64, seed=7)
    second = SyntheticTaskDataset(100, seq_len=16, vocab_size=64, seed=7)
    _ = [second[i] for i in (99, 3, 50)]  # access order must not matter
    for i in (0, 50, 99, -1):
        assert all(torch.equal(x, y) for x, y in zip(first[i], second[i]))
    assert not torch.equal(first[0][0], first[1][0])
    assert not torch.equal(first[0][0], SyntheticTaskDataset(100, 16, 64, seed=8)[0][0])
    with pytest.raises(IndexError):
        first[100]


def test_dataset_batches_through_a_dataloader() -> None:
    dataset = SyntheticTaskDataset(num_samples=10, seq_len=16, vocab_size=64, seed=0)
    idx, targets = next(iter(DataLoader(dataset, batch_size=4)))
    assert idx.shape == targets.shape == (4, 16)
    assert (targets != IGNORE_INDEX).sum().item() == 4 * 8  # the 8 answer tokens per sample


def test_dataset_validation_and_describe() -> None:
    with pytest.raises(ValueError, match=r"vocab_size=2 must be >= 3.*task='sort' must be one of"):
        SyntheticTaskDataset(10, seq_len=8, vocab_size=2, task="sort")
    line = SyntheticTaskDataset(1000, seq_len=32, vocab_size=64, seed=0).describe()
    assert line.startswith("copy task: 16 random tokens from a vocabulary of 63")
    assert "ln(63) = 4.14" in line and "\n" not in line


def test_a_short_training_run_learns_the_copy_task() -> None:
    # Measured on seeds 0-7: first loss 2.06-2.12 (chance ln 8 = 2.08), mean of the last 10 of
    # 60 steps 0.006-0.057. The bar below leaves a wide margin and still fails an untrained model.
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=8, seq_len=8, d_model=32, n_layer=1, n_head=2)
    model = TinyGPT(config)
    dataset = SyntheticTaskDataset(60 * 16, config.seq_len, config.vocab_size, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    losses = []
    for idx, targets in DataLoader(dataset, batch_size=16):
        loss = model(idx, targets)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    assert len(losses) == 60
    assert losses[0] == pytest.approx(math.log(8), abs=0.15)
    assert sum(losses[-10:]) / 10 < 0.3

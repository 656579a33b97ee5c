"""Ulysses sequence parallelism (zerodp/sequence/): a tiny HF Llama (sdpa, fp32, CPU, gloo).

S=2 on 2 ranks trains as S=1 on 1 rank on the same full sequences (stage 0; stage 3 with one key/value
head, replicated to both ranks, on a 15-token sequence padded to 16), and S=2 x DP=2 on 4 ranks as
DP=2 (stage 2); DeepSpeed's API (register_with_transformers, the data-loader adapter, mpu=) trains as
gradient accumulation on one rank; the all-to-all bytes per layer are the formula's; activations per
rank halve; a sequence S does not divide is refused (or padded on request); a checkpoint saved with
S=2 on 2 ranks loads with S=1 on 1 rank; a TiledMLP trains as the whole MLP at stages 2 and 3.

Tolerance: the all-to-all moves values and adds nothing (zerodp/sequence/all_to_all.py's [Note: the
Ulysses all-to-all]), and attention runs per head on the whole sequence as in the unsplit run. Two sums are taken in another order: the loss is the mean of two shards' means
weighted by their token counts (zerodp/sequence/loss.py) instead of one mean over all tokens, and each
weight's gradient is the sum of two shards' partial sums (reduced across the ranks) instead of one
matmul over the whole sequence. Both differ by float32 rounding only (seen: 2.4e-7 of the largest
gradient element): rtol 1e-5 for losses and gradients.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks

pytest.importorskip("transformers")

SEQ, MICRO, STEPS, LAYERS = 16, 2, 3, 2
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 4, 2, 8, 32, 64
RTOL, ATOL = 1e-5, 1e-6
# SGD with momentum, not Adam: Adam divides by sqrt(v), so a rounding difference in a gradient element near
# 0 can move its weight by up to 2 x lr (seen with AdamW: 2.6e-5 after 3 steps); SGD's update is linear in it
OPTIMIZER = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
PAD = 0  # the pad token of the padded run


def _llama(kv_heads: int = KV_HEADS):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
                         max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _batch(step: int, replica: int, seq: int = SEQ) -> dict:
    """The full sequences data-parallel replica `replica` reads at `step` (a prompt of 3 tokens unlabelled)."""
    gen = torch.Generator().manual_seed(1000 * step + replica)
    ids = torch.randint(1, VOCAB, (MICRO, seq), generator=gen)
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels}


def _config(sp: int | None, stage: int, accumulation: int = 1) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
              "zero_optimization": {"stage": stage}, "optimizer": OPTIMIZER}
    return config if sp is None else {**config, "sequence_parallel_size": sp}


def _sharded_loss(engine, piece: dict, sp, **kwargs) -> torch.Tensor:
    import zerodp.sequence as sequence

    out = engine(input_ids=piece["input_ids"], position_ids=piece["position_ids"], labels=piece["shift_labels"],
                 shift_labels=piece["shift_labels"], **kwargs)
    return sequence.sequence_parallel_loss(out.loss, piece["shift_labels"], sp.sp_group)


def _finish(engine, model, losses: list, grads: dict) -> dict:
    import zerodp

    with zerodp.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "ledger": engine.comm_report()["last_step"]["ops"],
            "activations": engine.memory_report()["activations"].get("device", 0)}


def _train(sp_size: int, stage: int, kv_heads: int = KV_HEADS, seq: int = SEQ, save: str | None = None,
           samples: bool = False, checkpointed: bool = False, keep_cache: bool = False, packed: bool = False) -> dict:
    """Train STEPS steps on `_batch(step, data-parallel rank)`, each rank its sequence shard when sp_size > 1,
    every block checkpointed when `checkpointed`; with `keep_cache` the forward asks for the model's
    key/value cache (apply turns it off otherwise), so each recompute appends its keys to it again; with
    `packed` each row holds two documents (positions 0-6 and 0-8, as packing collators write them), and the
    forward has no cache (transformers looks for packed documents only then);
    the first step's reduced gradients (stage 0), the final parameters and the last step's ledger."""
    import zerodp
    import zerodp.sequence as sequence

    model = _llama(kv_heads)
    if checkpointed:
        zerodp.checkpointing.apply(model, "blocks")
    if sp_size > 1:
        sequence.register_attention(model, "sdpa", sequence.initialize_sequence_parallel(sp_size))
    engine, *_ = zerodp.initialize(model=model, config=_config(sp_size, stage))
    sp = sequence.current()
    losses, grads = [], {}
    for step in range(STEPS):
        batch, extra = _batch(step, sp.dp_rank, seq), {"use_cache": False} if packed else {}
        extra = {"use_cache": True} if keep_cache else extra
        if packed:
            batch["position_ids"] = torch.cat([torch.arange(7), torch.arange(seq - 7)]).expand(MICRO, seq)
        if sp.sp_size == 1:  # position ids per row, as the shards get them (rotary tables are then per row too)
            loss = engine(**{"position_ids": torch.arange(seq).expand(MICRO, seq), **batch}, **extra).loss
        else:
            piece = sequence.shard_batch(batch, sp.sp_rank, sp.sp_size, pad_token_id=PAD)
            loss = _sharded_loss(engine, piece, sp, **extra)
        engine.backward(loss)
        if step == 0 and stage == 0:
            engine.strategy.finish_reduction()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        engine.step()
        losses.append(loss.item())
    if save:
        engine.save_checkpoint(save, tag="sp")
    read = [int(i) for i in next(iter(engine.deepspeed_io(list(range(16)))))] if samples else []
    return {**_finish(engine, model, losses, grads), "samples": read}


def _deepspeed_api(rank: int) -> dict:
    """DeepSpeed's recipe: register_with_transformers -> mpu; each rank's own batch through the adapter
    (2 micro-batches per batch of the data-parallel loader); initialize(mpu=...) without the config key."""
    import zerodp
    from zerodp.compat.deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )
    from zerodp.compat.deepspeed.utils import groups

    model = _llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, MICRO)
    engine, *_ = zerodp.initialize(model=model, config=_config(None, 1, accumulation=2), mpu=mpu)
    loader = UlyssesSPDataLoaderAdapter([_batch(step, rank) for step in range(STEPS)], groups._get_sequence_parallel_rank(),
                                        groups._get_sequence_parallel_group(), groups._get_sequence_parallel_world_size(),
                                        torch.device("cpu"))
    losses = []
    for piece in loader:
        loss = _sharded_loss(engine, piece, zerodp.sequence.current())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {**_finish(engine, model, losses, {}), "micro_batches": len(loader), "batch": engine.train_batch_size()}


def _two_ranks(rank: int, world: int, checkpoint: str) -> dict:
    return {"stage0": _train(2, 0), "stage3_gqa_padded": _train(2, 3, kv_heads=1, seq=SEQ - 1, save=checkpoint),
            "deepspeed_api": _deepspeed_api(rank),
            "stage0_checkpointed": _train(2, 0, checkpointed=True, keep_cache=True),
            "stage3_gqa_padded_checkpointed": _train(2, 3, kv_heads=1, seq=SEQ - 1, checkpointed=True),
            "stage0_packed": _train(2, 0, packed=True)}


def _one_rank(rank: int, world: int, checkpoint: str) -> dict:
    """The unsplit references, and the S=2 checkpoint loaded with S=1 on one rank."""
    import zerodp

    model = _llama(kv_heads=1)
    engine, *_ = zerodp.initialize(model=model, config=_config(1, 3))
    engine.load_checkpoint(checkpoint, tag="sp")
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"stage0": _train(1, 0), "stage3_gqa_padded": _train(1, 3, kv_heads=1, seq=SEQ - 1),
            "stage0_packed": _train(1, 0, packed=True),
            "accumulated": _accumulated(), "loaded": loaded}


def _accumulated() -> dict:
    """One rank, S=1, 2 micro-batches per step: rank 0's and rank 1's batch of each step in turn, as
    DeepSpeed's adapter feeds them to the sequence-parallel group."""
    import zerodp

    model = _llama()
    engine, *_ = zerodp.initialize(model=model, config=_config(1, 1, accumulation=2))
    losses = []
    for step in range(STEPS):
        for rank in range(2):
            loss = engine(**_batch(step, rank)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return _finish(engine, model, losses, {})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    checkpoint = str(tmp_path_factory.mktemp("sp_checkpoint"))
    split = run_ranks(_two_ranks, 2, args=(checkpoint,))
    whole = run_ranks(_one_rank, 1, args=(checkpoint,))[0]
    return {"split": split, "whole": whole}


def _close(got: dict, want: dict, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("run, unsplit", [("stage0", "stage0"), ("stage3_gqa_padded", "stage3_gqa_padded"),
                                          ("stage0_checkpointed", "stage0"),
                                          ("stage3_gqa_padded_checkpointed", "stage3_gqa_padded"),
                                          ("stage0_packed", "stage0_packed")])
def test_two_sequence_shards_train_as_one_rank_on_the_whole_sequence(runs: dict, run: str, unsplit: str) -> None:
    """Checkpointed too, without the key/value cache (stage 3) and with it (stage 0): the recompute appends
    the layer's keys to the cache again ([Note: a key/value cache under Ulysses]); attending to them gave
    gradients up to 1.3e-2 off. Packed rows too: transformers attends within each document unsplit, and
    the wrapped sdpa gets that mask ([Note: packed documents under Ulysses]); without it the losses differ."""
    reference = runs["whole"][unsplit]
    for result in runs["split"]:
        assert result[run]["losses"] == pytest.approx(reference["losses"], rel=RTOL)
        _close(result[run]["grads"], reference["grads"])
        _close(result[run]["params"], reference["params"])
    assert runs["split"][0]["stage0"]["grads"], "the stage-0 run compares gradients"


def test_packing_changes_what_the_unsplit_model_computes(runs: dict) -> None:
    """So the packed run above checks the documents' mask, not a mask that changes nothing."""
    assert runs["whole"]["stage0_packed"]["losses"][0] != pytest.approx(runs["whole"]["stage0"]["losses"][0], rel=1e-3)


def test_a_row_of_consecutive_positions_gets_no_mask_and_a_packed_row_its_documents() -> None:
    from zerodp.sequence.attention import document_mask

    assert document_mask(torch.arange(5, 13).expand(2, 8)) is None
    mask = document_mask(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]))
    assert mask.shape == (2, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0],
                                         [0, 0, 0, 1, 1]]
    assert torch.equal(mask[1, 0], torch.ones(5, 5, dtype=torch.bool).tril())


def test_deepspeed_s_recipe_trains_as_gradient_accumulation_over_the_group_s_batches(runs: dict) -> None:
    reference = runs["whole"]["accumulated"]
    for result in runs["split"]:
        api = result["deepspeed_api"]
        assert api["micro_batches"] == 2 * STEPS and api["batch"] == 2 * MICRO  # N/S = 1 data-parallel rank
        assert api["losses"] == pytest.approx(reference["losses"], rel=RTOL)
        _close(api["params"], reference["params"])


def test_a_checkpoint_saved_with_two_sequence_shards_loads_with_none_on_one_rank(runs: dict) -> None:
    saved = runs["split"][0]["stage3_gqa_padded"]["params"]
    loaded = runs["whole"]["loaded"]
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[n], t) for n, t in saved.items())


def _all_to_all_bytes(kv_heads: int, sp: int = 2) -> int:
    """One rank, one step of one micro-batch: per layer, forward sends q, k, v (key/value heads repeated
    up to S when fewer) and the output, backward their gradients, each [micro, seq/S, heads, head_dim] fp32."""
    kv_sent = kv_heads * max(1, sp // kv_heads) if kv_heads < sp else kv_heads
    per_layer_forward = MICRO * (SEQ // sp) * HEAD_DIM * (HEADS + 2 * kv_sent + HEADS) * 4
    return LAYERS * 2 * per_layer_forward


@pytest.mark.parametrize("run, kv_heads", [("stage0", KV_HEADS), ("stage3_gqa_padded", 1)])
def test_the_ledger_counts_eight_all_to_alls_per_layer_of_the_formula_s_bytes(runs: dict, run: str,
                                                                              kv_heads: int) -> None:
    for result in runs["split"]:
        record = result[run]["ledger"]["all_to_all[float32]"]
        assert record["calls"] == LAYERS * 8  # q, k, v, output forward; their gradients backward
        assert record["bytes"] == _all_to_all_bytes(kv_heads)
    assert _all_to_all_bytes(1) == _all_to_all_bytes(2)  # one key/value head repeated to 2 ranks sends as 2
    assert "all_to_all[float32]" not in runs["whole"][run]["ledger"]


@pytest.mark.parametrize("run, kv_heads", [("stage0_checkpointed", KV_HEADS), ("stage3_gqa_padded_checkpointed", 1)])
def test_checkpointed_blocks_add_the_recompute_s_four_all_to_alls_of_the_forward_s_bytes(runs: dict, run: str,
                                                                                      kv_heads: int) -> None:
    """zerodp/plan/sequence.py's formula with checkpointing: forward, recompute and backward, 3x one forward's
    bytes per layer, for key/value heads cut (2 over S = 2) and repeated (1 to both ranks). Before the fix the
    recompute's k and v carried the cache's doubled keys: 40,960 bytes for 36,864."""
    from zerodp.plan.sequence import Heads, all_to_all_bytes

    formula = all_to_all_bytes(Heads(HEADS, kv_heads, HEAD_DIM, LAYERS, "sdpa"), MICRO, SEQ, 2, 4, "blocks")
    assert formula.per_micro_batch == _all_to_all_bytes(kv_heads) * 3 // 2 == 36_864
    for result in runs["split"]:
        record = result[run]["ledger"]["all_to_all[float32]"]
        assert (record["calls"], record["bytes"]) == (LAYERS * 12, formula.per_micro_batch)


def test_activations_per_rank_fall_by_the_sequence_parallel_size(runs: dict) -> None:
    """What autograd saved (memory_report()["activations"]): every per-token tensor, the attention's
    q/k/v/output at full length for half the heads, and the rotary tables halve. Measured: 86,084 B per
    rank vs 163,972 B unsplit (52.5%); 4 KiB on the split side (the size of one [2, 8, 64] fp32
    tensor) is not attributed, hence 6%."""
    whole = runs["whole"]["stage0"]["activations"]
    for result in runs["split"]:
        split = result["stage0"]["activations"]
        assert whole / 2 <= split <= whole / 2 * 1.06, (split, whole)


# ---------------------------------------------------------------------------------------------
# the config key, the batch rule, the head split, the batch cut (pure: no ranks)


def test_the_batch_rule_counts_data_parallel_ranks_world_over_s() -> None:
    from zerodp.config import load_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                       "sequence_parallel_size": 2}, world_size=8)
    assert (cfg.train_batch_size, cfg.world_size, cfg.num_ranks) == (2 * 3 * 4, 4, 8)
    from zerodp.config import ConfigError

    with pytest.raises(ConfigError, match=r"train_batch_size\(48\) != .* x world_size\(4, 8 ranks / "
                                          r"sequence_parallel_size 2\) = 24"):
        load_config({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                     "sequence_parallel_size": 2}, world_size=8)


@pytest.mark.parametrize("config, given, message", [
    ({"sequence_parallel_size": 3}, None, r"sequence_parallel_size: 3 does not divide the world size \(4 ranks\); "
                                          r"use one of \[1, 2, 4\]"),
    ({"sequence_parallel_size": 2, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, None,
     r"zero_optimization.zero_hpz_partition_size with sequence_parallel_size 2: hierarchical partitioning inside "
     r"sequence parallelism is not implemented"),
    ({"sequence_parallel_size": 4}, 2, r"sequence_parallel_size: 4 in the config, but the mpu passed to "
                                       r"initialize\(\) has sequence-parallel groups of 2 ranks"),
])
def test_sizes_that_do_not_split_the_ranks_are_refused_naming_the_key(config: dict, given: int | None,
                                                                     message: str) -> None:
    from zerodp.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config({"train_micro_batch_size_per_gpu": 1, **config}, world_size=4, sequence_parallel_size=given)


def test_heads_split_over_s_and_too_few_key_value_heads_are_repeated() -> None:
    from zerodp.sequence import kv_replication

    assert kv_replication(8, 8, 4) == 1 and kv_replication(8, 2, 4) == 2 and kv_replication(8, 1, 8) == 8
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) does not divide by sequence_parallel_size "
                                         r"\(4\)"):
        kv_replication(6, 6, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) and sequence_parallel_size \(2\): neither "
                                         r"divides the other"):
        kv_replication(6, 3, 2)


def test_a_key_value_cache_outside_a_recompute_is_refused_and_a_recompute_s_is_cut_to_its_own_tokens() -> None:
    from zerodp.sequence.attention import _own_tokens

    query, key = torch.zeros(2, 4, 8, 8), torch.arange(2 * 2 * 16 * 8.0).reshape(2, 2, 16, 8).requires_grad_()
    with pytest.raises(ValueError, match=r"Ulysses attention got key \(2, 2, 16, 8\) and value \(2, 2, 16, 8\) for "
                                         r"query \(2, 4, 8, 8\) .*\(use_cache=False"):
        _own_tokens(query, key, key)
    seen = []

    class _Backward(torch.autograd.Function):  # runs `_own_tokens` inside backward, where a recompute runs
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(_own_tokens(query, key, key)[0])
            return grad

    _Backward.apply(key).sum().backward()
    assert torch.equal(seen[0], key[:, :, 8:])  # the cache appends: the last 8 positions are this call's


def test_a_batch_is_cut_along_the_sequence_with_labels_shifted_before_the_cut() -> None:
    from zerodp.sequence import shard_batch

    ids = torch.arange(8).reshape(1, 8)
    pieces = [shard_batch({"input_ids": ids, "labels": ids + 100}, rank, 2) for rank in range(2)]
    assert [p["input_ids"].tolist() for p in pieces] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # the last token of shard 0 predicts the first of shard 1; the last of all predicts nothing
    assert [p["shift_labels"].tolist() for p in pieces] == [[[101, 102, 103, 104]], [[105, 106, 107, -100]]]
    assert [p["position_ids"].tolist() for p in pieces] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert all("labels" not in p for p in pieces)


def test_a_sequence_s_does_not_divide_is_refused_unless_a_pad_token_is_given() -> None:
    from zerodp.sequence import shard_batch

    batch = {"input_ids": torch.arange(1, 8).reshape(1, 7), "labels": torch.arange(1, 8).reshape(1, 7)}
    with pytest.raises(ValueError, match=r"sequence length 7 does not divide by sequence_parallel_size 2: pad the "
                                         r"batch to a multiple of 2"):
        shard_batch(batch, 0, 2)
    last = shard_batch(batch, 1, 2, pad_token_id=0)
    assert last["input_ids"].tolist() == [[5, 6, 7, 0]]
    assert last["shift_labels"].tolist() == [[6, 7, -100, -100]]  # the pad has no label
    assert last["position_ids"].tolist() == [[4, 5, 6, 7]]  # and continues the positions


# ---------------------------------------------------------------------------------------------
# 4 ranks: S=2 x DP=2


def _stage2(rank: int, world: int, sp_size: int) -> dict:
    return _train(sp_size, 2, samples=True)


def test_two_sequence_shards_times_two_replicas_train_as_two_replicas_on_whole_sequences() -> None:
    """Ranks 0-1 share replica 0's sequences, ranks 2-3 replica 1's; stage 2 reduce-scatters over all 4
    ranks, summing each sequence group's gradients and averaging the two replicas."""
    replicas = run_ranks(_stage2, 2, args=(1,))
    for rank, result in enumerate(run_ranks(_stage2, 4, args=(2,))):
        reference = replicas[rank // 2]
        assert result["losses"] == pytest.approx(reference["losses"], rel=RTOL)
        _close(result["params"], reference["params"])
        assert result["ledger"]["all_to_all[float32]"]["bytes"] == _all_to_all_bytes(KV_HEADS)
        assert result["samples"] == reference["samples"]  # the engine's loader: a group reads its replica's


# ---------------------------------------------------------------------------------------------
# TiledMLP


class _MLP(torch.nn.Module):
    """A gated MLP, 4x wide, optionally run a sequence tile at a time."""

    def __init__(self, tiles: int) -> None:
        super().__init__()
        self.tiles = tiles
        self.up, self.gate, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    @staticmethod
    def compute(self: "_MLP", x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zerodp.sequence import TiledMLP

        return TiledMLP.apply(_MLP.compute, self, x, self.tiles, None) if self.tiles > 1 else self.compute(self, x)


def _tiled(rank: int, world: int, stage: int, tiles: int) -> dict:
    import zerodp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), _MLP(tiles), _MLP(tiles), torch.nn.Linear(16, 1))
    engine, *_ = zerodp.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2, "optimizer": OPTIMIZER,
                                                        "zero_optimization": {"stage": stage}})
    losses = []
    for step in range(STEPS):
        x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with zerodp.zero.GatheredParameters(list(model.parameters())):
        return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_tiled_mlp_trains_as_the_whole_mlp_with_one_gradient_per_parameter(stage: int) -> None:
    whole, tiled = (run_ranks(_tiled, 2, args=(stage, tiles)) for tiles in (1, 3))
    for got, want in zip(tiled, whole):
        assert got["losses"] == pytest.approx(want["losses"], rel=RTOL)
        _close(got["params"], want["params"])


def _sdpa_attention(sp_size: int = 2):
    from zerodp.sequence.attention import UlyssesAttention
    from zerodp.zero.topology import SequenceParallel

    return UlyssesAttention(lambda *args, **kwargs: None, HEADS, KV_HEADS, SequenceParallel(sp_size, 0, None, 1, 0, None),
                            masks_documents=True)


def test_sdpa_under_ulysses_refuses_a_sequence_longer_than_its_sliding_window() -> None:
    """The model's sliding-window mask is dropped with the rest, and sdpa would attend to the whole sequence."""
    attention = _sdpa_attention()
    attention._check_window(None, 64)
    attention._check_window(64, 64)
    with pytest.raises(ValueError, match=r"sliding_window=32\) on 64 tokens.*flash attention"):
        attention._check_window(32, 64)


def test_the_documents_mask_lives_as_long_as_the_shard_s_position_ids(monkeypatch) -> None:
    """Every layer (and a checkpointed block's recompute) gets the same mask; once the position ids are
    gone, so is the mask (seq x seq booleans per row)."""
    import gc

    from zerodp import comm

    monkeypatch.setattr(comm, "all_gather_into_tensor", lambda out, shard, group=None: out.copy_(shard.expand_as(out)))
    attention = _sdpa_attention()
    positions = torch.tensor([[0, 1, 0, 1]])
    whole, mask = attention._whole_positions(positions)
    assert whole.tolist() == [[0, 1, 0, 1, 0, 1, 0, 1]] and mask.shape == (1, 1, 8, 8)
    assert attention._whole_positions(positions)[1] is mask
    del positions, whole, mask
    gc.collect()
    assert attention._positions is None

"""`zerodp estimate --sequence-parallel S` and `zerodp plan` with Ulysses (zerodp/plan/sequence.py).

The simulated rank (fake tensors) against the real ranks (gloo, 2 processes) of the same tiny HF Llama
at S = 1 and S = 2, fed as the estimator feeds them: what autograd saved (the engine's
memory_report()["activations"]) equal byte for byte; the device bytes one forward leaves for backward
(the allocator's, torch's profiler: zerodp/plan/measure.py) equal byte for byte, on a busy machine too
(the trace settles gloo's collectives: comm.settled_collectives); the peak within tests/test_simulate.py's
2%; the all-to-all bytes of the formula, of the simulated ledger and of the
real ledger equal. Then the flags' checks, the longest-sequence search, the plan's proposal of S, and
docs/memory.md's longest-sequence table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks
from zerodp.cli import main

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
MICRO, SEQ = 2, 64
TOLERANCE = 0.02  # tests/test_simulate.py's band for the peak (allocator scratch the dispatcher does not see)
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama")
    LlamaConfig(**LLAMA).save_pretrained(path)
    return str(path)


def _config(sp: int) -> dict:
    from zerodp.plan.model_states import StrategySpec, strategy_config

    config = strategy_config(StrategySpec(3, dtype="fp32"), MICRO)
    return {**config, "sequence_parallel_size": sp} if sp > 1 else config


def _real(rank: int, world: int, spec: str) -> dict:
    """Each S in turn on these 2 ranks: stage 3, fp32, 2 steps, each rank fed its own shard."""
    return {sp: _train(spec, sp) for sp in (1, 2)}


def _train(spec: str, sp: int) -> dict:
    import zerodp
    import zerodp.sequence as sequence
    from zerodp import comm
    from zerodp.plan.measure import AllocatorTrace
    from zerodp.plan.sequence import simulated_ulysses
    from zerodp.plan.simulate import train_steps
    from zerodp.plan.workload import workload

    work = workload(spec)

    def batch(model, device):
        args, kwargs = work.inputs(model, MICRO, SEQ, device)
        if sp == 1:
            return args, kwargs
        piece = sequence.shard_batch(kwargs, sequence.current().sp_rank, sp)
        return (), {"input_ids": piece["input_ids"], "position_ids": piece["position_ids"],
                    "labels": piece["shift_labels"], "shift_labels": piece["shift_labels"]}

    with simulated_ulysses(sp) as ulysses, AllocatorTrace() as trace:  # the groups and attention, on real gloo
        model = work.build()
        if sp > 1:
            ulysses(model)
        engine, *_ = zerodp.initialize(model=model, config=_config(sp))
        del model
        comm.drain_pending()
        trace.mark("train")
        train_steps(engine, batch, 2, trace.mark)
    ops = engine.comm_report()["last_step"]["ops"]
    return {"peak": trace.peak_since("train"), "forward_left": trace.live_at("backward") - trace.live_at("forward"),
            "saved": engine.memory_report()["activations"].get("device", 0),
            "all_to_all": ops.get("all_to_all[float32]", {}).get("bytes", 0)}


@pytest.fixture(scope="module")
def real(llama) -> list[dict]:
    return run_ranks(_real, 2, args=(llama,))


@pytest.mark.parametrize("sp", [1, 2])
def test_activations_per_rank_are_the_real_rank_s_for_s_1_and_2(llama, real, sp: int) -> None:
    from zerodp.plan.model_states import StrategySpec
    from zerodp.plan.simulate import simulate_strategy
    from zerodp.plan.workload import workload

    for rank, runs in enumerate(real):
        sim = simulate_strategy(workload(llama), StrategySpec(3, dtype="fp32"), 2, MICRO, SEQ, device="cpu", rank=rank,
                                sequence_parallel=sp)
        got = runs[sp]
        assert sim.memory["activations"]["device"] == got["saved"], (rank, sp)
        assert sim.activations == got["forward_left"], (rank, sp, sim.activations, got)
        assert abs(sim.peak["total"].bytes - got["peak"]) <= TOLERANCE * got["peak"], \
            (rank, sp, sim.peak, got["peak"])
    halved = [runs[2]["saved"] / runs[1]["saved"] for runs in real]
    assert all(0.5 <= r <= 0.55 for r in halved), halved  # what does not fall by S: the rotary tables' row, scalars


def test_the_all_to_all_bytes_are_the_runtime_ledger_s(llama, real) -> None:
    """The formula (zerodp/plan/sequence.py), the simulated step's ledger and the real step's ledger."""
    from zerodp.plan.estimate import estimate_rows
    from zerodp.plan.workload import workload

    work = workload(llama)
    rows = estimate_rows(1, 2, "fp32", module=work.meta(), work=work, micro_batch=MICRO, seq_len=SEQ,
                         sequence_parallel=2)
    exchanged = rows[0]["all_to_all_bytes"]
    # per layer forward: q and output [2, 32, 4, 8] + k and v [2, 32, 2, 8] (2 key/value heads, S divides them)
    assert exchanged["forward_per_layer"] == exchanged["backward_per_layer"] == 4 * MICRO * (SEQ // 2) * 8 * (4 + 4 + 4)
    assert exchanged["per_micro_batch"] == 2 * 2 * exchanged["forward_per_layer"]
    simulated = {r["comm_bytes"]["all_to_all"] for r in rows if "comm_bytes" in r}
    assert simulated == {exchanged["per_micro_batch"]}
    assert [runs[2]["all_to_all"] for runs in real] == [exchanged["per_micro_batch"]] * 2
    assert [runs[1]["all_to_all"] for runs in real] == [0, 0]
    assert {r["sequence_parallel"] for r in rows} == {2}


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_with_every_block_checkpointed_the_formula_is_the_simulated_ledger_s(tmp_path, kv_heads: int) -> None:
    """Forward, the recompute's forward and backward: 3x one forward's bytes per layer, for key/value heads
    cut over S = 2 (2) and repeated to both ranks (1) ([Note: Ulysses under activation checkpointing]).
    Before zerodp/sequence/attention.py's [Note: a key/value cache under Ulysses] the recompute's k and v
    carried the cache's doubled keys: the ledger counted 163,840 bytes for the formula's 147,456."""
    from transformers import LlamaConfig

    from zerodp.plan.estimate import estimate_rows
    from zerodp.plan.workload import workload

    LlamaConfig(**{**LLAMA, "num_key_value_heads": kv_heads}).save_pretrained(tmp_path)
    work = workload(str(tmp_path))
    rows = estimate_rows(1, 2, "fp32", module=work.meta(), work=work, micro_batch=MICRO, seq_len=SEQ,
                         sequence_parallel=2, policies=("blocks",))
    exchanged = rows[0]["all_to_all_bytes"]
    forward = 4 * MICRO * (SEQ // 2) * 8 * (4 + 4 + 4)  # q, output: 4 heads; k, v: 2 heads (cut or repeated)
    assert exchanged == {"forward_per_layer": forward, "backward_per_layer": forward, "layers": 2,
                         "recomputed_layers": 2, "per_micro_batch": 2 * 3 * forward}
    assert {r["comm_bytes"]["all_to_all"] for r in rows if "comm_bytes" in r} == {2 * 3 * forward}


def test_the_printed_line_names_the_recompute_s_all_to_alls(capsys) -> None:
    from zerodp.cli.estimate import _print_sequence_parallel
    from zerodp.plan.sequence import Heads, all_to_all_bytes

    for policy, said in [("blocks", ", the forward's again in the recompute of 2 checkpointed layers, 147,456 over"),
                         ("none", " backward, 98,304 over")]:
        exchanged = all_to_all_bytes(Heads(4, 2, 8, 2, "sdpa"), MICRO, SEQ, 2, 4, policy).as_dict()
        _print_sequence_parallel({"sequence_parallel": 2, "world_size": 2, "all_to_all_bytes": exchanged}, MICRO, SEQ)
        assert said in capsys.readouterr().out, policy


def test_model_states_do_not_depend_on_s_zero_partitions_over_every_rank(capsys) -> None:
    def rows(*flags: str) -> list[dict]:
        assert main(["estimate", str(ROOT / "docs/models/llama-8b"), "--world-size", "8", "--model-states-only",
                     "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    plain, split = rows(), rows("--sequence-parallel", "8")
    assert [r["by_category"] for r in plain] == [r["by_category"] for r in split]
    assert {r["sequence_parallel"] for r in split} == {8} and {r["sequence_parallel"] for r in plain} == {1}


@pytest.mark.parametrize("argv, message", [
    (["--params", "7B", "--world-size", "8", "--sequence-parallel", "3"],
     r"--sequence-parallel 3 does not divide --world-size 8: each sequence is split over 3 of the ranks; use one of "
     r"\[1, 2, 4, 8\]"),
    (["docs/models/llama-8b", "--world-size", "3", "--sequence-parallel", "3", "--model-states-only"],
     r"--sequence-parallel 3: num_attention_heads \(32\) does not divide by sequence_parallel_size \(3\)"),
    (["demo", "--world-size", "2", "--sequence-parallel", "2"],
     r"--sequence-parallel 2: MODEL demo is not a Hugging Face model"),
    (["docs/models/llama-8b", "--world-size", "8", "--sequence-parallel", "8", "--seq-len", "1001"],
     r"--seq-len 1001 does not divide by --sequence-parallel 8: .*; use 1008"),
    (["--params", "7B", "--sequence-parallel", "two"], r"--sequence-parallel two: expected a positive number"),
])
def test_a_size_the_ranks_heads_or_sequence_do_not_take_is_refused_naming_the_flag(capsys, argv, message) -> None:
    argv = [str(ROOT / a) if a.startswith("docs/") else a for a in argv]
    assert main(["estimate", *argv]) == 2
    assert re.search(message, capsys.readouterr().err), message


def test_key_value_heads_fewer_than_s_are_repeated_as_the_runtime_does() -> None:
    """Llama-3.1-8B: 8 key/value heads. S = 16 repeats each to 2 ranks, so k and v send as 16 heads each."""
    from zerodp.plan.sequence import Heads, all_to_all_bytes, sequence_parallel_problems, sequence_parallel_sizes

    heads = Heads(32, 8, 128, 32, "sdpa")
    assert sequence_parallel_problems(16, 16, heads, "llama") == []
    at_8, at_16 = (all_to_all_bytes(heads, 1, 2**20, s, 2) for s in (8, 16))
    assert at_8.forward_per_layer == 2 * 2**17 * 128 * (64 + 16)
    assert at_16.forward_per_layer == 2 * 2**16 * 128 * (64 + 32)
    assert sequence_parallel_sizes(64, heads) == [2, 4, 8, 16, 32]  # 64 does not divide the 32 query heads
    assert sequence_parallel_problems(3, 6, Heads(6, 3, 8, 2, "eager"), "m") == [
        "--sequence-parallel 3: m uses attn_implementation='eager', which cannot run sequence-parallel (it needs the "
        "[seq, seq] attention mask, which the model builds for its shard only; use 'sdpa' or a flash attention)"]


# ---------------------------------------------------------------------------------------------
# the longest sequence


@pytest.mark.parametrize("shape", ["affine", "steps", "quadratic"])
def test_the_longest_sequence_search_finds_what_a_scan_finds(shape: str) -> None:
    from zerodp.plan.sequence import longest_sequence

    peak = {"affine": lambda n: 1000 + 3 * n, "steps": lambda n: 1000 + 3 * n + (5000 if n > 40_000 else 0),
            "quadratic": lambda n: 1000 + n * n // 50_000}[shape]
    budget, granule = 200_000, 1024
    scanned = max(n for n in range(granule, 10**6, granule) if peak(n) <= budget)
    found = longest_sequence(peak, budget, granule, 4 * granule)
    assert found.seq_len == scanned
    if shape == "affine":  # the line's answer, checked at it and one granule beyond: 4 peaks in all
        assert (found.simulations, found.fixed_bytes, found.per_token_bytes) == (4, 1000, 3)
        assert found.peak_at <= budget < found.peak_beyond


def test_a_simulated_peak_is_affine_in_the_sequence(llama) -> None:
    """What lets the search start from a line ([Note: the estimator's sequence parallelism]): on the tiny
    Llama, with and without S and checkpointing, every doubling of the sequence adds twice the bytes.
    (Below ~1,000 tokens with blocks checkpointed the peak is another point of backward, a line of its own:
    at S = 2, 325,192 / 578,120 / 1,098,184 bytes at 256 / 512 / 1,024 tokens.)"""
    from zerodp.plan.model_states import StrategySpec
    from zerodp.plan.simulate import simulate_strategy
    from zerodp.plan.workload import workload

    for sp, policy in [(1, "none"), (2, "blocks")]:
        peaks = [simulate_strategy(workload(llama), StrategySpec(3, "cpu"), 2, 1, n, policy,
                                   sequence_parallel=sp).peak["device"].bytes for n in (1024, 2048, 4096)]
        assert peaks[2] - peaks[1] == 2 * (peaks[1] - peaks[0]), (sp, policy, peaks)


def test_a_config_without_the_key_value_cache_simulates_no_sequence_by_sequence_mask(tmp_path) -> None:
    """With `use_cache: false` transformers looks for packed documents in the position ids by value, and
    on fake tensors it would build the s x s mask that the real, unpacked batch never gets (the peak went
    1,281,416 / 3,164,528 / 10,477,936 bytes at 256 / 512 / 1,024 tokens): the simulation answers the check
    as the real batch does, so the peak is a line again, below the one with the cache (which keeps every
    layer's keys and values)."""
    from transformers import LlamaConfig

    from zerodp.plan.model_states import StrategySpec
    from zerodp.plan.simulate import simulate_strategy
    from zerodp.plan.workload import workload

    LlamaConfig(**LLAMA, use_cache=False).save_pretrained(tmp_path)
    peaks = [simulate_strategy(workload(str(tmp_path)), StrategySpec(3, "cpu"), 2, 1, n, "none").peak["device"].bytes
             for n in (256, 512, 1024)]
    assert peaks[2] - peaks[1] == 2 * (peaks[1] - peaks[0]), peaks
    assert peaks == [1019288, 1993112, 3940760]  # measured; with the cache: 1,052,056 / 2,058,648 / 4,071,832


def _memory_table() -> list[dict]:
    """docs/memory.md's longest-sequence rows: GPUs, S, tokens, ALST's figure."""
    text = (ROOT / "docs/memory.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \|", text, re.M)
    return [{"gpus": int(g), "sp": int(s), "tokens": int(t.replace(",", "")), "fixed": float(f), "per_token": float(p)}
            for g, s, t, f, p in rows]


def test_the_memory_doc_s_longest_sequence_table_is_the_estimator_s() -> None:
    """Every row's figure follows from its line (fixed GB + per-token kB x tokens <= 72 GB, to the rounding
    shown), and the 8-GPU rows the issue asks for are simulated again: Llama-3.1-8B's shape fits at the
    documented length and not 1,024 tokens more (4 simulations of the 8B model: ~1 min here)."""
    from zerodp.plan.model_states import StrategySpec
    from zerodp.plan.simulate import simulate_strategy
    from zerodp.plan.workload import workload

    rows = _memory_table()
    assert {(r["gpus"], r["sp"]) for r in rows} >= {(1, 1), (8, 1), (8, 8), (32, 32)}
    budget = 72e9
    for r in rows:
        by_line = (budget - r["fixed"] * 1e9) / (r["per_token"] * 1e3)
        assert abs(by_line - r["tokens"]) <= 1024 + by_line * 0.002, r
    work = workload(str(ROOT / "docs/models/llama-8b"))
    for r in (r for r in rows if r["gpus"] == 8):
        fits, over = (simulate_strategy(work, StrategySpec(3, "cpu"), 8, 1, n, "blocks",
                                        sequence_parallel=r["sp"]).peak["device"].bytes
                      for n in (r["tokens"], r["tokens"] + 1024))
        assert fits <= budget < over, (r, fits, over)


# ---------------------------------------------------------------------------------------------
# zerodp plan proposes S


def test_plan_proposes_the_smallest_s_when_the_sequence_not_the_model_does_not_fit(llama, tmp_path, capsys) -> None:
    from zerodp.config import load_config

    flags = ["--gpu", "cpu", "--gpus-per-node", "4", "--seq-len", "1024", "--global-batch", "4",
             "--activation-checkpointing", "none"]
    out = tmp_path / "ds.json"
    assert main(["plan", llama, *flags, "--gpu-memory", "3MB", "--output", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["sequence_parallel"] == 2, printed["why"]
    assert re.match(r"the sequence, not the model, does not fit: stage \d.* holds [\d.]+ kB of model states, but one "
                    r"sequence of 1024 tokens peaks at [\d.]+ MB of 3.00 MB usable; sequence_parallel_size 2 \(Ulysses: "
                    r"each rank holds 512 of the tokens\) is the smallest that fits", printed["why"]), printed["why"]
    assert all(c["sequence_parallel"] == 2 and c["peak_bytes"] <= 3e6 for c in printed["candidates"])
    config = load_config(str(out), world_size=4)  # 4 samples = micro x accumulation x 2 data-parallel replicas
    assert config.sequence_parallel_size == 2 and config.train_batch_size == 4
    # a budget that needs S = 4: 2 is named as too small
    assert main(["plan", llama, *flags, "--gpu-memory", "1.8MB", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["sequence_parallel"] == 4 and "is the smallest that fits ([2] do not)" in printed["why"]
    # the model states do not fit: no sequence parallelism proposed
    assert main(["plan", llama, *flags, "--gpu-memory", "50kB", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["sequence_parallel"] == 1


def test_plan_prices_the_all_to_alls_inside_the_sequence_group(llama) -> None:
    """S = 2 on 2 nodes of 2 ranks: the simulated step's all-to-alls cost half their bytes at the node's
    bandwidth plus a latency per call, not a ring over the 4 ranks at the inter-node bandwidth."""
    from zerodp.plan.cluster import gpu_cluster
    from zerodp.plan.planner import plan
    from zerodp.plan.workload import workload

    cluster = gpu_cluster("cpu", gpus_per_node=2, nodes=2, intra_node_bandwidth=1e6, inter_node_bandwidth=1e5)
    result = plan(workload(llama), cluster, SEQ, 4, "bf16", ("none",), sequence_parallel=2)
    assert result.candidates
    for c in result.candidates:
        handed = 2 * 2 * 2 * MICRO * (SEQ // 2) * 8 * (4 + 4 + 4) * c.accumulation  # 2 layers x fwd+bwd, bf16
        calls = 2 * 2 * 4 * c.accumulation  # q, k, v and the output, forward and backward, per layer
        assert c.micro_batch == MICRO and c.sequence_parallel == 2
        assert c.time.all_to_all == pytest.approx(handed / 2 / 1e6 + calls * 1e-4)  # 0.0262 s
        assert c.time.all_to_all < handed * 3 / 4 / 1e5 / 10  # the old price: 0.369 s
        assert c.as_dict()["step_seconds"]["all_to_all"] == c.time.all_to_all


def test_plan_refuses_a_size_the_ranks_do_not_take(llama, capsys) -> None:
    assert main(["plan", llama, "--gpu", "cpu", "--gpus-per-node", "4", "--seq-len", "64", "--global-batch", "4",
                 "--sequence-parallel", "3"]) == 2
    assert "--sequence-parallel 3 does not divide the 4 ranks (--gpus-per-node 4 x --nodes 1)" in capsys.readouterr().err

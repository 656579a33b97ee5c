"""Ulysses sequence parallelism in the estimator: which sizes a model and a world take, the all-to-all
bytes per layer, the simulated rank's sequence shard, and the longest sequence that fits.

`zerodp estimate MODEL --sequence-parallel S` and `zerodp plan` simulate a rank as the runtime runs it
(zerodp/sequence/): the groups built, the model's attention function wrapped in `UlyssesAttention`, the
batch cut by `shard_batch` (rank 0's shard), so activations, transients and collectives are counted
by the same code that trains ([Note: simulating a rank] in zerodp/plan/simulate.py).

[Note: the estimator's sequence parallelism]
With S ranks per sequence, each rank holds L/S tokens of every activation outside attention; inside
it, q, k, v and the output of H/S heads for all L tokens, the same number of elements (H/S x L =
H x L/S), and flash attention keeps O(L) per head for backward. ZeRO partitions over all N ranks
(dp x sp), as the runtime does, so model states do not depend on S. Two consequences the estimator
uses: every byte that grows with the sequence grows linearly in L/S (the logits, the saved block
inputs, one recomputed block, the rotary tables, the attention's statistics), so a simulated peak
is affine in L, peak(L) = fixed + per_token x L (`longest_sequence` finds the longest L from two
simulations and checks it with two more); and the FLOPs per rank are the unsplit sequence's over S
(every matmul and the attention of H/S heads run on one S-th of the work).

[Note: Ulysses under activation checkpointing]
A checkpointed block keeps only its input, so backward runs its forward again, and the attention's
saved tensors (q, k, v for H/S heads over all L tokens, the output that o_proj saves) exist only after
the all-to-alls: the recompute exchanges the forward's bytes once more, and a layer hands over 3x its
forward's bytes (forward, recompute, backward) instead of 2x. That is inherent in checkpointing the
whole block (keeping the exchanged tensors would keep what checkpointing frees). Each all-to-all's
backward hands over exactly its forward's tensor, so the per-layer figures are the same with and
without it; `recomputed_layers` counts the blocks a policy checkpoints (every decoder layer, the
blocks zerodp.checkpointing.apply finds; "selective" is counted as "blocks", its policy recomputes the
collectives, and is not measured: torch's selective checkpointing fails on transformers' Llama). Measured (tests/test_sequence_parallel.py,
tests/test_estimate_sp.py): the real and the simulated ledgers equal this, for key/value heads cut
(K >= S) and repeated (K < S). Before zerodp/sequence/attention.py's [Note: a key/value cache under
Ulysses] they counted 3.2x for Llama-3.1-8B at S = 8: the recompute sent the keys and values twice.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch

    from zerodp.plan.workload import Workload

FLAG = "--sequence-parallel"
MAX_SEARCH_STEPS = 64  # simulations a longest-sequence search may add to its first two (a bisection needs ~30)


@dataclass(frozen=True)
class Heads:
    """What Ulysses needs from a Hugging Face model's config: its attention heads and layers, and the
    attention function it calls by name."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    attn_implementation: str | None


def model_heads(module: "torch.nn.Module | None") -> Heads | None:
    """The heads of a Hugging Face model (built on meta), None for a model without a transformers config
    (the demo's GPT, a module:function of one's own): Ulysses patches transformers' attention functions."""
    config = getattr(module, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or not hasattr(config, "_attn_implementation"):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Heads(heads, int(kv_heads), int(head_dim), int(config.num_hidden_layers), config._attn_implementation)


def sequence_parallel_problems(sp_size: int, num_ranks: int, heads: Heads | None, model: str | None,
                               ranks: str = "--world-size {}") -> list[str]:
    """Why `--sequence-parallel sp_size` cannot run `model` (None: a parameter count, whose heads are
    unknown) on `num_ranks` ranks (`ranks` names the flag that set them): the runtime's own rules
    (zerodp/config/batch.py, zerodp/sequence/attention.py's kv_replication, zerodp/sequence/hf.py's
    refused attentions), each naming the flag and the values."""
    from zerodp.sequence.attention import kv_replication
    from zerodp.sequence.hf import REFUSED

    if sp_size == 1:
        return []
    problems = []
    if num_ranks % sp_size:
        divisors = [d for d in range(1, num_ranks + 1) if num_ranks % d == 0]
        problems.append(f"{FLAG} {sp_size} does not divide {ranks.format(num_ranks)}: each sequence is split over "
                        f"{sp_size} of the ranks; use one of {divisors}")
    if model is None:
        return problems
    if heads is None:
        return problems + [f"{FLAG} {sp_size}: MODEL {model} is not a Hugging Face model (Ulysses wraps the attention "
                           "function transformers calls by name); give its config.json"]
    try:
        kv_replication(heads.num_heads, heads.num_kv_heads, sp_size)
    except ValueError as err:
        problems.append(f"{FLAG} {sp_size}: {err}")
    if heads.attn_implementation in REFUSED:
        problems.append(f"{FLAG} {sp_size}: {model} uses attn_implementation={heads.attn_implementation!r}, which "
                        f"cannot run sequence-parallel ({REFUSED[heads.attn_implementation]})")
    return problems


def sequence_parallel_sizes(num_ranks: int, heads: Heads) -> list[int]:
    """The sizes `zerodp plan` tries, smallest first: 2, 4, 8, ... that divide the ranks and that the
    heads take (the runtime's rules)."""
    out, size = [], 2
    while size <= num_ranks:
        if not sequence_parallel_problems(size, num_ranks, heads, "MODEL"):
            out.append(size)
        size *= 2
    return out


@dataclass(frozen=True)
class AllToAll:
    """Bytes one rank hands to Ulysses' all-to-alls per micro-batch: per layer forward (q, k, v and the
    attention output) and backward (their gradients), the forward's again in the recompute of each
    checkpointed layer, and over all layers of one micro-batch."""

    forward_per_layer: int
    backward_per_layer: int
    num_layers: int
    recomputed_layers: int = 0  # layers whose forward, the all-to-alls included, backward runs again

    @property
    def per_micro_batch(self) -> int:
        return self.num_layers * (self.forward_per_layer + self.backward_per_layer) + \
            self.recomputed_layers * self.forward_per_layer

    def as_dict(self) -> dict:
        return {"forward_per_layer": self.forward_per_layer, "backward_per_layer": self.backward_per_layer,
                "layers": self.num_layers, "recomputed_layers": self.recomputed_layers,
                "per_micro_batch": self.per_micro_batch}


def all_to_all_bytes(heads: Heads, micro_batch: int, seq_len: int, sp_size: int, dtype_bytes: int,
                     activation_checkpointing: str | None = "none") -> AllToAll:
    """What the comm ledger counts for Ulysses' all-to-alls on one rank (an all-to-all counts the tensor
    handed over: zerodp/comm/ledger.py): per layer forward, q [b, L/S, H, d], k and v with the key/value
    heads repeated up to S when there are fewer (zerodp/sequence/attention.py), and the output
    [b, L/S, H, d]; backward the same shapes again. 2 x dtype x b x L/S x d x (2H + 2 max(K, S)) per layer,
    and the forward's half once more per layer under a checkpointing policy ([Note: Ulysses under
    activation checkpointing])."""
    from zerodp.sequence.attention import kv_replication

    if sp_size == 1:
        return AllToAll(0, 0, heads.num_layers)
    kv_sent = heads.num_kv_heads * kv_replication(heads.num_heads, heads.num_kv_heads, sp_size)
    forward = dtype_bytes * micro_batch * (seq_len // sp_size) * heads.head_dim * (2 * heads.num_heads + 2 * kv_sent)
    recomputed = heads.num_layers if activation_checkpointing not in (None, "none") else 0
    return AllToAll(forward, forward, heads.num_layers, recomputed)


@contextlib.contextmanager
def simulated_ulysses(sp_size: int) -> Iterator[Callable[["torch.nn.Module"], None]]:
    """Inside a simulated world (zerodp/plan/simulate.py): a `prepare(model)` that builds the
    sequence-parallel groups and wraps the model's attention as the runtime does; on exit the
    attention function and the groups are put back."""
    import zerodp.sequence as sequence

    registered: list[str] = []  # what to put back: the attention function wrapped ("" once the groups exist)

    def prepare(model: "torch.nn.Module") -> None:
        implementation = model.config._attn_implementation
        groups = sequence.initialize_sequence_parallel(sp_size)
        registered.append("")
        sequence.register_attention(model, implementation, groups)
        registered.append(implementation)

    try:
        yield prepare
    finally:
        for implementation in filter(None, registered):
            sequence.unregister_attention(implementation)
        if registered:
            sequence.reset()


def sharded_inputs(work: "Workload", micro_batch: int, seq_len: int, sp_size: int) -> Callable:
    """The batch function of a simulated rank: `work`'s micro-batch of `seq_len` tokens cut by the
    runtime's `shard_batch` (rank 0's shard of L/S tokens, position ids, pre-shifted labels), fed as
    tests/test_sequence_parallel.py feeds a Hugging Face model."""
    from zerodp.sequence import shard_batch

    def inputs(model: "torch.nn.Module", device: Any) -> tuple[tuple, dict]:
        args, kwargs = work.inputs(model, micro_batch, seq_len, device)
        if args or "input_ids" not in kwargs:
            raise ValueError(f"{FLAG} {sp_size}: MODEL {work.spec!r} is not fed input_ids and labels (a Hugging Face "
                             "causal LM), so its batch cannot be cut along the sequence")
        piece = shard_batch(kwargs, 0, sp_size)
        return (), {"input_ids": piece["input_ids"], "position_ids": piece["position_ids"],
                    "labels": piece["shift_labels"], "shift_labels": piece["shift_labels"]}

    return inputs


@dataclass(frozen=True)
class Longest:
    """The longest sequence that fits (0: not even `granule` tokens), the line peak = fixed_bytes +
    per_token_bytes x tokens through the peaks simulated at it and one granule beyond (`peak_at`,
    `peak_beyond`; where one was not simulated, the first line the search started from), and the
    number of simulations."""

    seq_len: int
    fixed_bytes: int
    per_token_bytes: float
    peak_at: int | None
    peak_beyond: int | None
    simulations: int


def longest_sequence(peak: Callable[[int], int], budget_bytes: int, granule: int, start: int) -> Longest:
    """The longest multiple of `granule` tokens whose `peak(seq_len)` (device bytes, growing with the
    sequence) stays within `budget_bytes`; `start` is a multiple of `granule`. Two simulations at
    `start` and 2 x `start` fix the affine peak ([Note: the estimator's sequence parallelism]); its
    answer is checked by simulating it and one granule more (4 simulations in all when the line holds),
    and where it did not hold the search bisects between what fits and what does not, so the answer is
    the simulation's whatever the shape."""
    if start % granule or start < granule:
        raise AssertionError(f"start {start} is not a positive multiple of the granule {granule}")
    peaks: dict[int, int] = {tokens: peak(tokens) for tokens in (start, 2 * start)}
    per_token = (peaks[2 * start] - peaks[start]) / start
    fixed = round(peaks[start] - per_token * start)
    if per_token <= 0:
        raise ValueError(f"the simulated peak does not grow with the sequence ({peaks[start]:,} bytes at {start} "
                         f"tokens, {peaks[2 * start]:,} at {2 * start}): there is no longest sequence to find")
    fits = max((t for t, p in peaks.items() if p <= budget_bytes), default=0)
    over = min((t for t, p in peaks.items() if p > budget_bytes), default=None)
    candidate = int((budget_bytes - fixed) / per_token) // granule * granule
    for step in range(MAX_SEARCH_STEPS):
        if over is not None and over - fits <= granule:
            return _found(fits, granule, peaks, fixed, per_token)
        line_holds = step < 2 and fits < candidate and (over is None or candidate < over)  # its answer, then 1 granule on
        if not line_holds:  # the line missed: bisect (double while everything fits)
            candidate = 2 * fits if over is None else (fits + over) // 2 // granule * granule
        peaks[candidate] = peak(candidate)
        if peaks[candidate] <= budget_bytes:
            fits, candidate = candidate, candidate + granule
        else:
            over, candidate = candidate, candidate - granule
    raise AssertionError(f"no longest sequence after {MAX_SEARCH_STEPS} simulations: fits {fits}, over {over}")


def _found(seq_len: int, granule: int, peaks: dict[int, int], fixed: int, per_token: float) -> Longest:
    """The answer, with the line through the peaks at it and one granule beyond where both were
    simulated (the cost of a token there), else the first line."""
    at, beyond = peaks.get(seq_len), peaks.get(seq_len + granule)
    if at is not None and beyond is not None and seq_len:
        per_token = (beyond - at) / granule
        fixed = round(at - per_token * seq_len)
    return Longest(seq_len, fixed, per_token, at, beyond, len(peaks))


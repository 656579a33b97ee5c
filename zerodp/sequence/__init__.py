"""Ulysses sequence parallelism: one sequence cut across the S ranks of a sequence-parallel group.

Each rank holds seq/S tokens through every layer, so activations per rank fall by S; around
attention, two all-to-alls give each rank the whole sequence for heads/S heads (all_to_all.py's
[Note: the Ulysses all-to-all]). ZeRO partitions over every rank as without it (zero/topology.py's
[Note: sequence-parallel groups]); `sequence_parallel_size` in the config, or the groups built here
before `zerodp.initialize`, turn it on.

- groups.py: the process's sequence-parallel groups (`initialize_sequence_parallel`, `current`);
- all_to_all.py: the differentiable exchange, heads <-> sequence;
- attention.py: `UlyssesAttention` around an attention function of Hugging Face's signature;
- hf.py: `register_attention` (transformers' attention registry, patched by name);
- data.py: `shard_batch`, `SequenceShardLoader` (pre-shifted labels, position ids);
- loss.py: `sequence_parallel_loss`, the sequence's mean loss from its shards;
- tiled.py: `TiledMLP`, an MLP a sequence tile at a time (DeepSpeed's ALST signature);
- tiled_compute.py: `sequence_tiled_compute` (any function a sequence shard at a time) and
  `TiledFusedLogitsLoss` (head + loss a shard of tokens at a time), DeepSpeed's signatures.

Recipe (a Hugging Face causal LM, `torchrun --nproc-per-node 4 train.py`, config
{"sequence_parallel_size": 2, ...}):
    zerodp.init_distributed()
    sp = zerodp.sequence.initialize_sequence_parallel(2)
    zerodp.sequence.register_attention(model, "sdpa", sp)
    engine, *_ = zerodp.initialize(model=model, config=config)
    for batch in loader:                      # the same samples on the 2 ranks of a group
        piece = zerodp.sequence.shard_batch(batch, sp.sp_rank, sp.sp_size)
        out = engine(input_ids=piece["input_ids"], position_ids=piece["position_ids"],
                     labels=piece["shift_labels"], shift_labels=piece["shift_labels"])
        loss = zerodp.sequence.sequence_parallel_loss(out.loss, piece["shift_labels"], sp.sp_group)
        engine.backward(loss); engine.step()
"""

from zerodp.sequence.all_to_all import exchange, heads_to_ranks, sequence_to_ranks
from zerodp.sequence.attention import UlyssesAttention, kv_replication
from zerodp.sequence.data import SequenceShardLoader, shard_batch, shift_labels
from zerodp.sequence.groups import current, initialize_sequence_parallel, is_initialized, reset
from zerodp.sequence.hf import register_attention, unregister_attention
from zerodp.sequence.loss import sequence_parallel_loss
from zerodp.sequence.tiled import TiledMLP
from zerodp.sequence.tiled_compute import SequenceTiledCompute, TiledFusedLogitsLoss, sequence_tiled_compute

__all__ = ["SequenceShardLoader", "SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "UlyssesAttention",
           "current", "exchange", "heads_to_ranks", "initialize_sequence_parallel", "is_initialized", "kv_replication", "register_attention", "reset",
           "sequence_parallel_loss", "sequence_tiled_compute", "sequence_to_ranks", "shard_batch", "shift_labels",
           "unregister_attention"]

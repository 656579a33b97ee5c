"""Which ranks share a machine, and the process groups of hierarchical partitioning at stage 3.

A rank's node is named by its host name and torchrun's node rank (GROUP_RANK): two hosts always differ
by name; on one machine, hosts made as network namespaces share a name but torchrun gives them
different node ranks; ranks started without torchrun (one machine) have no node rank. The arithmetic
(`ranks_by_node`) is pure; `node_layout` gathers every rank's name once. The comm ledger uses the
layout to count bytes per link, node-local checkpoints to find each host's directory.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from zerodp import comm
from zerodp.config.batch import sequence_parallel_problem


def node_name() -> str:
    """This rank's node: `hostname` plus `#GROUP_RANK` when torchrun set a node rank."""
    group_rank = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f"#{group_rank}" if group_rank is not None else "")


def ranks_by_node(names: list[str]) -> list[list[int]]:
    """Group ranks (the index into `names`) by node name, nodes in order of their lowest rank."""
    nodes: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        nodes.setdefault(name, []).append(rank)
    return list(nodes.values())


@dataclass(frozen=True)
class NodeLayout:
    """Every rank's node: `nodes[k]` lists node k's ranks (ascending), `names[k]` its name."""

    nodes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]

    def node_of(self, rank: int) -> int:
        """The index of the node that runs `rank`."""
        return next(k for k, ranks in enumerate(self.nodes) if rank in ranks)

    def describe(self, node: int) -> str:
        """'host NAME (ranks A-B)' for messages."""
        ranks = self.nodes[node]
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"host {self.names[node]} ({span})"


def node_layout() -> NodeLayout:
    """The node layout of the default group (a collective: every rank calls it)."""
    names = comm.gather_messages(node_name(), max_bytes=256) if comm.get_world_size() > 1 else [node_name()]
    groups = ranks_by_node([name or "" for name in names])
    return NodeLayout(tuple(map(tuple, groups)), tuple(names[ranks[0]] or "" for ranks in groups))


# ---------------------------------------------------------------------------------------------
# hierarchical partitioning at stage 3 (see [Note: hierarchical partitioning])

# [Note: hierarchical partitioning]
# Flat stage 3 shards every unit over all N ranks, so each of its three collectives per step
# (all-gather in forward and in backward, reduce-scatter of the gradients) spans every node.
# - MiCS (`mics_shard_size` = S, FSDP2's HSDP): parameters, gradients and optimizer state are sharded
#   over groups of S consecutive ranks (ideally one node) and replicated across the N/S groups. The
#   all-gathers stay inside the group; gradients are reduce-scattered inside it, then all-reduced
#   across the replicas (ranks with the same position in each group). Memory per rank is that of
#   stage 3 at S ranks; the inter-node link carries only the all-reduce of a 1/S gradient shard.
# - hpZ (`zero_hpz_partition_size` = S, ZeRO++): everything stays sharded over all N ranks (memory
#   of flat stage 3), and each rank also keeps a secondary copy of its 1/S of every unit's 16-bit
#   parameters, taken from the forward's all-gather over all ranks. Until the next optimizer step the
#   parameters do not change, so every later gather of the unit (backward, recomputation, the next
#   micro-batch's forward) all-gathers from the secondary shards inside the group of S. The
#   reduce-scatter still spans all ranks.


def rank_blocks(num_ranks: int, block_size: int) -> list[list[int]]:
    """Consecutive blocks of `block_size` ranks: [[0..S-1], [S..2S-1], ...] (S divides num_ranks)."""
    return [list(range(start, start + block_size)) for start in range(0, num_ranks, block_size)]


def rank_strides(num_ranks: int, block_size: int) -> list[list[int]]:
    """The ranks at the same position of every block: [[0, S, 2S, ...], [1, S+1, ...], ...]."""
    return [list(range(position, num_ranks, block_size)) for position in range(block_size)]


@dataclass(frozen=True)
class Partition:
    """How stage 3 partitions over the data-parallel ranks (flat, MiCS or hpZ: see [Note:
    hierarchical partitioning]). Groups are None where they would be every rank or one rank."""

    shard_size: int  # ranks a unit's flat buffers are cut over
    shard_rank: int  # this rank's position among them
    shard_group: object | None  # those ranks (None: all)
    num_replicas: int = 1  # MiCS: groups holding the same shards
    replica_index: int = 0  # MiCS: which of them this rank is in (0 saves checkpoints)
    replica_group: object | None = None  # MiCS: the ranks holding this rank's shard
    secondary_size: int = 1  # hpZ: ranks of the secondary partition (1: none)
    secondary_rank: int = 0
    secondary_group: object | None = None


def stage3_partition(mics_shard_size: int, hpz_partition_size: int) -> Partition:
    """Build the process groups of the configured partition (a collective: every rank calls it, with
    the same sizes; load_config has checked that they divide the world size)."""
    rank, world = comm.get_rank(), comm.get_world_size()
    if 1 < mics_shard_size < world:  # load_config refuses 1 (that would be DDP)
        size = mics_shard_size
        shard_group = _my_group(rank_blocks(world, size), rank)
        replica_group = _my_group(rank_strides(world, size), rank)
        return Partition(size, rank % size, shard_group, world // size, rank // size, replica_group)
    if hpz_partition_size > 1:
        size = hpz_partition_size
        return Partition(world, rank, None, secondary_size=size, secondary_rank=rank % size,
                         secondary_group=_my_group(rank_blocks(world, size), rank))
    return Partition(world, rank, None)


def _my_group(groups: list[list[int]], rank: int):
    """Create every group (every rank must create each one) and return the one holding `rank`."""
    made = [comm.new_group(ranks) for ranks in groups]
    return next(group for group, ranks in zip(made, groups) if rank in ranks)


def stage3_link_numel(mode: str, numel: int, group_size: int, micro_batches: int) -> dict[str, int]:
    """Elements one rank moves per optimizer step on each link at stage 3, as the comm ledger counts
    them (zerodp/comm/ledger.py: an all-gather its output, a reduce-scatter its input, an all-reduce twice),
    for `numel` parameter elements (padded) in units released between forward and backward, with
    `micro_batches` forward-backward passes per step, on more than one node. `mode`: "flat" (every
    collective spans the nodes), "hpz" or "mics" with `group_size` ranks per group, each group one
    node (see [Note: hierarchical partitioning]). The 2-element gradient-norm all-reduce is left out."""
    k = micro_batches
    if mode == "flat":
        return {comm.INTRA_NODE: 0, comm.INTER_NODE: 3 * k * numel}
    if mode == "hpz":  # the step's first forward gathers over all ranks; every later gather in the node
        return {comm.INTRA_NODE: (2 * k - 1) * numel, comm.INTER_NODE: numel + k * numel}
    if mode == "mics":  # everything in the group; each 1/S gradient shard all-reduced once per step
        return {comm.INTRA_NODE: 3 * k * numel, comm.INTER_NODE: 2 * numel // group_size}
    raise ValueError(f"mode {mode!r}: expected 'flat', 'hpz' or 'mics'")


# ---------------------------------------------------------------------------------------------
# sequence parallelism (Ulysses): data-parallel x sequence-parallel (see [Note: sequence-parallel groups])

# [Note: sequence-parallel groups]
# `sequence_parallel_size` = S splits the N ranks into N/S sequence-parallel groups of S consecutive
# ranks (ranks 0..S-1 share one sequence, as DeepSpeed's parallel_state_sp and its (dp, sp) device mesh
# lay them out: the sequence group is the inner, fastest dimension, ideally inside one node, because
# its all-to-alls run in every attention layer). The N/S ranks at the same position of every group form
# a data-parallel group. ZeRO is unchanged by S: parameters, gradients and optimizer states stay
# partitioned over all N ranks and gradients are reduced over all N. What S changes is the mean:
# the S ranks of one group each computed the gradient of their own share of one sample's loss, so
# their gradients are summed, and only the N/S data-parallel replicas are averaged (DeepSpeed divides
# by N / S at every stage: its engine's `dp_world_size / sequence_parallel_size`). The batch rule
# counts N/S data-parallel ranks, and the data loader gives the S ranks of a group the same samples.


def gradient_mean_factor(num_ranks: int, sequence_parallel_size: int) -> float:
    """What each rank's gradient is multiplied by before the sum over all `num_ranks` ranks: the mean
    over the data-parallel replicas, the sum over the sequence-parallel ranks (see [Note:
    sequence-parallel groups]); 1 / num_ranks without sequence parallelism."""
    return sequence_parallel_size / num_ranks


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in data-parallel x sequence-parallel (see [Note: sequence-parallel groups]).
    Groups are None where they would be one rank (S = 1: no sequence group; S = N: no data group)."""

    sp_size: int  # ranks that share one sequence
    sp_rank: int  # this rank's position among them: which shard of the sequence it holds
    sp_group: object | None
    dp_size: int  # data-parallel replicas: num_ranks / sp_size
    dp_rank: int  # which of them this rank is in: which samples it reads
    dp_group: object | None

    @staticmethod
    def of_rank(rank: int, num_ranks: int, sp_size: int) -> "SequenceParallel":
        """The positions alone (pure; no groups): for checks and the batch rule."""
        return SequenceParallel(sp_size, rank % sp_size, None, num_ranks // sp_size, rank // sp_size, None)


def sequence_parallel_groups(sp_size: int) -> SequenceParallel:
    """Build the sequence-parallel and data-parallel groups of `sp_size` (a collective: every rank
    calls it with the same size; the caller has checked that it divides the world size)."""
    rank, world = comm.get_rank(), comm.get_world_size()
    problem = sequence_parallel_problem(world, sp_size)
    if problem:
        raise ValueError(problem)
    where = SequenceParallel.of_rank(rank, world, sp_size)
    sp_group = _my_group(rank_blocks(world, sp_size), rank) if sp_size > 1 else None
    dp_group = _my_group(rank_strides(world, sp_size), rank) if 1 < sp_size < world else None
    return SequenceParallel(sp_size, where.sp_rank, sp_group, where.dp_size, where.dp_rank, dp_group)

"""Which ranks share a machine: the node layout that node-local checkpoints (and, later, hierarchical
partitioning) are built on.

A rank's node is named by its host name and torchrun's node rank (GROUP_RANK): two hosts always differ
by name; on one machine, hosts made as network namespaces share a name but torchrun gives them
different node ranks; ranks started without torchrun (one machine) have no node rank. The arithmetic
(`ranks_by_node`) is pure; `node_layout` gathers every rank's name once.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from zerodp import comm


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

    def leader_of(self, rank: int) -> int:
        """The lowest rank on `rank`'s node (the one that does the node's shared work)."""
        return self.nodes[self.node_of(rank)][0]

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

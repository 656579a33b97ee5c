"""Which launcher started this process, and the rank, world size, local rank and master it implies.

Pure: `discover_launch_env(environ)` reads a mapping of environment variables and returns a
`LaunchEnv`; nothing here touches os.environ, the network or torch.distributed (lifecycle.py's
`init_distributed` exports the result and initialises the process group).

[Note: launch sources]
First source whose variables are present wins:
  1. torchrun (also `zerodp run`, the deepspeed launcher, a hand-set env://): $RANK and $WORLD_SIZE;
     the other variables are left to torch (srun starting one torchrun per node is this case).
  2. Open MPI's mpirun: $OMPI_COMM_WORLD_RANK, $OMPI_COMM_WORLD_SIZE, $OMPI_COMM_WORLD_LOCAL_RANK.
  3. MPICH / Intel MPI (hydra): $PMI_RANK, $PMI_SIZE, $MPI_LOCALRANKID.
  4. Slurm's srun: $SLURM_PROCID, $SLURM_NTASKS, $SLURM_LOCALID.
An MPI launcher comes before Slurm because mpirun inside a Slurm allocation inherits the batch
step's $SLURM_PROCID (0 in every process) while the MPI variables are the process's own.
The master: $MASTER_ADDR when set; under Slurm the first host of $SLURM_STEP_NODELIST,
$SLURM_NODELIST or $SLURM_JOB_NODELIST (srun's block distribution puts task 0 there); under MPI
there is no such list, so $MASTER_ADDR is required. DeepSpeed finds it with mpi4py (rank 0's
`hostname -I`, broadcast); zerodp does not depend on mpi4py. The port: $MASTER_PORT, else
DeepSpeed's `distributed_port` (29500).
A source whose variables are partly set or contradict each other (a rank without a size, a rank
not below the size) is a ValueError naming them: guessing would start a job that hangs.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Mapping

DEFAULT_MASTER_PORT = 29500
"""DeepSpeed's `distributed_port` and torchrun's default master port."""

SLURM_NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
"""Where Slurm lists the nodes, most specific first (the step's, then the job's)."""

_MPI_SOURCES = (
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
)
"""(source, rank, size, local rank, processes on this machine): the variables, in the order tried."""


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher says about this process.

    source: "torchrun", "openmpi", "mpich", "slurm", or "none" (no launcher: a 1-rank job).
    rank, world_size, local_rank: this process's place (torchrun: as set, local_rank 0 if unset).
    master_addr, master_port: the rendezvous; None for torchrun and "none" (torch reads its own).
    local_world_size: processes on this machine, when the launcher says (None otherwise).
    """

    source: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None = None
    master_port: int | None = None
    local_world_size: int | None = None

    def exports(self) -> dict[str, str]:
        """The torchrun variables that make torch's env:// see this launch (empty when torchrun's
        own are already set, or without a launcher)."""
        if self.source in ("torchrun", "none"):
            return {}
        local = {} if self.local_world_size is None else {"LOCAL_WORLD_SIZE": str(self.local_world_size)}
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": str(self.master_addr), "MASTER_PORT": str(self.master_port), **local}

    def describe(self) -> str:
        """One line for the log: the source and what it gave."""
        where = f", master {self.master_addr}:{self.master_port}" if self.master_addr else ""
        return f"launch from {self.source}: rank {self.rank} of {self.world_size}, local rank {self.local_rank}{where}"


def discover_launch_env(environ: Mapping[str, str], default_port: int = DEFAULT_MASTER_PORT) -> LaunchEnv:
    """Rank, world size, local rank and master from `environ` ([Note: launch sources]).

    Args:
        environ: the environment variables (os.environ).
        default_port: the master port when $MASTER_PORT is unset (DeepSpeed's distributed_port, 29500).
    Raises ValueError naming the variables when a source's variables are incomplete or inconsistent,
    or when an MPI launch gives no $MASTER_ADDR.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    present = [source for source in _MPI_SOURCES if source[1] in environ or source[2] in environ]
    if not present:
        return LaunchEnv("none", 0, 1, 0)
    chosen = present[0]
    if chosen[0] != "slurm" and present[-1][0] == "slurm" and _same_place(environ, chosen, present[-1]):
        chosen = present[-1]  # srun --mpi=pmi2 also sets PMI_*: the same launch, and Slurm names the master's host
    launch = _from_source(environ, *chosen)
    return LaunchEnv(launch.source, launch.rank, launch.world_size, launch.local_rank,
                     _master_addr(environ, launch.source), _master_port(environ, default_port), launch.local_world_size)


def _same_place(environ: Mapping[str, str], first: tuple[str, ...], slurm: tuple[str, ...]) -> bool:
    """Whether Slurm's rank and size are the first source's (then Slurm's variables are used)."""
    try:
        return _rank_and_size(environ, *first[:3]) == _rank_and_size(environ, *slurm[:3])
    except ValueError:
        return False


def _from_source(environ: Mapping[str, str], source: str, rank_var: str, size_var: str, local_var: str,
                 local_size_var: str) -> LaunchEnv:
    """An MPI or Slurm launch's rank, size, local rank and local size (the master comes later)."""
    rank, size = _rank_and_size(environ, source, rank_var, size_var)
    local_rank = _int_var(environ, local_var, source) if local_var in environ else _local_rank_fallback(
        environ, source, rank, size, local_var)
    if local_rank >= size:
        raise ValueError(f"{source} launch: ${local_var}={local_rank} must be below ${size_var}={size}")
    local_size = None
    if environ.get(local_size_var):
        text = environ[local_size_var]
        local_size = tasks_on_node(text, int(environ.get("SLURM_NODEID", "0") or 0)) if source == "slurm" else \
            _int_var(environ, local_size_var, source)
        if local_size is None or not local_rank < local_size <= size:
            raise ValueError(f"{source} launch: ${local_size_var}={text!r} does not hold ${local_var}={local_rank} "
                             f"within ${size_var}={size}")
    return LaunchEnv(source, rank, size, local_rank, local_world_size=local_size)


def _from_torchrun(environ: Mapping[str, str]) -> LaunchEnv:
    rank, size = _rank_and_size(environ, "torchrun", "RANK", "WORLD_SIZE")
    local_rank = _int_var(environ, "LOCAL_RANK", "torchrun") if "LOCAL_RANK" in environ else 0
    return LaunchEnv("torchrun", rank, size, local_rank)


def _rank_and_size(environ: Mapping[str, str], source: str, rank_var: str, size_var: str) -> tuple[int, int]:
    """Both variables, as integers, rank below size."""
    missing = [v for v in (rank_var, size_var) if v not in environ]
    if missing:
        given = rank_var if rank_var in environ else size_var
        raise ValueError(f"{source} launch: ${given}={environ[given]!r} is set but ${missing[0]} is not; set both "
                         f"(or neither, for a 1-rank job)")
    rank, size = _int_var(environ, rank_var, source), _int_var(environ, size_var, source)
    if size < 1 or rank >= size:
        raise ValueError(f"{source} launch: ${rank_var}={rank} and ${size_var}={size} are inconsistent: the size must "
                         f"be at least 1 and the rank below it")
    return rank, size


def _int_var(environ: Mapping[str, str], name: str, source: str) -> int:
    text = environ[name].strip()
    if not text.isdigit():
        raise ValueError(f"{source} launch: ${name}={environ[name]!r} is not a non-negative integer")
    return int(text)


def _local_rank_fallback(environ: Mapping[str, str], source: str, rank: int, size: int, local_var: str) -> int:
    """$LOCAL_RANK when the launcher's own local rank is missing; a 1-process job is rank 0 locally."""
    if "LOCAL_RANK" in environ:
        return _int_var(environ, "LOCAL_RANK", source)
    if size == 1:
        return 0
    raise ValueError(f"{source} launch: rank {rank} of {size} but ${local_var} is unset, so this process's rank "
                     f"on its machine is unknown; set LOCAL_RANK")


def _master_addr(environ: Mapping[str, str], source: str) -> str:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    if source == "slurm":
        for name in SLURM_NODELIST_VARIABLES:
            if environ.get(name):
                try:
                    return first_host(environ[name])
                except ValueError as err:
                    raise ValueError(f"slurm launch: ${name}: {err}; set MASTER_ADDR to rank 0's host instead") from None
        raise ValueError("slurm launch: none of $" + ", $".join(SLURM_NODELIST_VARIABLES)
                         + " is set, so rank 0's host is unknown; set MASTER_ADDR")
    raise ValueError(f"{source} launch (mpirun) without $MASTER_ADDR: set MASTER_ADDR to the address of rank 0's "
                     f"host, e.g. `mpirun -x MASTER_ADDR=host0 ...` (zerodp does not use mpi4py to find it)")


def _master_port(environ: Mapping[str, str], default_port: int) -> int:
    if "MASTER_PORT" not in environ:
        return default_port
    text = environ["MASTER_PORT"].strip()
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"$MASTER_PORT={environ['MASTER_PORT']!r} is not a port number (1-65535)")
    return int(text)


# ---------------------------------------------------------------------------------------------
# Slurm's compact lists

_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def tasks_on_node(tasks_per_node: str, node_index: int) -> int | None:
    """Slurm's tasks-per-node list ("2(x3),1": 2 on each of the first three nodes, then 1) at
    `node_index` ($SLURM_NODEID); None when the list is malformed or shorter."""
    seen = 0
    for entry in tasks_per_node.split(","):
        match = _TASKS.fullmatch(entry.strip())
        if match is None:
            return None
        seen += int(match.group(2) or 1)
        if node_index < seen:
            return int(match.group(1))
    return None


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compact host list, expanded in order: "node[01-03,07],gpu5" -> node01, node02,
    node03, node07, gpu5. A range keeps the zero padding of its lower bound; several bracket groups
    in one name expand as a product ("r[1-2]n[1-2]" -> r1n1, r1n2, r2n1, r2n2). Raises ValueError on
    an empty entry, an unbalanced bracket or a range whose end is below its start."""
    return [host for item in _split_top_level(hostlist) for host in _expand_one(item)]


def first_host(hostlist: str) -> str:
    """The first host of a compact host list (`expand_hostlist(hostlist)[0]`), without expanding
    the rest; the whole list is still checked."""
    items = _split_top_level(hostlist)
    for item in items[1:]:
        _literals_and_groups(item)
    literals, groups = _literals_and_groups(items[0])
    firsts = [group[0][0] for group in groups] + [""]
    return "".join(text + first for text, first in zip(literals, firsts))


def _split_top_level(hostlist: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, current = [], 0, []
    for ch in hostlist.strip():
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"host list {hostlist!r} has an unbalanced or nested bracket")
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"host list {hostlist!r} has an unclosed bracket")
    items.append("".join(current))
    if any(not item for item in items):
        raise ValueError(f"host list {hostlist!r} has an empty entry")
    return items


def _literals_and_groups(item: str) -> tuple[list[str], list[list[tuple[str, str]]]]:
    """One comma-free entry as its literal texts and, between them, each bracket's (low, high)
    ranges as written (zero padding kept)."""
    parts = re.split(r"\[([^\]]*)\]", item)  # literal, group, literal, group, ..., literal
    groups = []
    for group in parts[1::2]:
        ranges = []
        for piece in group.split(","):
            match = _RANGE.fullmatch(piece.strip())
            if match is None:
                raise ValueError(f"host list entry {item!r}: {piece!r} is not a number or a range like 01-04")
            lo, hi = match.group(1), match.group(2) or match.group(1)
            if int(hi) < int(lo):
                raise ValueError(f"host list entry {item!r}: range {piece!r} ends below its start")
            ranges.append((lo, hi))
        groups.append(ranges)
    return parts[0::2], groups


def _expand_one(item: str) -> list[str]:
    """One comma-free entry, its bracket groups expanded as a product."""
    literals, groups = _literals_and_groups(item)
    choices = [[str(n).zfill(len(lo)) for lo, hi in ranges for n in range(int(lo), int(hi) + 1)] for ranges in groups]
    return ["".join(text + host for text, host in zip(literals, (*combo, ""))) for combo in itertools.product(*choices)]

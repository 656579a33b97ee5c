"""`zerodp run` and `zerodp deepspeed`: torchrun (torch.distributed.run) with safe defaults.

    zerodp run --nproc-per-node 2 train.py --deepspeed_config ds.json        # one machine
    zerodp run --nnodes 2 --node-rank 0 --master-addr host0 --master-port 29500 \\
               --nproc-per-node 8 train.py                                   # each of 2 machines

Every torchrun option is accepted as is. When no multi-node option is given, `--standalone` is
added: a local rendezvous on a free port, so two jobs on one machine never collide on 29500.
torchrun watches the workers: when one fails, it stops the others (no rank is left hanging) and
reports the failing rank and its error.

Both set ZERODP_AS_DEEPSPEED=1 for the workers (unless it is set already), so `import deepspeed` in
the script and in the libraries it uses is zerodp's compatibility package. `zerodp deepspeed` takes
DeepSpeed's launcher flags instead of torchrun's (see `deepspeed_torchrun_argv`).

--allow-oversubscribe (before the script): start more processes on this machine than it can hold
(`max_local_ranks`: 4 a core, and about 0.5 GB of memory each); without it such a count is refused
before any process starts, exit code 2. The workers die with the launcher, however it ends (SIGKILL
included): [Note: workers die with their launcher] in zerodp/comm/lifecycle.py.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from contextlib import contextmanager
from typing import Iterator

from zerodp.comm.lifecycle import workers_die_with_me

_MULTI_NODE_OPTIONS = {
    "--standalone", "--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr",
    "--rdzv-backend", "--rdzv_backend", "--node-rank", "--node_rank", "--master-port", "--master_port",
}


def torchrun_argv(argv: list[str]) -> list[str]:
    """torchrun's arguments for `zerodp run ARGV`: adds --standalone unless a multi-node option
    appears before the training script."""
    from torch.distributed.run import parse_args

    script = parse_args(argv).training_script
    launcher_options = argv[: argv.index(script)] if script in argv else argv
    given = {opt.split("=", 1)[0] for opt in launcher_options if opt.startswith("--")}
    return argv if given & _MULTI_NODE_OPTIONS else ["--standalone", *argv]


# [Note: how many processes one machine may start]
# A count of processes is a number anyone can mistype (`--nproc 100000` once started workers until 24 GiB
# were gone and the machine stopped answering for half an hour). The limit is the smaller of two:
# - cores x RANKS_PER_CORE (4): a gloo rank on CPU spends most of a step waiting in a collective, so a
#   few ranks a core still make progress (the test suite runs 4 ranks on 2 cores); past that they only
#   thrash. A GPU job runs one rank a device, far below it.
# - available memory / RANK_HOST_BYTES (0.5 GiB): one rank of `zerodp demo` peaks at 351 MiB resident
#   (`/usr/bin/time -v python zerodp/demo/train.py --config CFG`, torch 2.13 CPU: the torch import,
#   gloo, the model and its optimizer); 0.5 GiB leaves room for a larger model's states. Available is
#   /proc/meminfo's MemAvailable (what can be had without swapping), free pages elsewhere.
# It is a floor, not an estimate of a given script: a job that needs more memory a rank fails as it
# would without it, and --allow-oversubscribe starts any count.

RANKS_PER_CORE = 4
"""Processes a CPU core may carry ([Note: how many processes one machine may start])."""
RANK_HOST_BYTES = 512 * 2**20
"""Host memory one rank needs at least ([Note: how many processes one machine may start])."""
ALLOW_OVERSUBSCRIBE = ("--allow-oversubscribe", "--allow_oversubscribe")
"""The override flag (torchrun and DeepSpeed spell their flags both ways)."""


OVERSUBSCRIBE_HELP = (f"start more processes than this machine can hold (default: refuse, before any starts, more "
                      f"than {RANKS_PER_CORE} a core or one per {RANK_HOST_BYTES / 1e9:.1f} GB of available memory)")
"""The --help text of --allow-oversubscribe, for every command that launches."""


class OversubscribeError(ValueError):
    """A process count beyond what this machine can hold, without --allow-oversubscribe."""


def max_local_ranks(num_cores: int, available_bytes: int, ranks_per_core: int = RANKS_PER_CORE,
                    rank_bytes: int = RANK_HOST_BYTES) -> int:
    """The most processes one machine may start: min(num_cores x ranks_per_core, available_bytes //
    rank_bytes), at least 1 ([Note: how many processes one machine may start])."""
    return max(1, min(num_cores * ranks_per_core, available_bytes // rank_bytes))


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity, which taskset and cgroups narrow), else the count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory_bytes() -> int:
    """Memory that can be had without swapping: /proc/meminfo's MemAvailable, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_local_ranks(what: str, num_ranks: int, allow_oversubscribe: bool = False) -> None:
    """OversubscribeError when `num_ranks` processes exceed `max_local_ranks` of this machine (a
    warning instead with `allow_oversubscribe`); `what` names the flag and value, e.g. "--nproc 8"."""
    cores, available = machine_cores(), available_memory_bytes()
    limit = max_local_ranks(cores, available)
    if num_ranks <= limit:
        return
    why = (f"{what}: this machine can run at most {limit} ranks ({cores} cores x {RANKS_PER_CORE}, "
           f"{available / 1e9:.1f} GB available at ~{RANK_HOST_BYTES / 1e9:.1f} GB a rank)")
    if not allow_oversubscribe:
        raise OversubscribeError(f"{why}; pass --allow-oversubscribe to start them anyway")
    from zerodp.log import logger

    logger.warning("%s; starting %d anyway (--allow-oversubscribe)", why, num_ranks)


def split_allow_oversubscribe(argv: list[str]) -> tuple[list[str], bool]:
    """`zerodp run ARGV` without --allow-oversubscribe, and whether it was given before the script (after
    it, the flag is the script's own and stays)."""
    from torch.distributed.run import parse_args

    at = next((i for i, arg in enumerate(argv) if arg in ALLOW_OVERSUBSCRIBE), None)
    if at is None:
        return argv, False
    rest = argv[:at] + argv[at + 1:]
    script = parse_args(rest).training_script
    return (rest, True) if script in rest and rest.index(script) >= at else (argv, False)


def nproc_alias(argv: list[str]) -> list[str]:
    """`zerodp run ARGV` with `--nproc N` (the name `zerodp demo` and `compare` use for the process
    count) given before the script spelt as torchrun's `--nproc-per-node N`; after the script it is the
    script's own and stays."""
    from torch.distributed.run import parse_args

    at = next((i for i, arg in enumerate(argv) if arg == "--nproc" or arg.startswith("--nproc=")), None)
    if at is None:
        return argv
    renamed = argv[:at] + ["--nproc-per-node" + argv[at][len("--nproc"):]] + argv[at + 1:]
    script = parse_args(renamed).training_script
    return renamed if script in renamed and renamed.index(script) > at else argv


def launch(argv: list[str], allow_oversubscribe: bool = False, what: str | None = None) -> int:
    """Run torchrun with `argv` (see `torchrun_argv`) and ZERODP_AS_DEEPSPEED=1 (unless set); returns
    the exit code (0 when every worker succeeded). A --nproc-per-node beyond `max_local_ranks` is refused
    first (OversubscribeError naming `what`, default "--nproc-per-node N") unless `allow_oversubscribe`."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(torchrun_argv(argv))
    if str(args.nproc_per_node).isdigit():  # "auto", "cpu", "gpu": counted from the machine itself
        check_local_ranks(what or f"--nproc-per-node {args.nproc_per_node}", int(args.nproc_per_node),
                          allow_oversubscribe)
    os.environ.setdefault("ZERODP_AS_DEEPSPEED", "1")
    with _scratch_log_dir(args):
        try:
            with workers_die_with_me():
                run(args)
        except ChildFailedError as err:  # formatted while the workers' error files still exist
            from zerodp.log import logger

            logger.error("%s", err.format_msg())
            return 1
    return 0


@contextmanager
def _scratch_log_dir(args: argparse.Namespace) -> Iterator[None]:
    """torchrun's default log directory is a new /tmp/torchelastic_* per launch, never removed (it holds
    the workers' error files); with no --log-dir and no output redirected to files, use one that is
    removed when the launch ends."""
    if args.log_dir is not None or str(args.redirects) != "0" or str(args.tee) != "0":
        yield
        return
    with tempfile.TemporaryDirectory(prefix="zerodp_run_") as scratch:
        args.log_dir = scratch
        yield


_DEEPSPEED_ONLY_SWITCHES = ("force_multi", "save_pid", "bind_cores_to_rank")
_DEEPSPEED_ONLY_OPTIONS = ("include", "exclude", "launcher", "launcher_args", "enable_each_rank_log", "autotuning",
                           "bind_core_list", "ssh_port", "venv_script")
_DEEPSPEED_ONLY_FLAGS = _DEEPSPEED_ONLY_SWITCHES + _DEEPSPEED_ONLY_OPTIONS
"""DeepSpeed launcher flags `zerodp deepspeed` refuses by name (switches take no value, options one): each
selects a DeepSpeed-specific mechanism (pdsh/ssh host fan-out, core binding, its autotuner) that torchrun
does not have."""


def _deepspeed_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerodp deepspeed", description="DeepSpeed's `deepspeed` launcher flags over torchrun (ZERODP_AS_DEEPSPEED=1).",
        epilog="On several machines run it on each one with --no_ssh --node_rank R --num_nodes N --master_addr A "
               "(zerodp does not ssh into hosts).")
    parser.add_argument("--num_gpus", "--num_accelerators", "--nproc", type=int, default=None,
                        help="processes on this machine (default: the CUDA device count, 1 without CUDA)")
    parser.add_argument("--num_nodes", type=int, default=1, help="machines in the job (default 1)")
    parser.add_argument("--node_rank", type=int, default=0, help="this machine's index, with --no_ssh")
    parser.add_argument("--master_addr", default=None, help="address of node 0 (default: a local rendezvous)")
    parser.add_argument("--master_port", type=int, default=None, help="port on node 0 (default: a free one)")
    parser.add_argument("--hostfile", "-H", default=None, help="DeepSpeed hostfile; one host only ('host slots=N')")
    parser.add_argument("--no_ssh", action="store_true", help="each machine runs this command itself")
    parser.add_argument("--no_ssh_check", action="store_true", help="accepted; zerodp never checks ssh")
    parser.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    parser.add_argument("--module", action="store_true", help="run the script as a module (python -m)")
    parser.add_argument("--no_python", action="store_true", help="run the script as an executable, not with python")
    parser.add_argument("--log_level", default=None, help="zerodp's log level for the workers (ZERODP_LOG_LEVEL)")
    parser.add_argument(*ALLOW_OVERSUBSCRIBE, dest="allow_oversubscribe", action="store_true",
                        help=OVERSUBSCRIBE_HELP)
    for flag in _DEEPSPEED_ONLY_SWITCHES:
        parser.add_argument(f"--{flag}", action="store_const", const=True, default=None, help=argparse.SUPPRESS)
    for flag in _DEEPSPEED_ONLY_OPTIONS:
        parser.add_argument(f"--{flag}", default=None, help=argparse.SUPPRESS)
    parser.add_argument("script", help="the training script (or module with --module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def hostfile_slots(path: str) -> list[tuple[str, int]]:
    """(host, slots) for each line of a DeepSpeed hostfile (`host slots=N`, # comments). ValueError
    naming the file and line for anything else."""
    hosts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            host, _, slots = line.partition(" slots=")
            if not slots.strip().isdigit() or " " in host.strip():
                raise ValueError(f"{path}:{number}: {line!r} is not a hostfile line ('hostname slots=N')")
            hosts.append((host.strip(), int(slots)))
    return hosts


def deepspeed_torchrun_argv(argv: list[str], cuda_devices: int = 0) -> list[str]:
    """torchrun's arguments for `zerodp deepspeed ARGV` (DeepSpeed's launcher flags).

    --num_gpus -> --nproc-per-node (default: `cuda_devices`, or 1), --num_nodes / --node_rank /
    --master_addr / --master_port -> torchrun's, --module / --no_python -> torchrun's; the script gets
    `--local_rank=N` first (as DeepSpeed's launcher passes it) unless --no_local_rank. Several machines
    need --no_ssh (zerodp runs on each machine, it does not ssh); a flag for a DeepSpeed-only mechanism
    is refused by name. ValueError for both."""
    args = _deepspeed_parser().parse_args(argv)
    refused = [f"--{flag}" for flag in _DEEPSPEED_ONLY_FLAGS if getattr(args, flag) is not None]
    if refused:
        raise ValueError(f"zerodp deepspeed does not support {', '.join(refused)}: DeepSpeed-only launcher mechanisms "
                         "(pdsh/ssh host selection, core binding, autotuning) that torchrun does not have; "
                         "remove them (on several machines, run it on each one with --no_ssh)")
    nproc = args.num_gpus or cuda_devices or 1
    if args.hostfile is not None:
        hosts = hostfile_slots(args.hostfile)
        if len(hosts) > 1 and not args.no_ssh:
            raise ValueError(f"zerodp deepspeed: {args.hostfile} lists {len(hosts)} hosts, and zerodp does not ssh "
                             "into hosts: run `zerodp deepspeed --no_ssh --num_nodes N --node_rank R --master_addr "
                             "HOST0 ...` on each host")
        nproc = args.num_gpus or (hosts[0][1] if hosts else nproc)
    if args.num_nodes > 1 and not args.no_ssh:
        raise ValueError(f"zerodp deepspeed: --num_nodes {args.num_nodes} needs --no_ssh with --node_rank and "
                         "--master_addr on each machine (zerodp does not ssh into hosts)")
    torchrun = [f"--nproc-per-node={nproc}"]
    if args.num_nodes > 1:
        torchrun += [f"--nnodes={args.num_nodes}", f"--node-rank={args.node_rank}"]
    torchrun += [f"--master-addr={args.master_addr}"] if args.master_addr else []
    torchrun += [f"--master-port={args.master_port}"] if args.master_port else []
    torchrun += ["--module"] if args.module else []
    torchrun += ["--no-python"] if args.no_python else []
    from torch.distributed.elastic.utils.api import macros

    local_rank = [] if args.no_local_rank else [f"--local_rank={macros.local_rank}"]
    return torchrun_argv([*torchrun, args.script, *local_rank, *args.script_args])


def launch_deepspeed(argv: list[str]) -> int:
    """`zerodp deepspeed ARGV`: DeepSpeed's launcher flags (see `deepspeed_torchrun_argv`), run by torchrun."""
    import torch

    args = _deepspeed_parser().parse_known_args(argv)[0]
    if args.log_level:
        os.environ.setdefault("ZERODP_LOG_LEVEL", args.log_level.upper())
    torchrun = deepspeed_torchrun_argv(argv, torch.cuda.device_count())
    nproc = next(arg.split("=", 1)[1] for arg in torchrun if arg.startswith("--nproc-per-node="))
    what = f"--num_gpus {nproc}" if args.num_gpus or not args.hostfile else f"{args.hostfile}'s slots={nproc}"
    return launch(torchrun, args.allow_oversubscribe, what)

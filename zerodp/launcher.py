"""`zerodp run`: torchrun (torch.distributed.run) with a safe default for one machine.

    zerodp run --nproc-per-node 2 train.py --deepspeed_config ds.json        # one machine
    zerodp run --nnodes 2 --node-rank 0 --master-addr host0 --master-port 29500 \\
               --nproc-per-node 8 train.py                                   # each of 2 machines

Every torchrun option is accepted as is. When no multi-node option is given, `--standalone` is
added: a local rendezvous on a free port, so two jobs on one machine never collide on 29500.
torchrun watches the workers: when one fails, it stops the others (no rank is left hanging) and
reports the failing rank and its error.
"""

from __future__ import annotations

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


def launch(argv: list[str]) -> int:
    """Run torchrun with `argv` (see `torchrun_argv`); returns the exit code (0 when every worker
    succeeded)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(torchrun_argv(argv)))
    except ChildFailedError as err:
        from zerodp.log import logger

        logger.error("%s", err.format_msg())
        return 1
    return 0

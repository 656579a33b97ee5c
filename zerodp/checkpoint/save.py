"""engine.save_checkpoint: every rank writes its pieces into TAG.tmp, then rank 0 publishes.

[Note: crash safety]
Files go into DIR/TAG.tmp and are fsynced; ranks agree (their checksums are gathered); rank 0
writes meta.json last, fsyncs, renames TAG.tmp to TAG and only then replaces `latest` (write
latest.tmp, fsync, rename). A process killed at any moment leaves either the previous checkpoint
with `latest` pointing at it, or the new one complete: a TAG directory without meta.json is never
published, and `latest` never names one.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from zerodp import comm
from zerodp.checkpoint.format import (ENGINE, FORMAT_VERSION, LATEST, META, CheckpointError, check_tag, fsync_dir,
                                      fsync_write, on_every_rank, rank_file, rank_file_order, rng_file, sha256,
                                      torch_save_synced)
from zerodp.log import log_rank0, logger
from zerodp.zero.base import elementwise_state


def save_checkpoint(engine: Any, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """Save a sharded checkpoint of `engine` into `save_dir/tag` (every rank must call it).
    Returns True. See docs/checkpoints.md for the layout."""
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    root = Path(save_dir)
    rank, world = comm.get_rank(), comm.get_world_size()
    with comm.ledger.outside_step():
        _all_ranks_called("save_checkpoint")
        _check_tag_on_all_ranks(tag, engine.config.checkpoint.tag_validation)
        tmp = root / f"{tag}.tmp"
        on_every_rank(lambda: _make_empty(tmp) if rank == 0 else None)  # its gather is the barrier
        try:
            extra = _module_extra(engine, exclude_frozen_parameters)  # stage 3 gathers: every rank
            extra_optimizer = _optimizer_state_of_all_ranks(engine.optimizer)  # a collective
            files = on_every_rank(lambda: _write_files(engine, tmp, rank, world, client_state or {},
                                                       {**extra_optimizer, "module_extra": extra}))
            digests = _gather_digests(tmp, files, world)
            on_every_rank(lambda: _publish(engine, root, tag, tmp, digests, save_latest) if rank == 0 else None)
        except BaseException:
            if rank == 0:  # every rank is past its writes: each raised from the same on_every_rank
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    log_rank0("saved checkpoint %s", root / tag)
    return True


def _make_empty(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
    tmp.mkdir(parents=True)


def _all_ranks_called(what: str) -> None:
    """Fail with the names of the missing ranks instead of hanging when some rank did not call."""
    try:
        comm.barrier_naming_missing_ranks()
    except RuntimeError as err:
        raise RuntimeError(f"{what} must be called on every rank (as in DeepSpeed): {err}") from None


def _check_tag_on_all_ranks(tag: str, policy: str) -> None:
    import zlib

    crcs = comm.all_gather_rows(torch.tensor([zlib.crc32(tag.encode())], dtype=torch.int64,
                                             device=comm.device_for_backend())).view(-1).tolist()
    if len(set(crcs)) == 1 or policy.lower() == "ignore":
        return
    message = f"checkpoint tag {tag!r} differs between ranks (checkpoint.tag_validation={policy})"
    if policy.lower() == "fail":
        raise CheckpointError(message)
    logger.warning(message)


def _write_files(engine: Any, tmp: Path, rank: int, world: int, client_state: dict,
                 extra: dict) -> list[tuple[str, int]]:
    """This rank's shard files and RNG file; rank 0 also engine.pt. Returns (name, pieces in it)."""
    files = _write_rank_files(engine, tmp, rank, world)
    if rank == 0:
        torch_save_synced(_engine_state(engine, client_state, extra), tmp / ENGINE)
        files.append((ENGINE, 0))
    return files


def _write_rank_files(engine: Any, tmp: Path, rank: int, world: int) -> list[tuple[str, int]]:
    """One file per batch of `resident_pieces` (one, or one per NVMe swap chunk), then the RNG file."""
    strategy = engine.strategy
    parts = strategy.num_piece_batches()
    files = []
    for k, (_, make_pieces) in enumerate(strategy.resident_pieces(saving=True)):
        pieces = make_pieces()
        name = rank_file(rank, world, k if parts > 1 else None)
        data = [{"name": p.name, "offset": p.offset, "numel": p.numel,
                 "tensors": {key: t.detach().to("cpu", copy=True) for key, t in p.tensors.items()}} for p in pieces]
        torch_save_synced({"format_version": FORMAT_VERSION, "rank": rank, "world_size": world, "pieces": data},
                          tmp / name)
        files.append((name, len(pieces)))
        del data
    torch_save_synced(_rng_state(), tmp / rng_file(rank))
    return [*files, (rng_file(rank), 0)]


def _rng_state() -> dict:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _module_extra(engine: Any, exclude_frozen: bool) -> dict:
    """Buffers and frozen parameters by state-dict name (trainable ones are in the rank files)."""
    names = _trainable_numels(engine.strategy)
    trainable = {id(p) for n, p in engine.module.named_parameters() if n in names}
    skip = {n for n, p in engine.module.named_parameters(remove_duplicate=False)
            if id(p) in trainable or (exclude_frozen and not p.requires_grad)}
    extra = engine.strategy.gathered_state_dict(keep=lambda n: n not in skip)
    return {n: t.detach().cpu() for n, t in extra.items()}


def _optimizer_state_of_all_ranks(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's per-group scalar state (Adam's step) and element-wise state names, from every
    rank: a rank may own no element of a param group (or of any), and its own optimizer then holds no
    state to save for it, so rank 0 alone cannot tell (resuming gave such a group no `step`)."""
    mine = {"scalars": [{k: _json_scalar(v) for k, v in _scalar_state(optimizer, g).items()} for g in optimizer.param_groups],
            "keys": sorted({k for g in optimizer.param_groups for p in g["params"] for k in elementwise_state(optimizer, p)})}
    text = json.dumps(mine)
    everyone = [json.loads(m) for m in comm.gather_messages(text, max_bytes=512 * (len(optimizer.param_groups) + 2))]
    scalars = [next((r["scalars"][i] for r in everyone if r["scalars"][i]), {}) for i in range(len(optimizer.param_groups))]
    return {"optimizer_scalars": [{k: _from_json_scalar(v) for k, v in group.items()} for group in scalars],
            "optimizer_state_keys": sorted({k for r in everyone for k in r["keys"]})}


def _json_scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    return value


def _from_json_scalar(value: Any) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    return value


def _engine_state(engine: Any, client_state: dict, extra: dict) -> dict:
    optimizer = engine.optimizer
    return {
        "format_version": FORMAT_VERSION,
        "counters": {k: getattr(engine, k) for k in ("global_steps", "global_samples", "skipped_steps", "micro_steps")},
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "optimizer_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        **extra,  # optimizer_scalars, optimizer_state_keys (all ranks'); module_extra: buffers and frozen params
        "client_state": client_state,
        "dataloader": _sampler_state(engine),
        "strategy_layout": engine.strategy.layout_state(),
    }


def _sampler_state(engine: Any) -> dict | None:
    """The position of the loader `initialize(training_data=...)` built (same on every rank)."""
    loader = engine.training_dataloader
    sampler = getattr(loader, "sampler", None)
    return sampler.state_dict() if hasattr(sampler, "state_dict") else None


def _scalar_state(optimizer: torch.optim.Optimizer, group: dict) -> dict:
    """0-dim state (Adam's step) of the group's first parameter that has state: the same for all."""
    for p in group["params"]:
        state = optimizer.state.get(p)
        if state:
            return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()
                    if not isinstance(v, torch.Tensor) or v.dim() == 0}
    return {}


def _gather_digests(tmp: Path, files: list[tuple[str, int]], world: int) -> dict[str, dict]:
    """Every rank's files' sha256, size and piece count, gathered to all ranks (rank 0 writes them
    to meta). A row per rank: [number of files, then per file: 4 sha256 words, bytes, pieces]."""
    row = on_every_rank(lambda: _digest_row(tmp, [(name, n) for name, n in files if name != ENGINE]))
    device = comm.device_for_backend()
    width = int(comm.all_gather_rows(torch.tensor([len(row)], dtype=torch.int64, device=device)).max())
    gathered = comm.all_gather_rows(torch.tensor(row + [0] * (width - len(row)), dtype=torch.int64, device=device))
    digests = {}
    for r, values in enumerate(gathered.tolist()):
        count = values[0]
        parts = count - 1  # the last file is the RNG file
        names = [rank_file(r, world, k if parts > 1 else None) for k in range(parts)] + [rng_file(r)]
        for j, name in enumerate(names):
            words = values[1 + 6 * j : 5 + 6 * j]
            digests[name] = {"sha256": b"".join(w.to_bytes(8, "little", signed=True) for w in words).hex(),
                             "bytes": values[5 + 6 * j], "num_pieces": values[6 + 6 * j]}
    if any(name == ENGINE for name, _ in files):
        digests[ENGINE] = {"sha256": sha256(tmp / ENGINE), "bytes": (tmp / ENGINE).stat().st_size}
    return digests


def _digest_row(tmp: Path, own: list[tuple[str, int]]) -> list[int]:
    """This rank's row for `_gather_digests` (engine.pt is rank 0's own and not in `own`)."""
    row = [len(own)]
    for name, n in own:
        digest = bytes.fromhex(sha256(tmp / name))
        row += [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]
        row += [(tmp / name).stat().st_size, n]
    return row


def _publish(engine: Any, root: Path, tag: str, tmp: Path, digests: dict, save_latest: bool) -> None:
    """Rank 0: meta.json, then the renames that make the checkpoint visible (see [Note: crash safety])."""
    strategy, world = engine.strategy, comm.get_world_size()
    for r in range(world):
        index = strategy.piece_index(r)  # in file order: each part holds the next num_pieces of it
        for name in sorted((n for n in digests if n.startswith(f"rank_{r}_of_")), key=rank_file_order):
            count = digests[name].pop("num_pieces")
            digests[name]["pieces"], index = index[:count], index[count:]
        if index:
            raise CheckpointError(f"rank {r}'s files hold fewer pieces than its layout lists ({len(index)} left)")
    for name in digests:
        digests[name].pop("num_pieces", None)
    meta = {
        "format_version": FORMAT_VERSION, "tag": tag, "stage": engine.zero_optimization_stage(),
        "world_size": world, "precision": engine.config.precision, "optimizer": type(engine.optimizer).__name__,
        "params": _trainable_shapes(engine),
        "tied": tied_names(engine.module),
        "files": digests,
    }
    fsync_write(tmp / META, json.dumps(meta, indent=1).encode())
    fsync_dir(tmp)
    final = root / tag
    if final.exists():  # saving the same tag again: move the old one aside first
        old = root / f"{tag}.old"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync_dir(root)
    if save_latest:
        fsync_write(root / f"{LATEST}.tmp", tag.encode())
        (root / f"{LATEST}.tmp").rename(root / LATEST)
        fsync_dir(root)


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """{alias: name} for parameters reachable under several names (a head tied to an embedding)."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def _trainable_shapes(engine: Any) -> dict[str, dict]:
    """{name: {"shape", "dtype"}} of every trainable parameter (the working dtype; pieces are fp32)."""
    named = dict(engine.module.named_parameters())
    names = _trainable_numels(engine.strategy)
    return {n: {"shape": list(getattr(named[n], "ds_shape", named[n].shape)), "dtype": str(named[n].dtype).removeprefix("torch.")} for n in names}


def _trainable_numels(strategy: Any) -> dict[str, int]:
    """Every trainable parameter's name and numel, from every rank's piece index."""
    totals: dict[str, int] = {}
    for r in range(comm.get_world_size()):
        for name, _, numel in strategy.piece_index(r):
            totals[name] = totals.get(name, 0) + numel
    return totals

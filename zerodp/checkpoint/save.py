"""engine.save_checkpoint: every rank writes its pieces into TAG.tmp, then rank 0 publishes.

[Note: crash safety]
Files go into DIR/TAG.tmp and are fsynced; ranks agree (their checksums are gathered); rank 0
writes meta.json last, fsyncs, renames TAG.tmp to TAG and only then replaces `latest` (write
latest.tmp, fsync, rename). A process killed at any moment leaves either the previous checkpoint
with `latest` pointing at it, or the new one complete: a TAG directory without meta.json is never
published, and `latest` never names one.

[Note: node-local storage]
On several hosts, DIR is either one directory all hosts share or, with
`checkpoint.use_node_local_storage`, one directory per host: then each host's lowest rank does rank 0's
part for its host (makes TAG.tmp, writes engine.pt and meta.json, renames, replaces `latest`), each rank
writes its own files there, and meta.json's `nodes` says which host holds which file. Which of the two
DIR is, is probed, not assumed: every host's lowest rank writes a probe file into DIR and reports the
probes it sees (one gather); a save fails before writing anything when the directory is not what the
config says (naming the host and the key). Hosts rename TAG.tmp to TAG, all of them, before any replaces
`latest`, so if hosts' `latest` disagree after a crash, the newer tag is complete on every host (load.py
picks it).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from zerodp import comm
from zerodp.checkpoint.format import (ENGINE, FORMAT_VERSION, CheckpointError, check_dir_argument, check_tag,
                                      file_rank, fsync_dir, on_every_rank, rank_file, rank_file_order, replace_latest, rng_file, sha256,
                                      torch_save_synced, write_meta)
from zerodp.checkpoint.recovery_script import write_recovery_script
from zerodp.checkpoint.safe_io import discard, fresh_dir, remove_entry, write_bytes_fresh
from zerodp.log import log_rank0, logger
from zerodp.zero.base import elementwise_state
from zerodp.zero.shard_state import COUNTERS, ShardState
from zerodp.zero.topology import NodeLayout, node_layout


def save_checkpoint(shard: ShardState, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """Save a sharded checkpoint of this rank's `shard` (engine.shard_state()) into `save_dir/tag`
    (every rank must call it). Returns True. See docs/checkpoints.md for the layout. The three steps
    (open, stage + write, commit) are the ones an async save (async_save.py) runs apart."""
    with comm.ledger.outside_step():
        target = open_save(shard, save_dir, tag, save_latest)
        try:
            staged = stage_save(shard, target, client_state or {}, exclude_frozen_parameters, _to_host)
            written = on_every_rank(lambda: write_staged(staged))
            commit_save(staged, written)
        except BaseException:  # every rank is past its writes: each raised from the same on_every_rank
            target.discard()
            raise
    return True


@dataclass
class SaveTarget:
    """Where one save writes: `root/tag.tmp`, renamed to `root/tag` when every rank's files are in."""

    root: Path
    tag: str
    tmp: Path
    storage: "Storage"
    save_latest: bool

    @property
    def leads(self) -> bool:
        """Whether this rank does rank 0's part for its directory (see [Note: node-local storage])."""
        return comm.get_rank() in self.storage.leaders

    def discard(self) -> None:
        """A leader removes TAG.tmp after a failure (call once every rank's writes have ended)."""
        if self.leads:
            discard(self.tmp)


@dataclass
class StagedSave:
    """What one rank writes for a save, and the meta.json fields known before the files exist.
    `rank_files` (name, pieces, payload) is lazy for a sync save (one batch of pieces in memory at a
    time) and a list of host copies for an async one."""

    target: SaveTarget
    rank: int
    rank_files: Iterable[tuple[str, int, dict]]
    rng: dict
    engine_state: dict | None  # a leader's engine.pt; None elsewhere
    meta: dict  # meta.json, its "files" still empty
    piece_indexes: list[list[tuple[str, int, int]]]  # every rank's, in file order


@dataclass
class Written:
    """What a rank's writes left for the commit: its files' digest row, a leader's engine.pt digest."""

    row: list[int]
    engine_digest: dict | None


def open_save(shard: ShardState, save_dir: str, tag: str | None, save_latest: bool) -> SaveTarget:
    """Check that every rank called with the same tag, probe the storage, make an empty TAG.tmp
    (collectives: the main thread only)."""
    root = check_dir_argument(save_dir, "save_dir")
    tag = check_tag(tag if tag is not None else f"global_step{shard.counters['global_steps']}")
    _all_ranks_called("save_checkpoint")
    tag = _agreed_tag(tag, shard.checkpoint_config.tag_validation)
    storage = _storage(root, shard.checkpoint_config.use_node_local_storage)
    target = SaveTarget(root, tag, root / f"{tag}.tmp", storage, save_latest)
    on_every_rank(lambda: _make_empty(target.tmp, storage) if target.leads else storage.clean_up_probe())  # a barrier
    return target


def stage_save(shard: ShardState, target: SaveTarget, client_state: dict, exclude_frozen_parameters: bool,
               copy: Callable[[torch.Tensor], torch.Tensor]) -> StagedSave:
    """Everything this rank will write, with `copy` taking each piece's tensors to the host. Has
    collectives (stage 3 gathers buffers; every rank's optimizer scalars are gathered)."""
    rank, world = comm.get_rank(), comm.get_world_size()
    extra = _module_extra(shard, exclude_frozen_parameters)
    extra_optimizer = _optimizer_state_of_all_ranks(shard.optimizer)
    engine_state = _engine_state(shard, client_state, {**extra_optimizer, "module_extra": extra}) if target.leads else None
    meta = {"format_version": FORMAT_VERSION, "tag": target.tag, "stage": shard.stage, "world_size": world,
            "precision": shard.precision, "optimizer": type(shard.optimizer).__name__,
            "params": _trainable_shapes(shard), "tied": tied_names(shard.module), "files": {},
            "global_steps": shard.counters["global_steps"]}
    return StagedSave(target, rank, _rank_payloads(shard, rank, world, copy), _rng_state(), engine_state, meta,
                      [shard.piece_index(r) for r in range(world)])


def write_staged(staged: StagedSave) -> Written:
    """Write this rank's files into TAG.tmp, each fresh and fsynced, and digest them. No collective:
    an async save runs it on its writer thread."""
    tmp = staged.target.tmp
    own = []
    for name, num_pieces, payload in staged.rank_files:
        torch_save_synced(payload, tmp / name)
        own.append((name, num_pieces))
        del payload  # a sync save holds one batch of pieces at a time
    torch_save_synced(staged.rng, tmp / rng_file(staged.rank))
    own.append((rng_file(staged.rank), 0))
    engine_digest = None
    if staged.engine_state is not None:
        torch_save_synced(staged.engine_state, tmp / ENGINE)
        engine_digest = {"sha256": sha256(tmp / ENGINE), "bytes": (tmp / ENGINE).stat().st_size}
    return Written(_digest_row(tmp, own), engine_digest)


def commit_save(staged: StagedSave, written: Written) -> None:
    """Gather every rank's digests, publish TAG (meta.json, rename) and replace `latest` (collectives:
    the main thread only). See [Note: crash safety]."""
    target = staged.target
    digests = _gather_digests(written, comm.get_world_size())
    on_every_rank(lambda: _publish(staged, digests) if target.leads else None)
    if target.save_latest:  # only once every directory holds TAG: see [Note: node-local storage]
        on_every_rank(lambda: replace_latest(target.root, target.tag) if target.leads else None)
    log_rank0("saved checkpoint %s", target.root / target.tag)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A compact host copy (torch.save of a view would write its whole flat buffer)."""
    return tensor.detach().to("cpu", copy=True)


@dataclass(frozen=True)
class Storage:
    """Where a save writes: one directory all ranks share (`node_local` False, leader rank 0), or
    one per host (the lowest rank of each host leads). See [Note: node-local storage]."""

    layout: NodeLayout
    node_local: bool
    probe: Path | None = None  # this rank's probe file, removed once every host looked

    @property
    def leaders(self) -> list[int]:
        return [ranks[0] for ranks in self.layout.nodes] if self.node_local else [0]

    def clean_up_probe(self) -> None:
        if self.probe is not None:
            self.probe.unlink(missing_ok=True)


def _storage(root: Path, node_local: bool) -> Storage:
    """Probe whether `root` is shared by the hosts, and check it against `node_local` (the config's
    checkpoint.use_node_local_storage) on every rank before anything is written."""
    layout = node_layout()
    if len(layout.nodes) == 1:
        return Storage(layout, False)
    rank = comm.get_rank()
    node = layout.node_of(rank)
    mine = torch.tensor([int.from_bytes(os.urandom(7), "little")], device=comm.device_for_backend())  # not torch's RNG
    nonce = int(comm.all_gather_rows(mine)[0])  # rank 0's
    probe = root / f".zerodp_probe_{nonce}_{node}" if rank == layout.nodes[node][0] else None

    def write_probe() -> None:
        if probe is not None:
            root.mkdir(parents=True, exist_ok=True)
            write_bytes_fresh(probe, b"")

    on_every_rank(write_probe)
    seen = [k for k in range(len(layout.nodes)) if (root / f".zerodp_probe_{nonce}_{k}").exists()]
    reports = comm.gather_messages(",".join(map(str, seen)) if probe is not None else None,
                                   max_bytes=8 * len(layout.nodes) + 8)
    sees = {layout.node_of(r): [int(k) for k in text.split(",") if k] for r, text in enumerate(reports) if text is not None}
    storage = Storage(layout, node_local and not all(len(seen) == len(layout.nodes) for seen in sees.values()), probe)
    problem = _storage_problem(root, layout, sees, node_local)
    if problem:  # every rank has the same reports, so every rank raises it
        on_every_rank(storage.clean_up_probe)
        raise CheckpointError(problem)
    if node_local and not storage.node_local:
        log_rank0("checkpoint.use_node_local_storage is set, but every host sees %s: saving it once, shared", root)
    return storage


def _storage_problem(root: Path, layout: NodeLayout, sees: dict[int, list[int]], node_local: bool) -> str | None:
    """Why `root` cannot take this save: `sees[k]` lists the hosts whose probe host k found there."""
    num_nodes = len(layout.nodes)
    if all(len(seen) == num_nodes for seen in sees.values()):
        return None  # one shared directory: fine with or without the key
    if all(seen == [k] for k, seen in sees.items()):
        if node_local:
            return None
        lacking = next(k for k, seen in sees.items() if 0 not in seen)
        return (f"{root} is not shared by the hosts: {layout.describe(lacking)} does not see what "
                f"{layout.describe(0)} writes there. Save to a directory every host mounts, or set "
                "checkpoint.use_node_local_storage: true to have each host keep its own ranks' files "
                "(`zerodp ckpt gather` reassembles them into one checkpoint)")
    groups = sorted({tuple(seen) for seen in sees.values()})
    return (f"{root} is shared by some hosts but not all (hosts that see each other's files: "
            f"{[[layout.names[k] for k in g] for g in groups]}): a checkpoint needs one directory every host "
            "shares, or (checkpoint.use_node_local_storage) one directory per host")


def _make_empty(tmp: Path, storage: Storage) -> None:
    storage.clean_up_probe()  # every host has looked
    fresh_dir(tmp)  # a crashed earlier attempt's, or a link: see safe_io's [Note: no write through a link]


def _all_ranks_called(what: str) -> None:
    """Fail with the names of the missing ranks instead of hanging when some rank did not call."""
    try:
        comm.barrier_naming_missing_ranks()
    except RuntimeError as err:
        raise RuntimeError(f"{what} must be called on every rank (as in DeepSpeed): {err}") from None


def _agreed_tag(tag: str, policy: str) -> str:
    """The tag every rank saves under: rank 0's. Tags that differ between ranks are an error with
    `tag_validation: Fail`, one warning with `Warn` (DeepSpeed's default) and silent with `Ignore`;
    either way one complete checkpoint is written, under rank 0's tag, not pieces under several."""
    tags = comm.gather_messages(tag)
    if len(set(tags)) == 1:
        return tag
    shown = ", ".join(f"rank {rank} {each!r}" for rank, each in enumerate(tags[:8])) + (", ..." if len(tags) > 8 else "")
    message = f"checkpoint tags differ between ranks: {shown} (checkpoint.tag_validation={policy})"
    if policy.lower() == "fail":
        raise CheckpointError(f"{message}; pass the same tag on every rank, or leave it out (global_stepN)")
    if policy.lower() == "warn":
        logger.warning(f"{message}: saving every rank's shard under rank 0's tag {tags[0]!r}")
    return tags[0]


def _rank_payloads(shard: ShardState, rank: int, world: int,
                   copy: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple[str, int, dict]]:
    """(file name, pieces in it, contents) of this rank's shard files: one per batch of
    `resident_pieces` (one, or one per NVMe swap chunk), each made when it is asked for."""
    parts = shard.num_piece_batches()
    for k, (_, make_pieces) in enumerate(shard.resident_pieces(saving=True)):
        pieces = make_pieces()
        data = [{"name": p.name, "offset": p.offset, "numel": p.numel,
                 "tensors": {key: copy(t) for key, t in p.tensors.items()}} for p in pieces]
        yield (rank_file(rank, world, k if parts > 1 else None), len(pieces),
               {"format_version": FORMAT_VERSION, "rank": rank, "world_size": world, "pieces": data})
        del data


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


def _module_extra(shard: ShardState, exclude_frozen: bool) -> dict:
    """Buffers and frozen parameters by state-dict name (trainable ones are in the rank files)."""
    names = shard.trainable_numels()
    trainable = {id(p) for n, p in shard.module.named_parameters() if n in names}
    skip = {n for n, p in shard.module.named_parameters(remove_duplicate=False)
            if id(p) in trainable or (exclude_frozen and not p.requires_grad)}
    extra = shard.gathered_state_dict(keep=lambda n: n not in skip)
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


def _engine_state(shard: ShardState, client_state: dict, extra: dict) -> dict:
    """engine.pt's contents: counters, scaler, scheduler, optimizer groups, sampler, layout."""
    optimizer = shard.optimizer
    return {
        "format_version": FORMAT_VERSION,
        "counters": {k: shard.counters[k] for k in COUNTERS},
        "loss_scaler": shard.loss_scaler.state_dict(),
        "lr_scheduler": shard.lr_scheduler.state_dict() if shard.lr_scheduler is not None else None,
        "optimizer_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        **extra,  # optimizer_scalars, optimizer_state_keys (all ranks'); module_extra: buffers and frozen params
        "client_state": client_state,
        "dataloader": shard.sampler_state(),  # the position of initialize(training_data=...)'s loader
        "strategy_layout": shard.layout_state(),
    }


def _scalar_state(optimizer: torch.optim.Optimizer, group: dict) -> dict:
    """0-dim state (Adam's step) of the group's first parameter that has state: the same for all."""
    for p in group["params"]:
        state = optimizer.state.get(p)
        if state:
            return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()
                    if not isinstance(v, torch.Tensor) or v.dim() == 0}
    return {}


def _gather_digests(written: Written, world: int) -> dict[str, dict]:
    """Every rank's files' sha256, size and piece count, gathered to all ranks (rank 0 writes them
    to meta). A row per rank: [number of files, then per file: 4 sha256 words, bytes, pieces]."""
    row = written.row
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
    if written.engine_digest is not None:
        digests[ENGINE] = dict(written.engine_digest)
    return digests


def _digest_row(tmp: Path, own: list[tuple[str, int]]) -> list[int]:
    """This rank's row for `_gather_digests` (engine.pt is rank 0's own and not in `own`)."""
    row = [len(own)]
    for name, n in own:
        digest = bytes.fromhex(sha256(tmp / name))
        row += [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]
        row += [(tmp / name).stat().st_size, n]
    return row


def _publish(staged: StagedSave, digests: dict) -> None:
    """A leader: meta.json, then the rename that makes the checkpoint visible (see [Note: crash safety])."""
    root, tag, tmp, storage = staged.target.root, staged.target.tag, staged.target.tmp, staged.target.storage
    for r, index in enumerate(staged.piece_indexes):  # in file order: each part holds the next num_pieces of it
        for name in sorted((n for n in digests if n.startswith(f"rank_{r}_of_")), key=rank_file_order):
            count = digests[name].pop("num_pieces")
            digests[name]["pieces"], index = index[:count], index[count:]
        if index:
            raise CheckpointError(f"rank {r}'s files hold fewer pieces than its layout lists ({len(index)} left)")
    for name in digests:
        digests[name].pop("num_pieces", None)
    meta = {**staged.meta, "files": digests}
    if storage.node_local:
        meta["nodes"] = [{"host": name, "ranks": list(ranks), "files": [ENGINE, *sorted(
            n for n in digests if n != ENGINE and file_rank(n) in ranks)]}
            for name, ranks in zip(storage.layout.names, storage.layout.nodes)]
    write_meta(tmp, meta)  # and its checksum: format.py's [Note: meta.json's checksum]
    fsync_dir(tmp)
    final = root / tag
    if os.path.lexists(final):  # saving the same tag again (or a link there): move the old one aside first
        old = root / f"{tag}.old"
        remove_entry(old)  # never followed: a link there is unlinked
        final.rename(old)
        tmp.rename(final)
        remove_entry(old)
    else:
        tmp.rename(final)
    write_recovery_script(root)  # DeepSpeed's `python zero_to_fp32.py . out/` beside the tags
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


def _trainable_shapes(shard: ShardState) -> dict[str, dict]:
    """{name: {"shape", "dtype"}} of every trainable parameter (the working dtype; pieces are fp32)."""
    named = dict(shard.module.named_parameters())
    names = shard.trainable_numels()
    return {n: {"shape": list(getattr(named[n], "ds_shape", named[n].shape)), "dtype": str(named[n].dtype).removeprefix("torch.")} for n in names}


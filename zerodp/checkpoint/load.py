"""engine.load_checkpoint: fill this rank's pieces from any checkpoint, at any world size and stage.

Each rank asks its strategy which pieces it holds now (zero/layout.py), opens only the saved rank
files whose pieces overlap them (meta.json lists them), one file at a time, and copies the
overlapping ranges into live storage. A DeepSpeed ZeRO checkpoint is read the same way: its rank
files are lists of pieces too (see deepspeed.py). Problems found by one rank are shared before the
first collective, so every rank raises instead of some waiting forever.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import Any, Callable

import torch

from zerodp import comm
from zerodp.checkpoint import deepspeed
from zerodp.checkpoint.format import (ENGINE, LATEST, CheckpointError, check_dir_argument, check_tag, complete_tags,
                                      copy_from_mapped, missing_latest_tag, newest_everywhere, on_every_rank, read_latest, read_meta,
                                      rng_file, verified_load)
from zerodp.log import log_rank0, logger
from zerodp.zero.shard_state import ShardState


def load_checkpoint(shard: ShardState, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str | None, dict | None]:
    """Load `load_dir/tag` (default: the tag in `load_dir/latest`) into this rank's `shard`
    (engine.shard_state()), on every rank; a zerodp or a DeepSpeed ZeRO checkpoint. Returns (checkpoint path, client_state), or (None, None)
    when there is nothing to load."""
    with_optimizer = load_optimizer_states and not load_module_only
    with comm.ledger.outside_step():
        root = check_dir_argument(load_dir, "load_dir")
        tag_dir = on_every_rank(lambda: _tag_dir(root, tag))
        if comm.get_world_size() > 1:
            tag_dir = _same_tag_on_every_rank(root, tag_dir)
        if tag_dir is None:
            return None, None
        meta, state, rng, read = on_every_rank(lambda: _read_engine_state(shard, tag_dir, load_module_strict))
        if with_optimizer and meta["optimizer"] not in (None, type(shard.optimizer).__name__):
            raise CheckpointError(f"{tag_dir} holds {meta['optimizer']} state but the engine's optimizer is "
                                  f"{type(shard.optimizer).__name__}; pass load_optimizer_states=False")
        if with_optimizer and len(state["optimizer_groups"]) != len(shard.optimizer.param_groups):
            raise CheckpointError(f"{tag_dir} holds {len(state['optimizer_groups'])} optimizer param groups but the "
                                  f"engine's optimizer has {len(shard.optimizer.param_groups)}; build the groups as "
                                  "the saving run did, or pass load_optimizer_states=False")
        keys = state["optimizer_state_keys"] if with_optimizer else None
        if with_optimizer:
            _create_scalar_state(shard.optimizer, state["optimizer_scalars"])
        on_every_rank(lambda: _fill_pieces(shard, tag_dir, meta, read, keys))
        shard.after_load()
        _load_rest(shard, state, rng, load_module_only, with_optimizer, load_lr_scheduler_states)
    log_rank0("loaded %scheckpoint %s (saved at stage %d by %d ranks)",
              "DeepSpeed " if deepspeed.is_tag_dir(tag_dir) else "", tag_dir, meta["stage"], meta["world_size"])
    return str(tag_dir), state["client_state"]


def _tag_dir(root: Path, tag: str | None) -> Path | None:
    """The directory to load: `root/tag`, or the tag named in `root/latest` (None: nothing saved)."""
    from_latest = tag is None
    if from_latest:
        if not os.path.lexists(root / LATEST):
            logger.warning("no checkpoint to load: %s does not exist", root / LATEST)
            return None
        tag = read_latest(root)
    tag_dir = root / check_tag(tag)
    if not tag_dir.exists() and (root / f"{tag}.old").exists():
        # a save of the same tag was interrupted between its two renames (see save.py)
        logger.warning("%s is missing; loading %s.old, the complete previous save of that tag", tag_dir, tag)
        tag_dir = root / f"{tag}.old"
    elif from_latest and not tag_dir.is_dir():
        raise missing_latest_tag(root, tag)
    return tag_dir


def _same_tag_on_every_rank(root: Path, tag_dir: Path | None) -> Path | None:
    """The tag every rank loads. Ranks see different `latest` only with a directory per host
    (checkpoint.use_node_local_storage) after a save was interrupted while hosts published: then the
    newest of their tags that every host holds complete (format.py's `newest_everywhere`)."""
    names = comm.gather_messages(tag_dir.name if tag_dir is not None else "", max_bytes=512)
    if len(set(names)) == 1:
        return tag_dir
    complete = complete_tags(root, sorted({n for n in names if n}))
    reports = [json.loads(r or "{}") for r in comm.gather_messages(json.dumps(complete), max_bytes=4096)]
    chosen = newest_everywhere(reports)
    found = {n or "nothing": [r for r, m in enumerate(names) if m == n] for n in dict.fromkeys(names)}
    if chosen is None:
        raise CheckpointError(f"the ranks find different checkpoints in {root} (tag: ranks {found}) and no tag is "
                              "complete on every host: copy the newest one to every host, or pass tag=")
    log_rank0("the ranks find different checkpoints in %s (tag: ranks %s), as after a save interrupted while the "
              "hosts published it; loading %s, the newest one every host holds complete", root, found, chosen,
              level=logging.WARNING)
    return root / chosen


Read = Callable[[str], list]  # a rank file's name -> its saved pieces


def _read_engine_state(shard: ShardState, tag_dir: Path, strict: bool) -> tuple[dict, dict, dict | None, Read]:
    """meta.json checked against the model, engine.pt, this rank's RNG state (None if it has none),
    and how to read a rank file's pieces. From a DeepSpeed checkpoint: the same, read from its files
    (its meta has optimizer None; it saves no RNG state)."""
    if deepspeed.is_tag_dir(tag_dir):
        saved = deepspeed.DeepSpeedCheckpoint(tag_dir)
        meta, state, rng, read = saved.meta, saved.state, None, saved.pieces
    else:
        meta = read_meta(tag_dir)
        checked: set[str] = set()  # files whose sha256 was verified
        state, rng = verified_load(tag_dir, ENGINE, meta), _read_rng(tag_dir, meta)
        read = lambda name: verified_load(tag_dir, name, meta, mmap=True, checked=checked)["pieces"]  # noqa: E731
    _check_model(shard, tag_dir, meta, strict)
    return meta, state, rng, read


def _check_model(shard: ShardState, tag_dir: Path, meta: dict, strict: bool) -> None:
    shapes = {n: list(getattr(p, "ds_shape", p.shape)) for n, p in shard.module.named_parameters()}  # stage 3: full
    names = set(shard.trainable_numels())
    trainable = sorted(names)  # sorted: the same message on every rank and in every run
    saved = {n: info["shape"] for n, info in meta["params"].items()}
    wrong = [f"{n} (saved {saved[n]}, model {shapes[n]})" for n in trainable if n in saved and saved[n] != shapes[n]]
    missing = [n for n in trainable if n not in saved]
    unexpected = [n for n in saved if n not in names]
    if wrong or (strict and (missing or unexpected)):
        raise CheckpointError(f"{tag_dir} does not match this model: " + "; ".join(filter(None, [
            f"size differs for {wrong}" if wrong else "", f"missing {missing}" if missing else "",
            f"unexpected {unexpected}" if unexpected else ""])) + " (load_module_strict=False skips missing/unexpected)")


def _create_scalar_state(optimizer: torch.optim.Optimizer, scalars: list[dict]) -> None:
    """Give every optimizer tensor the saved scalar state (Adam's step), through torch's own
    load_state_dict so dtypes and devices follow the optimizer's rules. Element-wise state is
    created batch by batch in `_fill_pieces`."""
    if not any(scalars):
        return
    state, index = {}, 0
    groups = []
    for group, saved in zip(optimizer.param_groups, scalars):
        ids = []
        for _ in group["params"]:
            if saved:  # each parameter its own copy: torch increments `step` in place, per parameter
                state[index] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _fill_pieces(shard: ShardState, tag_dir: Path, meta: dict, read: Read, keys: list[str] | None) -> None:
    """Batch by batch (`Strategy.resident_pieces`): create the batch's element-wise optimizer state
    (`keys`; None: the optimizer state is not loaded), then copy in every saved range that overlaps
    its pieces, reading only the saved files that hold such ranges."""
    short = []
    for tensors, make_pieces in shard.resident_pieces(saving=False):
        if keys:
            dtype = shard.optim_state_dtype  # bf16 masters may keep fp32 state
            for t in tensors:
                shard.optimizer.state[t].update({k: torch.zeros_like(t, dtype=dtype) for k in keys})
        pieces = make_pieces()
        wanted: dict[str, list] = {}
        for piece in pieces:
            wanted.setdefault(piece.name, []).append(piece)
        filled = {id(p): 0 for p in pieces}
        for name, info in meta["files"].items():
            if not any(_overlap(w, o, n) for n_, o, n in info.get("pieces", [])
                                                       for w in wanted.get(n_, [])):
                continue
            for saved in read(name):
                for piece in wanted.get(saved["name"], []):
                    filled[id(piece)] += _copy_overlap(saved, piece, keys is not None)
        short += [p.name for p in pieces if filled[id(p)] != p.numel and p.name in meta["params"]]
    if short:
        raise CheckpointError(f"{tag_dir}: the saved pieces do not cover {short}")


def _overlap(piece: Any, offset: int, numel: int) -> bool:
    return max(piece.offset, offset) < min(piece.offset + piece.numel, offset + numel)


@torch.no_grad()
def _copy_overlap(saved: dict, piece: Any, with_optimizer: bool) -> int:
    lo = max(piece.offset, saved["offset"])
    hi = min(piece.offset + piece.numel, saved["offset"] + saved["numel"])
    if lo >= hi:
        return 0
    for key, dest in piece.tensors.items():
        if key != "master" and not with_optimizer:
            continue
        if key not in saved["tensors"]:
            raise CheckpointError(f"optimizer state '{key}' of {piece.name} is not in the checkpoint "
                                  "(saved with another optimizer?); pass load_optimizer_states=False")
        src = saved["tensors"][key]
        copy_from_mapped(dest[lo - piece.offset : hi - piece.offset], src[lo - saved["offset"] : hi - saved["offset"]])
    return hi - lo


def _load_rest(shard: ShardState, state: dict, rng: dict | None, module_only: bool, with_optimizer: bool,
               with_scheduler: bool) -> None:
    """Buffers and frozen parameters; then, unless module_only, counters, scaler, scheduler, the
    data loader's position, RNG."""
    shard.load_full_state(state["module_extra"])
    if module_only:
        return
    shard.load_layout_state(state.get("strategy_layout"))
    shard.restore_counters(state["counters"])
    shard.loss_scaler.load_state_dict(state["loss_scaler"])
    for group, saved in zip(shard.optimizer.param_groups, state["optimizer_groups"]):
        if with_optimizer:  # hyperparameters; how the optimizer runs (fused, foreach...) stays this run's
            group.update({k: v for k, v in saved.items() if k not in _IMPLEMENTATION_FLAGS})
        elif with_scheduler:  # the scheduler continues from the saved lr, not from the fresh one
            group.update({k: v for k, v in saved.items() if k in ("lr", "initial_lr")})
    if with_scheduler and shard.lr_scheduler is not None and state["lr_scheduler"] is not None:
        shard.lr_scheduler.load_state_dict(state["lr_scheduler"])
    shard.load_sampler_state(state.get("dataloader"))
    if rng is not None:
        _restore_rng(rng)


_IMPLEMENTATION_FLAGS = {"foreach", "fused", "capturable", "differentiable"}


def _read_rng(tag_dir: Path, meta: dict) -> dict | None:
    rank = comm.get_rank()
    if rng_file(rank) not in meta["files"]:  # more ranks now, or converted from DeepSpeed (which saves none)
        logger.info("rank %d has no saved RNG state (%s): keeping its own", rank,
                    f"saved by {meta['world_size']} ranks" if rank >= meta["world_size"] else "none was saved")
        return None
    return verified_load(tag_dir, rng_file(rank), meta)


def _restore_rng(rng: dict) -> None:
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])

"""`zerodp ckpt gather`: one checkpoint from the hosts' directories of a node-local save.

A save with `checkpoint.use_node_local_storage` leaves on each host DIR/TAG with that host's rank files,
its own engine.pt and a meta.json whose `nodes` says which host holds which file (save.py's [Note:
node-local storage]). Copied side by side onto one machine (rsync, or the hosts' disks mounted), the
directories hold every file once; gathering copies each, checked against its sha256 as it is copied,
into OUT/TAG with host 0's engine.pt, and writes a meta.json without `nodes`: a checkpoint like any
shared one, which loads at any world size and stage. No collectives; OUT is published as a save is
(TAG.tmp, fsync, rename, then `latest`), so an interrupted gather leaves nothing loadable half-written;
and, as a save does, OUT/zero_to_fp32.py (recovery_script.py).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO, Callable

from zerodp.checkpoint.convert import resolve_tag_dir
from zerodp.checkpoint.format import (ENGINE, META, CheckpointError, complete_tags, fsync_dir, newest_everywhere,
                                      read_meta, replace_latest, write_meta)
from zerodp.checkpoint.recovery_script import write_recovery_script
from zerodp.checkpoint.safe_io import discard, fresh_dir, output_inside_input, write_fresh

Progress = Callable[[int, int], None]  # (bytes copied, bytes in all)


def gather_checkpoint(host_dirs: list[str | Path], out_dir: str | Path, tag: str | None = None,
                      progress: Progress | None = None) -> Path:
    """Reassemble the node-local checkpoint `tag` (default: each directory's `latest`) from
    `host_dirs` (one checkpoint directory per host, in any order) into `out_dir`. Returns OUT/TAG."""
    sources = _tag_dirs(host_dirs, tag)
    metas = [read_meta(s) for s in sources]
    base = _check_same_save(sources, metas)
    holder = _holder_of_every_file(sources, base)
    out_root = Path(out_dir)
    problem = output_inside_input(out_root, [Path(d) for d in host_dirs], "--out")
    if problem:
        raise CheckpointError(problem)
    final = out_root / sources[0].name
    if os.path.lexists(final):
        raise CheckpointError(f"{final} exists already; gather into another directory, or remove it first")
    tmp = fresh_dir(out_root / f"{final.name}.tmp")  # a gather interrupted earlier, or a link: replaced
    try:
        files = dict(base["files"])
        files[ENGINE] = metas[holder[ENGINE]]["files"][ENGINE]
        total, done = sum(files[name]["bytes"] for name in holder), 0
        for name, k in sorted(holder.items()):
            _copy_checked(sources[k] / name, tmp / name, files[name]["sha256"])
            done += files[name]["bytes"]
            if progress is not None:
                progress(done, total)
        meta = {key: value for key, value in base.items() if key != "nodes"}
        meta["files"] = files
        write_meta(tmp, meta)
        fsync_dir(tmp)
        tmp.rename(final)
        write_recovery_script(out_root)  # a checkpoint folder like a save's: DeepSpeed's consolidation script too
        replace_latest(out_root, final.name)
    except BaseException:
        discard(tmp)
        raise
    return final


def _tag_dirs(host_dirs: list[str | Path], tag: str | None) -> list[Path]:
    """Each host's DIR/TAG. Without `tag`, hosts whose `latest` differ (a save interrupted while the
    hosts published it) give the newest tag that every directory holds complete, as a load does."""
    sources = [resolve_tag_dir(d, tag) for d in host_dirs]
    names = sorted({s.name for s in sources})
    if tag is not None or len(names) == 1:
        return sources
    chosen = newest_everywhere([complete_tags(s.parent, names) for s in sources])
    if chosen is None:
        raise CheckpointError(f"the directories' latest tags differ ({names}) and none of those tags is complete in "
                              "every directory; pass --tag")
    return [s.parent / chosen for s in sources]


def _check_same_save(sources: list[Path], metas: list[dict]) -> dict:
    """The hosts' metas describe one node-local save: same tag, layout and files (engine.pt aside)."""
    for source, meta in zip(sources, metas):
        if "nodes" not in meta:
            raise CheckpointError(f"{source} is not a node-local checkpoint (its meta.json has no 'nodes'): it "
                                  "holds every rank's files already and loads as it is")

    def comparable(meta: dict) -> dict:
        return {**meta, "files": {n: f for n, f in meta["files"].items() if n != ENGINE}}

    for source, meta in zip(sources[1:], metas[1:]):
        if source.name != sources[0].name or comparable(meta) != comparable(metas[0]):
            raise CheckpointError(f"{source} and {sources[0]} are not parts of the same save (their tags or "
                                  "meta.json differ); give one directory per host, all of the same tag")
    return metas[0]


def _holder_of_every_file(sources: list[Path], meta: dict) -> dict[str, int]:
    """Which source holds each file (engine.pt: the one of the host that ran rank 0)."""
    holder = {}
    for node in meta["nodes"]:
        for name in node["files"]:
            if name == ENGINE and 0 not in node["ranks"]:
                continue
            have = [k for k, s in enumerate(sources) if (s / name).is_file()]
            if not have:
                raise CheckpointError(f"no directory given holds {name}, which host {node['host']} (ranks "
                                      f"{node['ranks']}) saved: add that host's copy of {sources[0].name}")
            holder[name] = have[0]
    missing = sorted(set(meta["files"]) - set(holder))
    if missing:
        raise CheckpointError(f"{sources[0] / META} lists files no host's entry holds: {missing}")
    return holder


def _copy_checked(src: Path, dest: Path, expected_sha256: str) -> None:
    """Copy `src` to a fresh `dest`, fsynced, hashing as it goes; a file that differs from its sha256 fails."""
    digest = hashlib.sha256()

    def copy(fout: BinaryIO) -> None:
        with open(src, "rb") as fin:
            for block in iter(lambda: fin.read(1 << 24), b""):
                digest.update(block)
                fout.write(block)

    write_fresh(dest, copy, src.stat().st_size)
    if digest.hexdigest() != expected_sha256:
        raise CheckpointError(f"{src} is corrupt: its sha256 differs from the one in its meta.json (truncated or "
                              "modified after the save); copy it from its host again")

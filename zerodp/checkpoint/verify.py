"""`zerodp ckpt inspect`: what a checkpoint holds, and whether its files are what was saved.

    zerodp ckpt inspect ckpt/           # every file: there, its recorded size, a whole zip archive
    zerodp ckpt inspect ckpt/ --deep    # and its sha256 recomputed (reads every byte)

A zerodp checkpoint records each file's size and sha256 in meta.json, and meta.json's own sha256 in
meta.json.sha256 (format.py's [Note: meta.json's checksum]), checked whenever meta.json is read. The
quick pass checks each file's presence, size and zip directory; `deep` re-hashes every byte. A
DeepSpeed checkpoint records no checksums: each file is opened as a load opens it (the pickled
structure read through the allowlist, tensors mapped, nothing run), and `deep` checks the CRC-32 of
every member of its zip archive, which torch.save writes and torch.load never checks.
"""

from __future__ import annotations

import math
import os
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from zerodp.checkpoint import deepspeed
from zerodp.checkpoint.convert import resolve_tag_dir
from zerodp.checkpoint.format import META, META_SHA256, CheckpointError, read_meta, sha256


@dataclass
class Inspection:
    """A checkpoint's summary (`lines`, one per file after a header) and its damaged files
    (`damaged`: "PATH is damaged: what", one per file; empty when every file is as recorded)."""

    lines: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)


def inspect_checkpoint(ckpt_dir: str | Path, tag: str | None = None, deep: bool = False) -> Inspection:
    """Summarize and verify the checkpoint `ckpt_dir/tag` (default: the tag in `ckpt_dir/latest`, or
    `ckpt_dir` itself when it is a tag directory), zerodp's or DeepSpeed's. `deep` (default False)
    also recomputes every file's checksum. CheckpointError when the checkpoint cannot be read at all
    (no tag, damaged `latest` or meta.json); a damaged data file is listed in `damaged` instead."""
    root = Path(ckpt_dir)
    ds_dir = deepspeed.find_tag_dir(root, tag) if root.is_dir() else None
    if ds_dir is not None:
        return _inspect_deepspeed(ds_dir, deep)
    return _inspect_zerodp(resolve_tag_dir(root, tag), deep)


def _inspect_zerodp(tag_dir: Path, deep: bool) -> Inspection:
    meta = read_meta(tag_dir)  # meta.json against its checksum: damage there raises, naming it
    numel = sum(math.prod(p["shape"]) for p in meta["params"].values())
    size = sum(f["bytes"] for f in meta["files"].values())
    checksum = (f"sha256 verified against {META_SHA256}" if (tag_dir / META_SHA256).exists()
                else f"no {META_SHA256} (saved before zerodp wrote one): unverified")
    found = Inspection([f"{tag_dir}: format {meta['format_version']}, saved by {meta['world_size']} ranks at ZeRO stage "
                        f"{meta['stage']}, {meta['precision']}, optimizer {meta['optimizer']}",
                        f"  {len(meta['params'])} trainable parameters, {numel:,} elements; {len(meta['files'])} files, "
                        f"{size:,} bytes; {META}: {checksum}"])
    for node in meta.get("nodes", []):
        found.lines.append(f"  node-local: host {node['host']} holds {len(node['files'])} files (ranks {node['ranks']})")
    elsewhere = _held_elsewhere(tag_dir, meta)
    for name, info in sorted(meta["files"].items()):
        problem, status = _file_status(tag_dir / name, info, deep)
        if problem == "missing" and name in elsewhere:
            problem, status = None, "(on another host)"
        found.lines.append(f"  {name:<24} {info['bytes']:>14,} bytes  sha256 {info['sha256'][:16]}...  "
                           f"{len(info.get('pieces', [])):>4} pieces  {status}")
        if problem:
            found.damaged.append(f"{tag_dir / name} is damaged: {problem}")
    checked = "sizes, zip directories and sha256 (--deep)" if deep else "sizes and zip directories (--deep: sha256 too)"
    found.lines.append(f"  {len(found.damaged)} of {len(meta['files'])} files damaged; checked {checked}")
    return found


def _held_elsewhere(tag_dir: Path, meta: dict) -> set[str]:
    """The files of a node-local checkpoint that other hosts hold: those of every
    host none of whose own files (engine.pt aside: each host has one) this directory holds."""
    nodes = meta.get("nodes", [])
    here = {n["host"] for n in nodes if any((tag_dir / f).exists() for f in n["files"] if f != "engine.pt")}
    return {f for n in nodes if n["host"] not in here for f in n["files"] if f != "engine.pt"}


def _file_status(path: Path, info: dict, deep: bool) -> tuple[str | None, str]:
    """(what is wrong with one file of a zerodp checkpoint, or None; its status in the listing)."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return "missing", "MISSING"
    if not stat.S_ISREG(found.st_mode):
        return "not a regular file", "DAMAGED"
    if found.st_size != info["bytes"]:
        return f"{found.st_size:,} bytes, {META} records {info['bytes']:,} (truncated or modified after the save)", "DAMAGED"
    if not zipfile.is_zipfile(path):
        return "not a whole torch.save zip archive (its directory at the end is missing or damaged)", "DAMAGED"
    if deep and sha256(path) != info["sha256"]:
        return f"its sha256 differs from the one {META} records (modified after the save)", "DAMAGED"
    return None, "ok (sha256)" if deep else "ok (size)"


def _inspect_deepspeed(tag_dir: Path, deep: bool) -> Inspection:
    """A DeepSpeed tag directory: every .pt file opened as a load opens it (and with `deep`, its zip
    members' CRC-32 checked), then, when all are readable, what the checkpoint holds."""
    files = sorted(p for p in tag_dir.iterdir() if p.name.endswith(".pt"))
    found = Inspection()
    statuses = {}
    for path in files:
        problem = _deepspeed_file_problem(path, deep)
        statuses[path.name] = "DAMAGED" if problem else "ok (CRC-32)" if deep else "ok (readable)"
        if problem:
            found.damaged.append(problem)
    if found.damaged:
        found.lines.append(f"{tag_dir}: DeepSpeed ZeRO checkpoint, {len(files)} files")
    else:
        try:
            saved = deepspeed.DeepSpeedCheckpoint(tag_dir)
        except CheckpointError as err:  # readable files whose contents do not fit together
            found.damaged.append(str(err))
            found.lines.append(f"{tag_dir}: DeepSpeed ZeRO checkpoint, {len(files)} files")
        else:
            numel = sum(math.prod(p["shape"]) for p in saved.meta["params"].values())
            found.lines += [f"{tag_dir}: DeepSpeed ZeRO checkpoint, saved by {saved.world_size} ranks at ZeRO stage "
                            f"{saved.stage}, {saved.precision}",
                            f"  {len(saved.meta['params'])} trainable parameters, {numel:,} elements; {len(files)} files, "
                            f"{sum(p.stat().st_size for p in files):,} bytes; DeepSpeed records no checksums"]
    found.lines += [f"  {p.name:<48} {p.stat().st_size:>14,} bytes  {statuses[p.name]}" for p in files]
    checked = "pickled structure and zip members' CRC-32 (--deep)" if deep else "pickled structure (--deep: CRC-32 too)"
    found.lines.append(f"  {len(found.damaged)} of {len(files)} files damaged; checked {checked}")
    return found


def _deepspeed_file_problem(path: Path, deep: bool) -> str | None:
    """What is wrong with one file of a DeepSpeed checkpoint (None: it reads, and with `deep` every
    zip member matches its CRC-32)."""
    is_zip = zipfile.is_zipfile(path)
    try:
        deepspeed.load_pickle(path, mmap=is_zip)
    except CheckpointError as err:
        return str(err)
    if deep and is_zip:
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError) as err:
            bad = str(err)
        if bad is not None:
            return f"{path} is damaged: zip member {bad} fails its CRC-32 (corrupted after the save)"
    return None

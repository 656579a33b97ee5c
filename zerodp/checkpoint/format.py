"""The checkpoint format (version 1): names, metadata, checksums, safe reading. No collectives.

    DIR/latest                       the newest complete tag (text, replaced atomically)
    DIR/TAG/meta.json                format version, stage, world size, dtypes, every trainable
                                     parameter (shape, dtype, group), every file's sha256 and size,
                                     and which parameter pieces each rank file holds
    DIR/TAG/meta.json.sha256         meta.json's own sha256, as `sha256sum meta.json` prints it
                                     ([Note: meta.json's checksum])
    DIR/TAG/rank_R_of_W.pt           rank R's owned pieces: fp32 master values and element-wise
                                     optimizer state per (parameter, offset, numel); under NVMe
                                     offload rank_R_of_W_part_K.pt, one per swap chunk
    DIR/TAG/rng_R.pt                 rank R's RNG states (python, numpy, torch, cuda)
    DIR/TAG/engine.pt                rank 0: counters, loss scaler, scheduler, optimizer
                                     hyperparameters and scalar state per group, module buffers and
                                     frozen parameters, client_state

Pieces are keyed by parameter name and element offset, not by rank, so a checkpoint loads at any
world size and any stage: a loading rank reads only the files whose pieces overlap what it owns
(zero/layout.py decides both sides). Tensors are read with `torch.load(weights_only=True)`;
metadata is JSON. Documented for users in docs/checkpoints.md. The one collective here,
`on_every_rank`, turns one rank's failure into the same error on every rank.

[Note: meta.json's checksum]
meta.json holds every other file's sha256, but nothing held its own: a flipped digit in a shape
read as "does not match this model", in a size or offset as a corrupt rank file, in a step count
not at all. So a save writes its sha256 beside it, into TAG/meta.json.sha256, in the line
`sha256sum` prints ("<64 hex digits>  meta.json"), created fresh and renamed into place with the
tag directory like every other file; meta.json names it ("checksum_file"). Reading compares the
two before parsing anything, so any change to meta.json is reported as damage of meta.json. The
sidecar (not a line in `latest`) because a tag loaded by name never reads `latest`, and DeepSpeed
reads `latest` as the bare tag. The format version stays 1: a reader that does not know the sidecar
loads the checkpoint as before; a meta.json without "checksum_file" and without a sidecar (saved
before zerodp wrote one) loads unverified; one that names its sidecar fails when the sidecar is gone.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import mmap as mmap_module
import os
import pickle
import re
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from zerodp import comm
from zerodp.checkpoint import safe_io
from zerodp.checkpoint.safe_io import torch_save_fresh, write_bytes_fresh
from zerodp.config.read import read_small_file
from zerodp.zero.topology import NodeLayout

FORMAT_VERSION = 1
META = "meta.json"
META_SHA256 = "meta.json.sha256"
ENGINE = "engine.pt"
LATEST = "latest"
MAX_META_BYTES = 1 << 30
"""Largest meta.json read (1 GiB; a model of 100,000 parameters saved by 10,000 ranks writes tens of MB)."""
_MAX_TAG_BYTES = 255  # a tag is one directory name: NAME_MAX on Linux


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: names the file and what is wrong with it."""


def rank_file(rank: int, world_size: int, part: int | None = None) -> str:
    """The name of rank `rank`'s shard file in a checkpoint saved by `world_size` ranks (`part`:
    one of several, written one NVMe swap chunk at a time)."""
    return f"rank_{rank}_of_{world_size}" + (f"_part_{part}" if part is not None else "") + ".pt"


def rank_file_order(name: str) -> tuple[int, int]:
    """(rank, part) of a rank file's name: sorting by it puts every rank's pieces in flat order."""
    fields = name.removesuffix(".pt").split("_")
    return int(fields[1]), int(fields[5]) if len(fields) > 5 else 0


def file_rank(name: str) -> int | None:
    """The rank that wrote a rank or RNG file (None for engine.pt)."""
    match = re.fullmatch(r"(?:rank_(\d+)_of_\d+(?:_part_\d+)?|rng_(\d+))\.pt", name)
    return None if match is None else int(match[1] or match[2])


def rng_file(rank: int) -> str:
    """The name of rank `rank`'s RNG-state file (small: read back by the same rank on resume)."""
    return f"rng_{rank}.pt"


def check_tag(tag: str) -> str:
    """A tag is one directory name: no separators, not '.' or '..', not empty."""
    if not isinstance(tag, str) or not tag or tag in (".", "..") or any(c in tag for c in "/\\\0"):
        raise CheckpointError(f"checkpoint tag {tag!r} is not a plain directory name (it would escape the "
                              "checkpoint directory); use something like 'global_step100'")
    return tag


def check_dir_argument(path: object, argument: str) -> Path:
    """`save_checkpoint(save_dir=...)` / `load_checkpoint(load_dir=...)`: a path, not None or empty
    (which would write into the working directory). A ValueError, as DeepSpeed raises."""
    if path is None or (isinstance(path, str) and not path.strip()):
        raise CheckpointError(f"{argument}={path!r}: a checkpoint directory is needed, e.g. {argument}='checkpoints'")
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"{argument}={path!r}: expected a path (str or os.PathLike), got {type(path).__name__}")
    return Path(path)


def read_latest(root: Path) -> str:
    """The tag named by `root/latest` (checked as a tag: one directory name). CheckpointError naming
    root/latest when it is not a small text file holding one: binary, too long, several lines, a
    FIFO. Whether that tag exists is the caller's to check (load.py also tries TAG.old)."""
    path = root / LATEST
    try:
        text = read_small_file(path, 4 * _MAX_TAG_BYTES).decode("utf-8").strip()
    except UnicodeDecodeError:
        text, problem = "", "it is not UTF-8 text"
    except ValueError as err:
        text, problem = "", str(err)
    else:
        problem = None if text else "it is empty"
    if problem is None and (len(text.encode()) > _MAX_TAG_BYTES or not text.isprintable()):
        problem = f"{text[:60]!r}{'...' if len(text) > 60 else ''} is not one tag name (printable, {_MAX_TAG_BYTES} bytes at most)"
    if problem is None:
        try:
            return check_tag(text)
        except CheckpointError:
            problem = f"{text!r} is not a tag name (a subdirectory of {root}, without '/')"
    raise CheckpointError(f"{path} is damaged: {problem}; it names the newest tag, as save_checkpoint writes it. "
                          "Pass the tag to load explicitly (tag= or --tag), or write its name into that file")


def missing_latest_tag(root: Path, tag: str) -> CheckpointError:
    """The error for a `latest` that names a tag directory which is not there."""
    return CheckpointError(f"{root / LATEST} names tag {tag!r}, but {root / tag} does not exist (removed or never "
                           "copied?); pass an existing tag explicitly (tag= or --tag), or write its name into that file")


def write_meta(tag_dir: Path, meta: dict) -> None:
    """Write `tag_dir/meta.json` and its checksum `meta.json.sha256`, each created fresh and fsynced
    ([Note: meta.json's checksum]); the caller renames the directory into place."""
    data = json.dumps({**meta, "checksum_file": META_SHA256}, indent=1).encode()
    fsync_write(tag_dir / META, data)
    fsync_write(tag_dir / META_SHA256, f"{hashlib.sha256(data).hexdigest()}  {META}\n".encode())


def _checked_meta_bytes(tag_dir: Path) -> bytes:
    """meta.json's bytes, compared with meta.json.sha256 when there is one (CheckpointError naming
    meta.json on any difference; [Note: meta.json's checksum])."""
    path, sidecar = tag_dir / META, tag_dir / META_SHA256
    try:
        data = read_small_file(path, MAX_META_BYTES)
        recorded = read_small_file(sidecar, 1024) if os.path.lexists(sidecar) else None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read: {getattr(err, 'strerror', None) or err}") from None
    if recorded is None:
        return data
    match = re.fullmatch(rb"([0-9a-f]{64}) [ *]meta\.json\n?", recorded)
    if match is None:
        raise CheckpointError(f"{sidecar} is damaged: expected \"<64 hex digits>  meta.json\" (sha256sum's line), "
                              f"found {recorded[:100]!r}; meta.json cannot be verified: restore both from a copy")
    actual = hashlib.sha256(data).hexdigest()
    if actual != match[1].decode():
        raise CheckpointError(f"{path} is damaged: its sha256 {actual[:16]}... differs from {match[1][:16].decode()}... "
                              f"recorded in {META_SHA256} (one of the two was corrupted or modified after the save). Restore it from a "
                              f"copy or load an earlier tag; after an edit on purpose, run `sha256sum meta.json > "
                              f"{META_SHA256}` in {tag_dir}")
    return data


def sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_write(path: Path, data: bytes) -> None:
    """Write `data` to a fresh `path` (never through a link there) and force it to disk."""
    write_bytes_fresh(path, data)


def torch_save_synced(obj: Any, path: Path) -> None:
    """torch.save to a fresh `path` (never through a link there), then fsync."""
    torch_save_fresh(obj, path)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    safe_io.fsync_dir(path)


def replace_latest(root: Path, tag: str) -> None:
    """Point `root/latest` at `tag`, atomically (latest.tmp created fresh, fsync, rename, fsync the
    directory); a link at latest.tmp or latest is replaced, never written through."""
    data = tag.encode()
    safe_io.replace_atomically(root / LATEST, lambda f: f.write(data), len(data))


def complete_tags(root: Path, candidates: list[str]) -> dict[str, int]:
    """{tag: global_steps (-1 if unrecorded)} of the `candidates` complete (with meta.json) in `root`."""
    complete = {}
    for tag in candidates:
        try:
            complete[tag] = int(json.loads(read_small_file(root / tag / META, MAX_META_BYTES)).get("global_steps", -1))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, TypeError, AttributeError):
            complete[tag] = -1
    return complete


def newest_everywhere(holders: list[dict[str, int]]) -> str | None:
    """The tag every holder (a host's directory) has complete with the most global steps, from each
    holder's `complete_tags` (None: no tag is complete everywhere). Hosts' `latest` differ only after
    a node-local save was interrupted while they published (save.py's [Note: node-local storage])."""
    everywhere = [tag for tag in holders[0] if all(tag in h for h in holders)]
    return max(everywhere, key=lambda tag: holders[0][tag]) if everywhere else None


def read_meta(tag_dir: Path) -> dict:
    """meta.json of a checkpoint, checked for presence, format version and structure: every problem
    is named with the file, so a damaged or hand-edited meta.json never surfaces as a KeyError."""
    path = tag_dir / META
    if not path.exists():
        raise CheckpointError(f"{path} is missing: {tag_dir} is not a complete zerodp checkpoint "
                              "(an interrupted save leaves TAG.tmp, never a TAG without meta.json)")
    data = _checked_meta_bytes(tag_dir)
    try:
        meta = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path} is damaged: not valid UTF-8 JSON ({err}); restore it from the copy "
                              "that was saved, or load an earlier tag") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {version} is newer than this zerodp reads "
                              f"({FORMAT_VERSION}); upgrade zerodp to load it")
    problems = meta_problems(meta)
    if not problems and meta.get("checksum_file") is not None and not os.path.lexists(tag_dir / META_SHA256):
        problems = [f"{META_SHA256}, which it names as its checksum, is missing (meta.json cannot be verified; "
                    "restore it from a copy)"]
    if problems:
        raise CheckpointError(f"{path} is damaged: " + "; ".join(problems))
    return meta


_META_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format_version": (lambda v: _is(v, int), "an integer"),
    "stage": (lambda v: _is(v, int) and v in range(4), "0, 1, 2 or 3"),
    "world_size": (lambda v: _is(v, int) and v >= 1, "a positive integer"),
    "precision": (lambda v: isinstance(v, str), "a string"),
    "optimizer": (lambda v: v is None or isinstance(v, str), "a class name (null: converted from DeepSpeed)"),
    "params": (lambda v: isinstance(v, dict), "an object"),
    "files": (lambda v: isinstance(v, dict), "an object"),
    "tied": (lambda v: v is None or isinstance(v, dict), "an object of {alias: name}"),
    "checksum_file": (lambda v: v in (None, META_SHA256), f"{META_SHA256!r} (or absent: saved before zerodp wrote it)"),
}
_FILE_NAME = re.compile(r"(rank_\d+_of_\d+(_part_\d+)?|rng_\d+|engine)\.pt")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def meta_problems(meta: Any) -> list[str]:
    """Everything wrong with the structure of a parsed meta.json (empty when it is well formed).
    File names must be ones a save writes (a name like '../x.pt' would read outside the tag)."""
    if not isinstance(meta, dict):
        return [f"the top level is a {type(meta).__name__}, not an object"]
    problems = [f"'{key}' is {meta.get(key)!r}, expected {what}" for key, (ok, what) in _META_KEYS.items()
                if not ok(meta.get(key))]
    for name, info in _items(meta.get("params")):
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or not all(
                _is(d, int) and d >= 0 for d in info["shape"]):
            problems.append(f"params['{name}'] has no valid 'shape' (a list of sizes)")
    for name, info in _items(meta.get("files")):
        problems += [f"files['{name}']: {p}" for p in _file_entry_problems(name, info)]
    nodes = meta.get("nodes", [])
    if not isinstance(nodes, list) or not all(
            isinstance(n, dict) and isinstance(n.get("host"), str) and isinstance(n.get("ranks"), list)
            and all(_is(r, int) for r in n["ranks"]) and isinstance(n.get("files"), list)
            and all(isinstance(f, str) and _FILE_NAME.fullmatch(f) for f in n["files"]) for n in nodes):
        problems.append("'nodes' is not a list of {host, ranks, files} (which host holds which file)")
        return problems
    listed = meta.get("files") if isinstance(meta.get("files"), dict) else {}
    problems += [f"nodes[{k}] (host {n['host']}) names {f}, which 'files' does not list"
                 for k, n in enumerate(nodes) for f in n["files"] if f not in listed]
    return problems


def host_of_file(meta: dict, name: str) -> str | None:
    """'host H (ranks A-B)' holding `name` in a node-local checkpoint (None: one shared directory)."""
    nodes = meta.get("nodes", [])
    layout = NodeLayout(tuple(tuple(n["ranks"]) for n in nodes), tuple(n["host"] for n in nodes))
    return next((layout.describe(k) for k, n in enumerate(nodes) if name in n["files"] and name != ENGINE), None)


def _file_entry_problems(name: str, info: Any) -> list[str]:
    if not _FILE_NAME.fullmatch(name):
        return ["not a file name a zerodp save writes (rank_R_of_W.pt, rng_R.pt, engine.pt); refusing to read it"]
    if not isinstance(info, dict):
        return [f"is {info!r}, expected an object with 'sha256' and 'bytes'"]
    problems = []
    if not isinstance(info.get("sha256"), str) or not _SHA256.fullmatch(info["sha256"]):
        problems.append(f"'sha256' is {info.get('sha256')!r}, expected 64 hex digits")
    if not _is(info.get("bytes"), int) or info["bytes"] < 0:
        problems.append(f"'bytes' is {info.get('bytes')!r}, expected a size in bytes")
    pieces = info.get("pieces", [])
    if not isinstance(pieces, list) or not all(
            isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and _is(p[1], int) and _is(p[2], int)
            for p in pieces):
        problems.append("'pieces' is not a list of [parameter name, offset, numel]")
    return problems


def _items(value: Any) -> list:
    return list(value.items()) if isinstance(value, dict) else []


def _is(value: Any, kind: type) -> bool:
    """isinstance, where a bool is not an int (JSON true would pass as 1)."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def verified_load(tag_dir: Path, name: str, meta: dict, mmap: bool = False, checked: set | None = None) -> Any:
    """Load one tensor file after checking it exists and matches its recorded size and sha256;
    never unpickles code (weights_only). With `mmap`, tensors view the mapped file and take memory
    only for the pages read (see `release_pages`). Names in `checked` skip the sha256 (it was
    verified by an earlier call); the name is added once verified."""
    path = tag_dir / name
    recorded = meta["files"].get(name)
    if recorded is None:
        raise CheckpointError(f"{path} is not listed in {tag_dir / META}")
    if not path.exists():
        host = host_of_file(meta, name)
        if host is not None:
            raise CheckpointError(
                f"{path} is not on this host: this checkpoint was saved with checkpoint.use_node_local_storage "
                f"and {host} holds that file. Load it on the hosts that saved it, with the same ranks on each "
                "(a static rendezvous: --node-rank), or gather the hosts' directories into one checkpoint that "
                "loads anywhere: zerodp ckpt gather DIR_OF_HOST0 DIR_OF_HOST1 ... --out DIR")
        raise CheckpointError(f"{path} is missing (saved by {meta['world_size']} ranks; every rank file is needed)")
    if path.stat().st_size != recorded["bytes"] or (
            (checked is None or name not in checked) and sha256(path) != recorded["sha256"]):
        raise CheckpointError(f"{path} is corrupt: its size or sha256 differs from {META} "
                              "(truncated or modified after the save)")
    if checked is not None:
        checked.add(name)
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a zerodp checkpoint file: zerodp writes torch.save zip archives, "
                              "this is another format (a legacy pickle, or not a torch file at all)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path} holds a pickled Python object, which zerodp refuses to load "
                              f"(it could run code): {str(err).splitlines()[-1][:200]}") from None


_PAGE = mmap_module.PAGESIZE
_MADV_DONTNEED = 4


def copy_from_mapped(dest: torch.Tensor, src: torch.Tensor, chunk: int = 1 << 22) -> None:
    """dest.copy_(src) for a 1-d `src` from `verified_load(..., mmap=True)`, releasing the mapped pages
    every `chunk` elements: a 1 GiB piece costs 16 MiB of resident file pages, not 1 GiB."""
    for lo in range(0, src.numel(), chunk):
        dest[lo : lo + chunk].copy_(src[lo : lo + chunk])
        release_pages(src[lo : lo + chunk])


def release_pages(tensor: torch.Tensor) -> None:
    """Give back the resident pages of a tensor from `verified_load(..., mmap=True)` once it was
    read, so reading a large file piece by piece keeps one piece resident, not the file. The mapping
    is private and never written, so a dropped page is read from the file again if touched: only
    ever call this on such tensors (on an ordinary tensor it would zero memory)."""
    if not sys.platform.startswith("linux") or tensor.numel() == 0:
        return
    start = tensor.data_ptr() // _PAGE * _PAGE
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // _PAGE) * _PAGE
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def on_every_rank(work: Callable[[], Any]) -> Any:
    """comm.on_every_rank for checkpoint work: a peer's CheckpointError is a CheckpointError here
    too (callers catch bad checkpoints by that class); any other peer error is comm.PeerFailed."""
    try:
        return comm.on_every_rank(work)
    except comm.PeerFailed as err:
        if err.error_type == CheckpointError.__name__:
            raise CheckpointError(f"rank {err.rank}: {err.message}") from None
        raise

"""Consolidate a sharded checkpoint into full weights, streaming: `zerodp ckpt convert|inspect`.

    state_dict = zerodp.checkpoint.load_state_dict_from_checkpoint("ckpt")          # in Python
    zerodp ckpt convert ckpt out/ --to safetensors --max-shard-size 2GB            # Hugging Face style

Parameters are assembled from the rank files in file order; a parameter is handed on as soon as
its last piece was read. Rank files are memory-mapped and each piece's pages are given back once
copied, and because every rank's pieces are a contiguous run of each flat group, only the few
parameters that straddle two rank files are ever held partly filled. The output is laid out from
meta.json before any tensor is read, so safetensors shards are written tensor by tensor: memory
stays near the largest tensor (`bench/checkpoint_io.py` measures it). Safetensors files are
written by this module (the format is an 8-byte header length, a JSON header, raw little-endian
data), so no extra package is needed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import struct
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Container, Iterator

import torch

from zerodp.checkpoint import deepspeed
from zerodp.checkpoint.format import (ENGINE, LATEST, META, CheckpointError, check_tag, copy_from_mapped,
                                      missing_latest_tag, rank_file_order, read_latest, read_meta, release_pages,
                                      verified_load)
from zerodp.checkpoint.safe_io import (discard, fsync_dir, replace_atomically, tensor_bytes, torch_save_fresh,
                                       write_fresh)
from zerodp.config.read import read_small_file

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL", torch.int8: "I8"}
Entry = tuple[str, list[int], torch.dtype]  # a tensor of an export: name, shape, dtype


def resolve_tag_dir(ckpt_dir: str | Path, tag: str | None = None) -> Path:
    """DIR/TAG, with TAG from DIR/latest when not given."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root} does not exist" if not root.exists() else
                              f"{root} is a file, not a checkpoint directory")
    if tag is None:
        if (root / "meta.json").exists():  # given the tag directory itself
            return root
        if not os.path.lexists(root / LATEST):
            raise CheckpointError(f"{root} has no 'latest' file; pass the tag (a subdirectory) explicitly")
        tag = read_latest(root)
        if not (root / tag).is_dir():
            raise missing_latest_tag(root, tag)
    return root / check_tag(tag)


def _rank_files(meta: dict) -> list[str]:
    """The files holding pieces, in flat order (a DeepSpeed checkpoint's meta lists them in rank order)."""
    names = [n for n, info in meta["files"].items() if "pieces" in info]
    return sorted(names, key=rank_file_order) if all(n.startswith("rank_") for n in names) else names


def assembly_order(meta: dict) -> list[str]:
    """Trainable parameter names in the order `iter_parameters` completes them, from meta.json
    alone: a writer can lay out its output before reading any tensor."""
    remaining = {name: math.prod(info["shape"]) for name, info in meta["params"].items()}
    order = []
    for file in _rank_files(meta):
        for name, _, numel in meta["files"][file]["pieces"]:
            remaining[name] -= numel
            if remaining[name] == 0:
                order.append(name)
    return order


def iter_parameters(tag_dir: Path, meta: dict, read: Callable[[str], list] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full fp32 tensor) for every trainable parameter, as soon as it is complete, in
    `assembly_order`. Rank files are mapped, not read whole: each piece's pages are released once
    copied, so only the parameters being assembled are resident. `read(file)`: its pieces (default:
    a zerodp rank file's, verified)."""
    params = meta["params"]
    read = read or (lambda file: verified_load(tag_dir, file, meta, mmap=True)["pieces"])
    partial: dict[str, tuple[torch.Tensor, int]] = {}
    for file in _rank_files(meta):
        for piece in read(file):
            name, master = piece["name"], piece["tensors"]["master"]
            full, filled = partial.get(name) or (torch.empty(math.prod(params[name]["shape"])), 0)
            copy_from_mapped(full[piece["offset"] : piece["offset"] + piece["numel"]], master)
            filled += piece["numel"]
            if filled == full.numel():
                partial.pop(name, None)
                yield name, full.view(params[name]["shape"])
            else:
                partial[name] = (full, filled)
    if partial:
        raise CheckpointError(f"{tag_dir}: the rank files do not cover {sorted(partial)}")


class _Source:
    """A checkpoint's full tensors (zerodp's or DeepSpeed's), planned from metadata and then streamed
    in that order: trainable parameters (fp32 masters cast to `dtype`), then buffers and frozen
    parameters as saved."""

    def __init__(self, ckpt_dir: str | Path, tag: str | None, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self.read = None
        self.tag_dir = deepspeed.find_tag_dir(Path(ckpt_dir), tag) if Path(ckpt_dir).is_dir() else None
        if self.tag_dir is not None:
            saved = deepspeed.DeepSpeedCheckpoint(self.tag_dir)
            self.meta, self.extra, self.read = saved.meta, saved.state["module_extra"], saved.pieces
        else:
            self.tag_dir = resolve_tag_dir(ckpt_dir, tag)
            self.meta = read_meta(self.tag_dir)
            self.extra = verified_load(self.tag_dir, ENGINE, self.meta, mmap=True)["module_extra"]  # not read yet
        self.tied = self.meta.get("tied") or {}

    def plan(self) -> list[Entry]:
        """(name, shape, dtype) of every tensor `tensors()` yields, in its order; tied aliases excluded."""
        trainable = self.dtype or torch.float32
        return ([(n, self.meta["params"][n]["shape"], trainable) for n in assembly_order(self.meta)]
                + [(n, list(t.shape), t.dtype) for n, t in self.extra.items()])

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, contiguous CPU tensor) in `plan()` order, each owned by the caller."""
        for name, tensor in iter_parameters(self.tag_dir, self.meta, self.read):
            yield name, tensor.to(self.dtype) if self.dtype is not None else tensor
        for name, tensor in self.extra.items():
            copy = tensor.clone(memory_format=torch.contiguous_format)
            if self.read is None:  # engine.pt is mapped; DeepSpeed's model states are read whole
                release_pages(tensor)
            yield name, copy


def load_state_dict_from_checkpoint(ckpt_dir: str | Path, tag: str | None = None,
                                    dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint (trainable parameters from the fp32 masters, cast
    to `dtype`; buffers and frozen parameters as saved; tied names share one tensor), on the CPU,
    ready for `model.load_state_dict`."""
    source = _Source(ckpt_dir, tag, dtype)
    state = dict(source.tensors())
    state.update({alias: state[name] for alias, name in source.tied.items() if name in state})
    return state


def _shards(plan: list[Entry], max_shard_bytes: int) -> list[list[int]]:
    """Indices into `plan` per output shard: consecutive, at most `max_shard_bytes` each (a larger
    tensor gets a shard of its own)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, dtype) in enumerate(plan):
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def convert_to_safetensors(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None,
                           dtype: torch.dtype | None = torch.float32, max_shard_bytes: int = 5 * 2**30,
                           progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Write Hugging Face style `model-0000i-of-0000n.safetensors` shards of at most
    `max_shard_bytes` (a larger tensor gets a shard of its own) plus `model.safetensors.index.json`.
    Tied parameters are written once, under their first name (as `save_pretrained` does). Each
    tensor is written as soon as it is assembled (headers are laid out from the metadata first), so
    memory stays near the largest tensor. `progress(done, total)` counts tensors written."""
    out, names, shards, _ = _start(ckpt_dir, out_dir, tag, dtype, max_shard_bytes, "model", "safetensors", progress)
    weight_map = {}
    with _removed_on_error(out, names):
        for file, (entries, tensors) in zip(names, shards):
            nbytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in entries)
            write_fresh(out / f"{file}.tmp", functools.partial(_write_shard, entries, tensors), nbytes)
            weight_map.update((name, file) for name, _, _ in entries)
    return _publish(out, names, weight_map, "model.safetensors.index.json")


def convert_to_torch(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None,
                     dtype: torch.dtype | None = torch.float32, max_shard_bytes: int = 5 * 2**30,
                     progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Write `pytorch_model.bin`, or `pytorch_model-0000i-of-0000n.bin` shards of at most
    `max_shard_bytes` plus `pytorch_model.bin.index.json` (the layout `from_pretrained` reads).
    Tied names are kept, sharing one tensor in the same shard. Memory: one shard."""
    out, names, shards, tied = _start(ckpt_dir, out_dir, tag, dtype, max_shard_bytes, "pytorch_model", "bin", progress)
    aliases: dict[str, list[str]] = {}
    for alias, name in tied.items():
        aliases.setdefault(name, []).append(alias)
    weight_map = {}
    with _removed_on_error(out, names):
        for file, (_, tensors) in zip(names, shards):
            shard = {}
            for name, tensor in tensors:
                for key in (name, *aliases.get(name, ())):
                    shard[key] = tensor
                    weight_map[key] = file
            torch_save_fresh(shard, out / f"{file}.tmp")
            del shard
    return _publish(out, names, weight_map, "pytorch_model.bin.index.json")


def _start(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None, dtype: torch.dtype | None,
           max_shard_bytes: int, stem: str, suffix: str, progress: Callable[[int, int], None] | None
           ) -> tuple[Path, list[str], Iterator[tuple[list[Entry], Iterator[tuple[str, torch.Tensor]]]], dict]:
    """What both exports share: the output folder (created), the shard file names, per shard its
    planned entries and a lazy stream of its (name, tensor) in that order (checked against the
    plan, `progress(done, total)` called as each is consumed), and the tied names {alias: name}."""
    source = _Source(ckpt_dir, tag, dtype)
    plan = source.plan()
    groups = _shards(plan, max_shard_bytes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stream = source.tensors()
    done = 0

    def shard_tensors(entries: list[Entry]) -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal done
        for expected, _, _ in entries:
            name, tensor = next(stream)
            if name != expected:
                raise CheckpointError(f"{source.tag_dir}: the rank files hold {name} where {META} puts {expected}")
            yield name, tensor
            done += 1
            if progress is not None:
                progress(done, len(plan))

    entries = [[plan[i] for i in group] for group in groups]
    shards = ((e, shard_tensors(e)) for e in entries)
    return out, _shard_names(stem, suffix, len(groups)), shards, source.tied


@contextlib.contextmanager
def _removed_on_error(out: Path, names: list[str]) -> Iterator[None]:
    """A conversion that fails (a corrupt rank file, a full disk) leaves no partial shard behind."""
    try:
        yield
    except BaseException:
        for name in names:
            discard(out / f"{name}.tmp")
        raise


def _shard_names(stem: str, suffix: str, n: int) -> list[str]:
    return [f"{stem}-{i + 1:05d}-of-{n:05d}.{suffix}" for i in range(n)] if n > 1 else [f"{stem}.{suffix}"]


def _publish(out: Path, names: list[str], weight_map: dict[str, str], index_name: str) -> list[Path]:
    """Rename the finished `.tmp` shards to their names and, for several, write the index."""
    files = [out / name for name in names]
    for file in files:  # rename replaces a link at the final name, never writes through it
        (out / f"{file.name}.tmp").rename(file)
    if len(files) > 1:
        total = sum(f.stat().st_size for f in files)
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        replace_atomically(out / index_name, lambda f: f.write(index.encode()))
        files.append(out / index_name)
    fsync_dir(out)
    return files


def _safetensors_header(entries: list[Entry]) -> bytes:
    """The length-prefixed JSON header of a safetensors file holding `entries` in order."""
    header, offset = {}, 0
    for name, shape, dtype in entries:
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name}: dtype {dtype} has no safetensors code")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded


def _write_shard(entries: list[Entry], tensors: Iterator[tuple[str, torch.Tensor]], f: BinaryIO) -> None:
    """A safetensors file laid out from `entries`, its data streamed from `tensors` (in that order)."""
    f.write(_safetensors_header(entries))
    for _, tensor in tensors:
        _write_bytes(f, tensor)


def _write_bytes(f: BinaryIO, tensor: torch.Tensor) -> None:
    if tensor.numel():
        f.write(memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()))


def write_safetensors(f: BinaryIO, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Write (name, tensor) pairs as one safetensors file into the open file `f`."""
    f.write(_safetensors_header([(n, list(t.shape), t.dtype) for n, t in tensors]))
    for _, t in tensors:
        _write_bytes(f, t)


def save_full_weights(path: Path, state: dict[str, torch.Tensor], skip: Container[str] = ()) -> None:
    """Write a full state dict to `path` (engine.save_16bit_model): safetensors for a `.safetensors`
    name (without the names in `skip`: tied aliases), else torch.save; as PATH.tmp created fresh, then
    renamed into place, so neither a crash nor a link at either name corrupts anything else."""
    if path.suffix == ".safetensors":
        tensors = [(n, t.contiguous()) for n, t in state.items() if n not in skip]
        replace_atomically(path, lambda f: write_safetensors(f, tensors), tensor_bytes(tensors))
    else:
        replace_atomically(path, lambda f: torch.save(state, f), tensor_bytes(state))


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file written by `convert_to_safetensors` (or by anyone) into CPU tensors."""
    codes = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    data = Path(path).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    body = data[8 + length :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = torch.frombuffer(bytearray(body[begin:end]), dtype=torch.uint8) if end > begin else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(codes[info["dtype"]]).reshape(info["shape"])
    return out


HF_CONFIG_FILES = ("config.json", "generation_config.json")
"""What `from_pretrained` needs beside the weights: the model's config (required) and its generation
defaults (when the model has them)."""


MAX_HF_CONFIG_BYTES = 1 << 20
"""Largest config.json / generation_config.json copied (1 MiB: a model's config is a few KiB)."""


def hf_config_problem(src_dir: str | Path) -> str | None:
    """Why `src_dir` cannot give a Hugging Face config (None when it can): checked before converting."""
    try:
        _hf_config_files(src_dir)
    except CheckpointError as err:
        return str(err)
    return None


def _hf_config_files(src_dir: str | Path) -> dict[str, bytes]:
    """{name: bytes} of the HF_CONFIG_FILES in `src_dir` (config.json required), each a regular file
    of at most 1 MiB holding a JSON object; CheckpointError naming --hf-config and the file otherwise."""
    found = {}
    for name in HF_CONFIG_FILES:
        path = Path(src_dir) / name
        if name != "config.json" and not os.path.lexists(path):
            continue
        try:
            data = read_small_file(path, MAX_HF_CONFIG_BYTES)
            kind = type(json.loads(data.decode("utf-8"))).__name__
        except FileNotFoundError:
            raise CheckpointError(f"--hf-config {src_dir}: no config.json there; give the Hugging Face model directory "
                                  "the training started from (what from_pretrained read)") from None
        except (OSError, ValueError) as err:  # not regular, too large, not UTF-8, not JSON
            raise CheckpointError(f"--hf-config {src_dir}: {path} is not a readable JSON config "
                                  f"({getattr(err, 'strerror', None) or err})") from None
        if kind != "dict":
            raise CheckpointError(f"--hf-config {src_dir}: {path} holds a JSON {kind}, not an object; a Hugging Face "
                                  "config is an object of the model's settings")
        found[name] = data
    return found


def copy_hf_config(src_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Copy `config.json` and, if present, `generation_config.json` from a Hugging Face model directory
    into `out_dir`, so `from_pretrained(out_dir)` loads the converted weights. Each must be a small
    regular file holding a JSON object (CheckpointError otherwise, before anything is written).
    Returns the files written."""
    written = []
    for name, data in _hf_config_files(src_dir).items():
        written.append(Path(out_dir) / name)
        replace_atomically(written[-1], lambda f, data=data: f.write(data), len(data))
    return written


def save_hf_config(module: torch.nn.Module, out_dir: str | Path) -> list[Path]:
    """Write a transformers model's `config.json` (and `generation_config.json` when it has one) into
    `out_dir`, as its save_pretrained does; nothing for another module. Returns the files written."""
    config = getattr(module, "config", None)
    if not (hasattr(config, "save_pretrained") and hasattr(module, "save_pretrained")):
        return []
    # save_pretrained opens its files following links: it writes into a directory made fresh for
    # it (mkdtemp), whose files are then renamed into `out_dir` (safe_io's [Note: no write through a link])
    staging = Path(tempfile.mkdtemp(prefix=".zerodp_hf_config_", dir=out_dir))
    try:
        config.save_pretrained(staging)
        generation = getattr(module, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(staging)
        written = [Path(out_dir) / name for name in HF_CONFIG_FILES if (staging / name).is_file()]
        for file in written:
            os.replace(staging / file.name, file)
    finally:
        discard(staging)
    fsync_dir(Path(out_dir))
    return written

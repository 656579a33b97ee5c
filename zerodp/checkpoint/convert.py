"""Consolidate a sharded checkpoint into full weights, streaming: `zerodp ckpt convert|inspect`.

    state_dict = zerodp.checkpoint.load_state_dict_from_checkpoint("ckpt")          # in Python
    zerodp ckpt convert ckpt out/ --to safetensors --max-shard-size 2GB            # Hugging Face style

Parameters are assembled from the rank files in file order, one file in memory at a time; a
parameter is handed on as soon as its last piece was read. Because every rank's pieces are a
contiguous run of each flat group, only the few parameters that straddle two rank files are ever
held partly filled, so memory stays near one rank file plus one output shard. Safetensors files are
written by this module (the format is an 8-byte header length, a JSON header, raw little-endian
data), so no extra package is needed.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Callable, Iterator

import torch

from zerodp.checkpoint.format import ENGINE, LATEST, CheckpointError, check_tag, read_meta, verified_load

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL", torch.int8: "I8"}


def resolve_tag_dir(ckpt_dir: str | Path, tag: str | None = None) -> Path:
    """DIR/TAG, with TAG from DIR/latest when not given."""
    root = Path(ckpt_dir)
    if tag is None:
        if (root / "meta.json").exists():  # given the tag directory itself
            return root
        if not (root / LATEST).exists():
            raise CheckpointError(f"{root} has no 'latest' file; pass the tag (a subdirectory) explicitly")
        tag = (root / LATEST).read_text().strip()
    return root / check_tag(tag)


def iter_parameters(tag_dir: Path, meta: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full fp32 tensor) for every trainable parameter, as soon as it is complete."""
    params = meta["params"]
    partial: dict[str, tuple[torch.Tensor, int]] = {}
    rank_files = sorted((n for n in meta["files"] if n.startswith("rank_")), key=lambda n: int(n.split("_")[1]))
    for name in rank_files:
        for piece in verified_load(tag_dir, name, meta)["pieces"]:
            full, filled = partial.get(piece["name"]) or (torch.empty(math.prod(params[piece["name"]]["shape"])), 0)
            full[piece["offset"] : piece["offset"] + piece["numel"]].copy_(piece["tensors"]["master"])
            filled += piece["numel"]
            if filled == full.numel():
                partial.pop(piece["name"], None)
                yield piece["name"], full.view(params[piece["name"]]["shape"])
            else:
                partial[piece["name"]] = (full, filled)
    if partial:
        raise CheckpointError(f"{tag_dir}: the rank files do not cover {sorted(partial)}")


def load_state_dict_from_checkpoint(ckpt_dir: str | Path, tag: str | None = None,
                                    dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint (trainable parameters from the fp32 masters, cast
    to `dtype`; buffers and frozen parameters as saved; tied names share one tensor), on the CPU,
    ready for `model.load_state_dict`."""
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    meta = read_meta(tag_dir)
    state = dict(_tensors(tag_dir, meta, dtype))
    state.update({alias: state[name] for alias, name in meta.get("tied", {}).items() if name in state})
    return state


def _tensors(tag_dir: Path, meta: dict, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in iter_parameters(tag_dir, meta):
        yield name, tensor.to(dtype) if dtype is not None else tensor
    yield from verified_load(tag_dir, ENGINE, meta)["module_extra"].items()


def convert_to_safetensors(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None,
                           dtype: torch.dtype | None = torch.float32, max_shard_bytes: int = 5 * 2**30,
                           progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Write Hugging Face style `model-0000i-of-0000n.safetensors` shards of at most
    `max_shard_bytes` (a larger tensor gets a shard of its own) plus `model.safetensors.index.json`.
    Tied parameters are written once, under their first name (as `save_pretrained` does).
    `progress(done_params, total_params)` is called as parameters are written. Returns the files."""
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    meta = read_meta(tag_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = len(meta["params"])
    current: list[tuple[str, torch.Tensor]] = []  # the shard being filled
    written: list[Path] = []
    weight_map: dict[str, int] = {}
    size = 0
    for done, (name, tensor) in enumerate(_tensors(tag_dir, meta, dtype), start=1):
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            written.append(_write_shard(out, len(written), current))
            current, size = [], 0
        current.append((name, tensor.contiguous()))
        weight_map[name] = len(written)
        size += nbytes
        if progress is not None:
            progress(min(done, total), total)
    written.append(_write_shard(out, len(written), current))
    return _finish_names(out, written, weight_map)


def _write_shard(out: Path, index: int, tensors: list[tuple[str, torch.Tensor]]) -> Path:
    path = out / f"shard_{index}.tmp"
    write_safetensors(path, tensors)
    return path


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Write (name, contiguous tensor) pairs as one safetensors file (no shared storage allowed)."""
    header, offset = {}, 0
    for name, t in tensors:
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name}: dtype {t.dtype} has no safetensors code")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for _, t in tensors:
            f.write(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _finish_names(out: Path, written: list[Path], weight_map: dict[str, int]) -> list[Path]:
    """Rename shards to model-0000i-of-0000n.safetensors and write the index."""
    n = len(written)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors" for i in range(n)]
    for path, name in zip(written, names):
        path.rename(out / name)
    files = [out / name for name in names]
    if n > 1:
        total = sum(f.stat().st_size for f in files)
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        files.append(out / "model.safetensors.index.json")
    return files


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


def describe(ckpt_dir: str | Path, tag: str | None = None) -> str:
    """A summary of a checkpoint for `zerodp ckpt inspect`: what saved it and what it holds."""
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    meta = read_meta(tag_dir)
    numel = sum(math.prod(p["shape"]) for p in meta["params"].values())
    size = sum(f["bytes"] for f in meta["files"].values())
    lines = [f"{tag_dir}: format {meta['format_version']}, saved by {meta['world_size']} ranks at ZeRO stage "
             f"{meta['stage']}, {meta['precision']}, optimizer {meta['optimizer']}",
             f"  {len(meta['params'])} trainable parameters, {numel:,} elements; {len(meta['files'])} files, {size:,} bytes"]
    for name, info in sorted(meta["files"].items()):
        lines.append(f"  {name:<24} {info['bytes']:>14,} bytes  sha256 {info['sha256'][:16]}...  "
                     f"{len(info.get('pieces', []))} pieces")
    return "\n".join(lines)

"""Read a DeepSpeed ZeRO checkpoint (stages 1-3; fp32, bf16, fp16) as zerodp pieces. No collectives.

    engine.load_checkpoint("ds_ckpt")                               # any world size, any stage
    zerodp ckpt convert ds_ckpt out/ --from deepspeed --to zerodp     # a zerodp checkpoint, offline

[Note: DeepSpeed's layout]
A DeepSpeed tag directory holds `mp_rank_00_model_states.pt` (stages 1/2: the full 16-bit module,
counters, scheduler) or one `zero_pp_rank_R_mp_rank_00_model_states.pt` per rank (stage 3: the
module's parameters are empty placeholders), and one `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`
per rank with that rank's fp32 master partition and the torch optimizer state of it:
- stages 1/2: per param group, the parameters (in `param_shapes` order) are concatenated into one
  flat group, padded at the end to a multiple of the alignment, and cut into `world` equal
  partitions of P elements; rank R holds [R*P, (R+1)*P) less the end padding (`group_paddings`), and
  `param_slice_mappings` says where each parameter's part starts in it (checked against the
  arithmetic below). The optimizer state has one flat tensor per group, padding included.
- stage 3: every parameter is partitioned on its own into ceil(numel/world) elements per rank (the
  last rank's part padded); a sub-group (`param_shapes[k]`) concatenates its parameters' parts, and
  the optimizer holds one flat tensor per sub-group; its param groups list their sub-groups.
Each rank file is thus a list of (parameter, offset, numel) pieces exactly like a zerodp rank file,
and the loader in load.py resharding zerodp checkpoints reads it unchanged: any world size, any
stage. Frozen parameters and buffers come from the model states (stage 3: each rank's fragment of
every frozen parameter), counters and the scheduler from rank 0's.

The files are pickles that name DeepSpeed classes (its loss scalers, an enum, a dataclass). They
are read with `torch.load(weights_only=True)` and an allowlist mapping exactly those names to plain
stand-ins defined here, so no code from the file runs and DeepSpeed need not be installed; a file
naming anything else is refused with the name (see `load_pickle`).
"""

from __future__ import annotations

import enum
import math
import pickle
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from zerodp.checkpoint.format import (ENGINE, FORMAT_VERSION, LATEST, META, CheckpointError, check_tag, fsync_dir,
                                      rank_file, read_latest, replace_latest, sha256, torch_save_synced, write_meta)
from zerodp.checkpoint.recovery_script import SCRIPT_NAME, write_recovery_script
from zerodp.checkpoint.safe_io import discard, fresh_dir, output_inside_input

MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
_MODEL_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")
# model-states keys DeepSpeed writes itself; every other key is the caller's client_state
_DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                   "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                   "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                   "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info"}


class _Record:
    """Stand-in for a DeepSpeed object in a checkpoint: its attributes, nothing else."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)})"


class LossScaler(_Record):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler (static): cur_scale."""


class DynamicLossScaler(_Record):
    """deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler: cur_scale, cur_iter, last_overflow_iter, ..."""


class FragmentAddress(_Record):
    """deepspeed.utils.tensor_fragment.fragment_address: where a parameter's part starts in a partition."""


class ZeroStageEnum(enum.IntEnum):
    """deepspeed.runtime.zero.config.ZeroStageEnum."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


ALLOWED_TYPES: dict[str, type] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
}


def load_pickle(path: Path, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) of a DeepSpeed file, its DeepSpeed classes read as the stand-ins
    of ALLOWED_TYPES. Raises CheckpointError naming the type when the file needs anything else.
    `mmap`: tensors view the mapped file (rank files, whose pages the loader gives back)."""
    if not path.exists():
        raise CheckpointError(f"{path} is missing (every file of a DeepSpeed checkpoint is needed)")
    if not zipfile.is_zipfile(path) and _starts_as_zip(path):
        raise CheckpointError(f"{path} is truncated or damaged: it starts as torch.save's zip archive but its "
                              "directory at the end is missing (a copy or save cut short?); copy it again from "
                              "where it was saved")
    if mmap and not zipfile.is_zipfile(path):  # the loader gives mapped pages back (format.release_pages)
        raise CheckpointError(f"{path} is in torch's legacy serialization (DeepSpeed's checkpoint_serialization: "
                              "false), which cannot be memory-mapped; re-save it with torch.save's default format")
    try:
        with torch.serialization.safe_globals([(cls, name) for name, cls in ALLOWED_TYPES.items()]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        try:  # reads the pickle's opcodes, runs nothing
            names = [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(path) if n not in ALLOWED_TYPES]
        except Exception:  # noqa: BLE001 - not a zip archive, or damaged: torch's own words then
            names = []
        what = ", ".join(names) or str(err).strip().splitlines()[-1][:300]
        if not names and re.search(r"truncated|EOF|ran out of input", str(err), re.IGNORECASE):  # not a refused type
            raise CheckpointError(f"{path} is truncated or damaged: torch cannot read it ({what}); copy it again "
                                  "from where it was saved") from None
        raise CheckpointError(f"{path} holds a pickled {what}, which is not among the DeepSpeed types zerodp reads "
                              f"({', '.join(sorted(ALLOWED_TYPES))}); refusing to unpickle it, as it could run code. "
                              "Convert the checkpoint with DeepSpeed's zero_to_fp32.py and load the weights instead") from None
    except Exception as err:  # noqa: BLE001 - torch's reader fails on a damaged file in many types and words,
        # none naming the file (RuntimeError from the zip reader, EOFError, struct.error, ...)
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path} is truncated or damaged: torch cannot read it ({detail}); copy it again "
                              "from where it was saved") from None


def _starts_as_zip(path: Path) -> bool:
    """Whether `path` begins with a zip archive's local header (torch.save's format since torch 1.6)."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def find_tag_dir(root: Path, tag: str | None) -> Path | None:
    """The DeepSpeed tag directory `root/tag` (tag from `root/latest` when None), or `root` itself when
    it is one; None when `root` does not hold a DeepSpeed checkpoint."""
    if is_tag_dir(root):
        return root
    if tag is None:
        if not os.path.lexists(root / LATEST):
            return None
        tag = read_latest(root)
    tag_dir = root / check_tag(tag)
    return tag_dir if is_tag_dir(tag_dir) else None


def is_tag_dir(path: Path) -> bool:
    """Whether `path` is a DeepSpeed ZeRO tag directory (and not a zerodp one)."""
    if not path.is_dir() or (path / "meta.json").exists():
        return False
    return (path / MODEL_STATES).exists() or (path / "zero_pp_rank_0_mp_rank_00_model_states.pt").exists()


class DeepSpeedCheckpoint:
    """One DeepSpeed tag directory, presented the way load.py reads a zerodp checkpoint:

    meta   {"stage", "world_size", "precision", "optimizer": None, "params": {name: {"shape", "dtype"}},
           "files": {optim file: {"pieces": [[name, offset, numel], ...]}}} (meta.json's keys)
    state  engine.pt's keys: counters, loss scaler, scheduler, optimizer groups and scalar state,
           buffers and frozen parameters (`module_extra`), client_state
    pieces(file)  that file's pieces: [{"name", "offset", "numel", "tensors": {"master", "exp_avg", ...}}]

    Rank files are memory-mapped: opening one reads its small pickled structure, tensors are read
    as the loader copies them."""

    def __init__(self, tag_dir: Path) -> None:
        self.tag_dir = tag_dir
        stage3 = not (tag_dir / MODEL_STATES).exists()
        model_files = sorted((p for p in tag_dir.iterdir() if _MODEL_FILE.fullmatch(p.name)), key=_rank_of) \
            if stage3 else [tag_dir / MODEL_STATES]
        states = load_pickle(model_files[0])
        _check_model_states(states, model_files[0])
        self.world_size = int(states["dp_world_size"])
        optim_files = sorted((p for p in tag_dir.iterdir() if _OPTIM_FILE.fullmatch(p.name)), key=_rank_of)
        if [_rank_of(p) for p in optim_files] != list(range(self.world_size)):
            raise CheckpointError(f"{tag_dir} was saved by {self.world_size} ranks but holds optimizer files for ranks "
                                  f"{[_rank_of(p) for p in optim_files]} (expected zero_pp_rank_0..{self.world_size - 1}"
                                  "_mp_rank_00_optim_states.pt); a stage-0 DeepSpeed checkpoint has none and is "
                                  "not supported")
        optim = {p.name: _optimizer_state_dict(load_pickle(p, mmap=True), p) for p in optim_files}
        first = optim[optim_files[0].name]
        self.stage = int(first["zero_stage"])
        if (self.stage == 3) != stage3:
            raise CheckpointError(f"{tag_dir}: the optimizer files say ZeRO stage {self.stage} but the model states "
                                  f"are laid out for {'stage 3' if stage3 else 'stages 1/2'}")
        config = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
        self.precision = _precision(config)
        shapes = [dict(group) for group in states["param_shapes"]]
        self._pieces = {name: (_stage3_pieces if stage3 else _stage12_pieces)(state, shapes, _rank_of(Path(name)),
                                                                            self.world_size, tag_dir / name)
                        for name, state in optim.items()}
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.precision]  # the working dtype
        self.meta = {"stage": self.stage, "world_size": self.world_size, "precision": self.precision, "optimizer": None,
                     "params": {n: {"shape": list(s), "dtype": dtype} for group in shapes for n, s in group.items()},
                     "tied": dict(states.get("shared_params") or {}),
                     "files": {name: {"pieces": [[p["name"], p["offset"], p["numel"]] for p in pieces]}
                               for name, pieces in self._pieces.items()}}
        frozen = _frozen_parameters(model_files, states, stage3, self.world_size)
        self.state = _engine_state(states, first, config, frozen, set(self.meta["params"]))

    def pieces(self, name: str) -> list[dict]:
        return self._pieces[name]


def _rank_of(path: Path) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", path.name).group(1))


def _check_model_states(states: Any, path: Path) -> None:
    if not isinstance(states, dict) or "param_shapes" not in states or "dp_world_size" not in states:
        raise CheckpointError(f"{path} is not the model states of a DeepSpeed ZeRO checkpoint (no param_shapes / "
                              "dp_world_size)")
    if int(states.get("mp_world_size") or 1) != 1:
        raise CheckpointError(f"{path} was saved with tensor or pipeline parallelism (mp_world_size "
                              f"{states['mp_world_size']}); zerodp reads data-parallel ZeRO checkpoints only")


def _optimizer_state_dict(data: Any, path: Path) -> dict:
    state = data.get("optimizer_state_dict") if isinstance(data, dict) else None
    if not isinstance(state, dict) or "zero_stage" not in state:
        raise CheckpointError(f"{path} is not a DeepSpeed ZeRO optimizer file (no optimizer_state_dict.zero_stage)")
    if int(state["zero_stage"]) == 3 and "fp32_flat_groups" not in state or \
            int(state["zero_stage"]) in (1, 2) and "single_partition_of_fp32_groups" not in state:
        raise CheckpointError(f"{path} holds no fp32 master partition (saved with NVMe offload of the optimizer, "
                              "whose state DeepSpeed keeps outside this file?); zerodp cannot read it")
    return state


def _precision(config: dict) -> str:
    for key in ("bf16", "bfloat16", "fp16"):
        if isinstance(config.get(key), dict) and config[key].get("enabled") is True:
            return "fp16" if key == "fp16" else "bf16"
    return "fp32"


def _elementwise(state: dict, numel: int) -> dict[str, torch.Tensor]:
    """A flat partition's element-wise optimizer state (Adam's exp_avg, exp_avg_sq), by key."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() >= numel}


def _stage12_pieces(optim: dict, shapes: list[dict], rank: int, world: int, path: Path) -> list[dict]:
    """See [Note: DeepSpeed's layout], stages 1/2."""
    base = optim["base_optimizer_state"]
    pieces = []
    for g, group in enumerate(shapes):
        master = optim["single_partition_of_fp32_groups"][g]
        size = master.numel() + int(optim["group_paddings"][g])  # P: every rank's partition, padding included
        padding = optim.get("param_alignment_paddings", [[0] * len(group)] * len(shapes))[g]
        state = _elementwise(base["state"].get(g, {}), master.numel())
        mapping = optim.get("param_slice_mappings", [None] * len(shapes))[g]
        begin, end, offset = rank * size, rank * size + master.numel(), 0
        found = {}
        for (name, shape), pad in zip(group.items(), padding):
            numel = math.prod(shape)
            lo, hi = max(begin, offset), min(end, offset + numel)
            if lo < hi:
                found[name] = (lo - begin, hi - lo)
                pieces.append(_piece(name, lo - offset, master, state, lo - begin, hi - lo))
            offset += numel + int(pad)
        if mapping is not None and {n: (a.start, a.numel) for n, a in mapping.items()} != found:
            raise CheckpointError(f"{path}: param group {g}'s partition does not hold the parameter parts its "
                                  f"param_slice_mappings list ({dict(mapping)}; the layout gives {found}); "
                                  "the checkpoint is damaged or from a DeepSpeed layout zerodp does not know")
    return pieces


def _stage3_pieces(optim: dict, shapes: list[dict], rank: int, world: int, path: Path) -> list[dict]:
    """See [Note: DeepSpeed's layout], stage 3."""
    flats, states = optim["fp32_flat_groups"], optim["optimizer_state_dict"]["state"]
    if len(flats) != len(shapes):
        raise CheckpointError(f"{path} has {len(flats)} fp32 sub-groups but the model states list {len(shapes)}")
    pieces = []
    for k, group in enumerate(shapes):
        state = _elementwise(states.get(k, {}), flats[k].numel())
        position = 0
        for name, shape in group.items():
            numel = math.prod(shape)
            part = -(-numel // world)
            held = max(0, min(part, numel - rank * part))
            if held:
                pieces.append(_piece(name, rank * part, flats[k], state, position, held))
            position += part
        if position != flats[k].numel():
            raise CheckpointError(f"{path}: sub-group {k} holds {flats[k].numel()} elements but its parameters' "
                                  f"partitions need {position}; the checkpoint does not match its param_shapes")
    return pieces


def _piece(name: str, offset: int, master: torch.Tensor, state: dict, at: int, numel: int) -> dict:
    tensors = {"master": master[at : at + numel]}
    tensors.update({k: v[at : at + numel] for k, v in state.items()})
    return {"name": name, "offset": offset, "numel": numel, "tensors": tensors}


def _frozen_parameters(model_files: list[Path], states: dict, stage3: bool, world: int) -> dict[str, torch.Tensor]:
    """Full values of the frozen parameters: stage 3 concatenates every rank's fragment."""
    shapes = dict(states.get("frozen_param_shapes") or {})
    if not stage3 or not shapes:
        return {}
    fragments = [states["frozen_param_fragments"]] + [load_pickle(p)["frozen_param_fragments"] for p in model_files[1:]]
    if len(fragments) != world:
        raise CheckpointError(f"{model_files[0].parent} holds model states of {len(fragments)} ranks, saved by {world}")
    return {name: torch.cat([f[name].reshape(-1) for f in fragments])[: math.prod(shape)].view(shape)
            for name, shape in shapes.items()}


def _engine_state(states: dict, optim: dict, config: dict, frozen: dict, trainable: set[str]) -> dict:
    """engine.pt's contents (see save.py `_engine_state`) from DeepSpeed's rank-0 files."""
    if optim["zero_stage"] == 3:
        torch_state = optim["optimizer_state_dict"]
        members = [g["params"] for g in torch_state["param_groups"]]  # each group's sub-groups
    else:
        torch_state = optim["base_optimizer_state"]
        members = [[g] for g in range(len(torch_state["param_groups"]))]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in torch_state["param_groups"]]
    scalars = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in torch_state["state"].get(m[0], {}).items()
                if not isinstance(v, torch.Tensor) or v.dim() == 0} if m else {} for m in members]
    keys = sorted({k for s in torch_state["state"].values() for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim()})
    shared = dict(states.get("shared_params") or {})
    module = {n: t for n, t in states["module"].items() if n not in trainable and n not in shared}
    steps = int(states.get("global_steps") or 0)
    accumulation = config.get("gradient_accumulation_steps")
    return {
        "counters": {"global_steps": steps, "global_samples": int(states.get("global_samples") or 0),
                     "skipped_steps": int(states.get("skipped_steps") or 0),
                     "micro_steps": steps * (accumulation if isinstance(accumulation, int) else 1),
                     "micro_steps_in_step": 0},  # DeepSpeed saves at a boundary
        "loss_scaler": _loss_scaler_state(optim.get("loss_scaler")),
        "lr_scheduler": states.get("lr_scheduler"),
        "optimizer_groups": groups,
        "optimizer_scalars": scalars,
        "optimizer_state_keys": keys,
        "module_extra": {**module, **frozen},
        "client_state": {k: v for k, v in states.items() if k not in _DEEPSPEED_KEYS},
        "dataloader": None,
        "strategy_layout": None,
    }


def _loss_scaler_state(scaler: Any) -> dict:
    """zerodp's loss-scaler state_dict from DeepSpeed's pickled scaler."""
    if isinstance(scaler, DynamicLossScaler):
        fields = vars(scaler)
        return {"type": "dynamic", "loss_scale": float(fields["cur_scale"]), "cur_iter": int(fields["cur_iter"]),
                "last_overflow_iter": int(fields["last_overflow_iter"]), "cur_hysteresis": int(fields["cur_hysteresis"])}
    return {"type": "static", "loss_scale": float(getattr(scaler, "cur_scale", 1.0))}


def convert_to_zerodp(ds_dir: str | Path, out_dir: str | Path, tag: str | None = None,
                      progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Write the DeepSpeed checkpoint `ds_dir` (its `latest` tag, or `tag`) as a zerodp checkpoint
    `out_dir/TAG` saved by as many ranks at the same stage: one rank file per DeepSpeed rank, with
    the same fp32 masters and optimizer state, engine.pt, meta.json; then `out_dir/latest`. Written
    into TAG.tmp and renamed when complete, so a failure leaves no partial TAG; and, as a save does,
    `out_dir/zero_to_fp32.py`. No RNG state (DeepSpeed saves none). `progress(done, total)` counts rank
    files. Returns the files written."""
    source = find_tag_dir(Path(ds_dir), tag)
    if source is None:
        raise CheckpointError(f"{ds_dir} is not a DeepSpeed ZeRO checkpoint (no 'latest' naming a tag directory "
                              f"with {MODEL_STATES} or zero_pp_rank_0_mp_rank_00_model_states.pt)")
    saved = DeepSpeedCheckpoint(source)
    root, name = Path(out_dir), source.name
    problem = output_inside_input(root, [ds_dir])
    if problem:
        raise CheckpointError(problem)
    tmp = fresh_dir(root / f"{name}.tmp")  # an interrupted conversion's, or a link: replaced, never followed
    try:
        files = {}
        for rank, ds_file in enumerate(saved.meta["files"]):
            pieces = saved.pieces(ds_file)
            data = [{**p, "tensors": {k: t.clone() for k, t in p["tensors"].items()}} for p in pieces]
            out = rank_file(rank, saved.world_size)
            torch_save_synced({"format_version": FORMAT_VERSION, "rank": rank, "world_size": saved.world_size,
                               "pieces": data}, tmp / out)
            files[out] = {"sha256": sha256(tmp / out), "bytes": (tmp / out).stat().st_size,
                          "pieces": saved.meta["files"][ds_file]["pieces"]}
            if progress is not None:
                progress(rank + 1, saved.world_size)
        torch_save_synced({"format_version": FORMAT_VERSION, **saved.state}, tmp / ENGINE)
        files[ENGINE] = {"sha256": sha256(tmp / ENGINE), "bytes": (tmp / ENGINE).stat().st_size}
        meta = {"format_version": FORMAT_VERSION, "tag": name, **saved.meta, "files": files,
                "converted_from": f"DeepSpeed {source}"}
        write_meta(tmp, meta)
        fsync_dir(tmp)
        if os.path.lexists(root / name):
            raise CheckpointError(f"{root / name} exists; convert into an empty directory")
        tmp.rename(root / name)
    except BaseException:
        discard(tmp)
        raise
    write_recovery_script(root)  # a zerodp checkpoint folder, so the script a save leaves (recovery_script.py)
    replace_latest(root, name)
    return [root / name / f for f in [*files, META]] + [root / SCRIPT_NAME, root / LATEST]

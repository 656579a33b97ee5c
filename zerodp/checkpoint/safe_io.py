"""How zerodp writes a file into a checkpoint or output directory: fresh, fsynced, renamed into place.

[Note: no write through a link]
A checkpoint directory is often shared (a cluster file system, a colleague's run directory), so a
name in it may already be taken by anything: a stale `latest.tmp` from a killed save, or a symbolic
link someone planted at `latest.tmp` or `TAG.tmp` that points at a file outside. Opening such a name
with open(path, "wb") follows the link and overwrites its target. So every file zerodp writes is
created by `create_fresh`: whatever sits at the (temporary, ours) name is unlinked, never followed,
and the file is made with O_CREAT|O_EXCL|O_NOFOLLOW, which fails rather than follow a link that
appears in between. A temporary directory (TAG.tmp) is made by `fresh_dir`: a link there is removed,
not descended into, and the directory is created anew. Final names are only ever the target of a
rename, and rename(2) replaces a link at its destination instead of following it. The directory the
user names (DIR, --out) may itself be a link (a checkpoint directory on another disk): that is the
user's choice and is followed.

[Note: a full disk]
A write that fails because the disk is full surfaces in many shapes: OSError(ENOSPC) from write or
fsync, or, inside torch.save, torch's own RuntimeError ("[enforce fail at inline_container.cc]
unexpected pos"), which never mentions the disk. `write_fresh` turns any failed write on a device
that is now (nearly) full into `DiskFull`, naming the device, the bytes needed and the bytes free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import torch

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class DiskFull(OSError):
    """A write failed because its file system is full: names the device, the bytes needed and free
    (errno ENOSPC; str() is the message alone, without OSError's "[Errno 28]")."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self) -> tuple:  # OSError pickles (errno, message): rebuild from the message alone
        return type(self), (self.strerror,)


def remove_entry(path: Path) -> None:
    """Remove whatever is at `path` without following it: a link or file is unlinked, a directory
    removed with its contents (links inside are unlinked, not followed). Nothing there: nothing."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def discard(path: Path) -> None:
    """`remove_entry`, ignoring errors: clean-up after a failure, which must not hide that failure."""
    with contextlib.suppress(OSError):
        remove_entry(path)


def fresh_dir(path: Path) -> Path:
    """Make `path` a new, empty directory of ours (parents as needed): anything already there, a
    link included, is removed first, never followed. See [Note: no write through a link]."""
    remove_entry(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkdir(path)
    return path


@contextlib.contextmanager
def create_fresh(path: Path) -> Iterator[BinaryIO]:
    """A new file at `path`, open for binary writing: what was at that name (a stale temporary, a
    link) is unlinked first, and the file is created with O_CREAT|O_EXCL|O_NOFOLLOW, so no write ever
    reaches a link's target. Only for names that are ours to replace (temporary names, files inside a
    directory made by `fresh_dir`)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise IsADirectoryError(errno.EISDIR, "a directory is in the way of a file zerodp writes", str(path))
        os.unlink(path)
    fd = os.open(path, _CREATE_FLAGS, 0o644)
    with os.fdopen(fd, "wb") as f:
        yield f


def write_fresh(path: Path, write: Callable[[BinaryIO], None], needed_bytes: int = 0) -> None:
    """Create `path` fresh (`create_fresh`), let `write(f)` fill it, and fsync it. A write that
    fails on a full disk raises `DiskFull` (see [Note: a full disk]); `needed_bytes`: what the file
    was to hold, for that message (0: unknown)."""
    try:
        with create_fresh(path) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as err:
        full = disk_full_error(path, err, needed_bytes)
        if full is not None:
            raise full from None
        raise


def write_bytes_fresh(path: Path, data: bytes) -> None:
    """Write `data` to a fresh `path` and fsync it."""
    write_fresh(path, lambda f: f.write(data), len(data))


def torch_save_fresh(obj: Any, path: Path) -> None:
    """torch.save `obj` to a fresh `path`, fsynced."""
    write_fresh(path, lambda f: torch.save(obj, f), tensor_bytes(obj))


def replace_atomically(path: Path, write: Callable[[BinaryIO], None], needed_bytes: int = 0) -> None:
    """Write `path` as PATH.tmp (fresh, fsynced), then rename it over `path`, which replaces a link
    there rather than following it; the directory is fsynced so the rename survives a crash."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_fresh(tmp, write, needed_bytes)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in a (nested) dict/list/tuple: about what torch.save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


_TORCH_WRITE_FAILED = re.compile(r"unexpected pos|write failed|failed writing")
"""What torch.save's RuntimeError says when the file under it could not be written."""
_NEARLY_FULL_BYTES = 1 << 20
"""Free space below which a failed write is taken for a full disk: torch.save's RuntimeError says
nothing about why, so the space left on the device is all there is to tell by."""


def disk_full_error(path: Path, err: BaseException, needed_bytes: int) -> DiskFull | None:
    """A `DiskFull` for `err` when it is a write that failed on a full file system (ENOSPC, or a
    failed write, torch.save's included, on a device with less than 1 MiB free); None otherwise."""
    if isinstance(err, DiskFull) or (isinstance(err, RuntimeError) and not _TORCH_WRITE_FAILED.search(str(err))):
        return None
    try:
        usage = os.statvfs(path.parent)
    except OSError:
        return None
    free = usage.f_bavail * usage.f_frsize
    if getattr(err, "errno", None) != errno.ENOSPC and free >= _NEARLY_FULL_BYTES:
        return None
    needed = f"needed {needed_bytes:,} bytes" if needed_bytes else "needed more"
    return DiskFull(f"no space left on {_mount_point(path.parent)} ({needed}, free {free:,} bytes) "
                    f"writing {path}; free space there or write to another disk")


def _mount_point(path: Path) -> str:
    """The mount point holding `path` (what `df` calls the device's place)."""
    path = Path(os.path.realpath(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return str(path)


def output_inside_input(out_dir: str | Path, input_dirs: list[str | Path], what: str = "the output directory") -> str | None:
    """Why `out_dir` may not take an output (None when it may): it is one of `input_dirs`, or inside
    one, after resolving links (writing there would change the checkpoint being read). Checked by
    every `zerodp ckpt` command that writes, and in Python where the output's names are the input's
    (gather, DeepSpeed to zerodp: TAG and `latest`); the Python weight exports allow it, as DeepSpeed's
    `zero_to_fp32.py . output_dir/` run inside a checkpoint directory does."""
    out = os.path.realpath(out_dir)
    for source in input_dirs:
        src = os.path.realpath(source)
        if out == src or out.startswith(src.rstrip(os.sep) + os.sep):
            where = "is" if out == src else "is inside"
            return (f"{what} {out_dir} ({out}) {where} the input checkpoint {source} ({src}): writing there "
                    "would change the checkpoint being read; give a directory outside it")
    return None

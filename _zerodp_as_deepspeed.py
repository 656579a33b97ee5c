"""The ZERODP_AS_DEEPSPEED switch: with ZERODP_AS_DEEPSPEED=1, `import deepspeed` is zerodp.

    ZERODP_AS_DEEPSPEED=1 python train.py          # train.py (or transformers, accelerate, trl) imports deepspeed
    zerodp run --nproc-per-node 2 train.py         # zerodp run and zerodp deepspeed set the variable

`zerodp_as_deepspeed.pth`, installed beside this module in site-packages, imports it at interpreter
start-up only when the variable is set, so every process that inherits the environment (torchrun's and
accelerate's workers included) gets the switch, and a process without it pays nothing and sees a real
DeepSpeed install untouched. `install()` puts one finder first on `sys.meta_path`:
- `deepspeed` and `deepspeed.X.Y` resolve to the modules `zerodp.compat.deepspeed` and
  `zerodp.compat.deepspeed.X.Y` themselves (one module object under two names, so classes and state
  are shared, never imported twice); a path zerodp does not mirror raises `NotProvidedByZerodp`
  naming it;
- `importlib.metadata` finds a `deepspeed` distribution whose version is the DeepSpeed release whose
  API the compatibility package follows, with zerodp's own version as the local part
  (`0.20.2+zerodp.0.1.0`): transformers and accelerate check both that metadata exists and the version.

This file is a top-level module, not part of the `zerodp` package, so the start-up hook does not import
torch; nothing here imports zerodp until a program imports `deepspeed`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys

ENV_VAR = "ZERODP_AS_DEEPSPEED"
TARGET = "zerodp.compat.deepspeed"
DEEPSPEED_API_VERSION = "0.20.2"
"""The DeepSpeed release zerodp.compat.deepspeed reports. Its module paths and signatures follow 0.19.8
(what the tests compare against); 0.20.2 is reported because libraries gate behaviour on it where zerodp
already behaves as 0.20.2 does: ZeRO-3 sums sequence-parallel gradients over the group (DeepSpeed #8854),
and transformers' Trainer multiplies each rank's loss share by the group size for older releases, which
on zerodp would scale the gradients by it."""

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def not_provided_message(path: str) -> str:
    """The message for a DeepSpeed module or attribute that zerodp's compatibility package lacks."""
    return (f"{path} is not provided by zerodp: with {ENV_VAR}=1, `import deepspeed` is "
            f"zerodp's compatibility package, which mirrors the DeepSpeed API that training scripts, Hugging Face "
            f"transformers and accelerate use (docs/deepspeed.md lists it). Unset {ENV_VAR} to use a real DeepSpeed.")


class NotProvidedByZerodp(ModuleNotFoundError):
    """`import deepspeed.X` for a module zerodp does not mirror (an ImportError, so
    `try: import deepspeed.x except ImportError` keeps working)."""

    def __init__(self, path: str) -> None:
        # name stays None on purpose: importlib swallows a ModuleNotFoundError whose .name is the submodule
        # it probed for `from deepspeed.x import y`, which would turn this message into a bare
        # "cannot import name".
        super().__init__(not_provided_message(path))


class AttributeNotProvided(AttributeError):
    """`deepspeed.x.attr` that zerodp does not provide (an AttributeError, so hasattr() is False)."""

    def __init__(self, path: str) -> None:
        super().__init__(not_provided_message(path))


def enabled(environ: dict | None = None) -> bool:
    """Whether ZERODP_AS_DEEPSPEED asks for the switch ("1", "true", "yes", "on"; "0"/"false"/"no"/"off"
    or unset leave `import deepspeed` alone). Another value is named on stderr and leaves it alone."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        sys.stderr.write(f"zerodp: {ENV_VAR}={value!r} is not understood (use 1 to switch it on, 0 for off); "
                         "`import deepspeed` is left alone\n")
    return False


def compat_name(fullname: str) -> str | None:
    """`deepspeed.X.Y` -> `zerodp.compat.deepspeed.X.Y`; None for any other module name."""
    if fullname == "deepspeed" or fullname.startswith("deepspeed."):
        return TARGET + fullname[len("deepspeed"):]
    return None


class _Alias(importlib.abc.Loader):
    """Loads `deepspeed.X` as the already-importable module `zerodp.compat.deepspeed.X`."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # the import system has just set module.__spec__ to the alias's spec; the module keeps its own
        module.__spec__ = self.own_spec

    def get_code(self, fullname: str):
        """The code of the module `deepspeed.X` stands for, for `python -m deepspeed.X` (runpy runs it as
        `__main__`, a fresh module, as it would run DeepSpeed's own file)."""
        return self._target_loader().get_code(self.target)

    def get_source(self, fullname: str) -> str | None:
        return self._target_loader().get_source(self.target)

    def is_package(self, fullname: str) -> bool:
        return self._target_loader().is_package(self.target)

    def _target_loader(self):
        return importlib.util.find_spec(self.target).loader


class _DeepSpeedDistribution(importlib.metadata.Distribution):
    """What importlib.metadata reports for `deepspeed` while the switch is on."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version()}\n"
                    f"Summary: zerodp's DeepSpeed compatibility package ({ENV_VAR}=1)\n"
                    "Author: zerodp\nLicense: Apache-2.0\n")
        if filename == "top_level.txt":
            return "deepspeed\n"
        return None

    def locate_file(self, path) -> pathlib.Path:
        return pathlib.Path(__file__).parent / path


def version() -> str:
    """The `deepspeed` version the switch reports: DeepSpeed's API version + zerodp's as the local part."""
    try:
        zerodp_version = importlib.metadata.version("zerodp")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path, not installed
        zerodp_version = "0"
    return f"{DEEPSPEED_API_VERSION}+zerodp.{re.sub(r'[^0-9A-Za-z]+', '.', zerodp_version)}"


class DeepSpeedAsZerodp(importlib.abc.MetaPathFinder):
    """The finder install() puts first on sys.meta_path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(TARGET + ".") and path is not None:
            # `from deepspeed.x import y` probes the submodule under the module's own name
            # (zerodp.compat.deepspeed.x.y); a missing one must still be named as DeepSpeed's
            if importlib.machinery.PathFinder.find_spec(fullname, path) is None:
                raise NotProvidedByZerodp("deepspeed" + fullname[len(TARGET):])
            return None
        target_name = compat_name(fullname)
        if target_name is None:
            return None
        try:
            found = importlib.util.find_spec(target_name)
        except ModuleNotFoundError:  # a parent is missing too
            found = None
        if found is None:
            raise NotProvidedByZerodp(fullname)
        # origin: `python -m deepspeed.X` runs the file with __file__ set from it
        return importlib.machinery.ModuleSpec(fullname, _Alias(target_name), origin=found.origin,
                                              is_package=found.submodule_search_locations is not None)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = context.name
        if name is None or re.sub(r"[-_.]+", "-", name).lower() == "deepspeed":
            yield _DeepSpeedDistribution()


def install() -> bool:
    """Put the finder first on sys.meta_path when ZERODP_AS_DEEPSPEED asks for it (idempotent); returns
    whether the switch is on. Called by zerodp_as_deepspeed.pth at start-up."""
    if not enabled():
        return False
    if not any(isinstance(finder, DeepSpeedAsZerodp) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedAsZerodp())
    return True
